"""SLURM's view of a job step, turned into what torch.distributed needs.

`srun python -m trillion train ...` starts one task per GPU with SLURM_PROCID, SLURM_LOCALID,
SLURM_NTASKS and SLURM_STEP_NODELIST (or SLURM_NODELIST) set, but none of torchrun's RANK,
WORLD_SIZE or MASTER_ADDR; the rendezvous host is the first node of the step.
"""

import re

from trillion.errors import ConfigError

DEFAULT_PORT_BASE = 29500


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list: 'frontier[00012-00015,00020],login1' -> every name, in order.

    Ranges keep their zero padding; several bracket groups in one name expand as a product
    ('rack[1-2]-node[01-02]'); commas inside brackets do not split hosts.
    """
    hosts, depth, start = [], 0, 0
    for i, char in enumerate(hostlist + ","):
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            if hostlist[start:i].strip():
                hosts.extend(_expand_one(hostlist[start:i].strip()))
            start = i + 1
    if depth != 0:
        raise ConfigError(f"SLURM host list {hostlist!r} has unbalanced brackets; check SLURM_NODELIST.")
    return hosts


def _expand_one(pattern: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", pattern)
    if match is None:
        return [pattern]
    prefix, suffix = pattern[: match.start()], pattern[match.end() :]
    names = []
    for part in match.group(1).split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ConfigError(f"SLURM host list range {part!r} in {pattern!r} is not numeric; check SLURM_NODELIST.")
        for number in range(int(low), int(high or low) + 1):
            names.append(f"{prefix}{number:0{len(low)}d}")
    return [name + rest for name in names for rest in _expand_one(suffix)]


def torch_env_from_slurm(environ: dict) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT from SLURM's variables.

    Values the user set (or torchrun set) win; MASTER_PORT defaults to a port derived from the
    job id, so two jobs sharing a node do not collide.
    """
    missing = [name for name in ("SLURM_PROCID", "SLURM_NTASKS") if name not in environ]
    if missing:
        raise ConfigError(
            f"Launched under SLURM without {', '.join(missing)}: start the trainer with `srun` "
            "(one task per GPU), not plain `sbatch` or `salloc`."
        )
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist and "MASTER_ADDR" not in environ:
        raise ConfigError(
            "SLURM set no node list (SLURM_STEP_NODELIST / SLURM_NODELIST), so the rendezvous host is "
            "unknown: set MASTER_ADDR (and MASTER_PORT) to the first node of the job."
        )
    tasks_per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or ""
    derived = {
        "RANK": environ["SLURM_PROCID"],
        # The step's own task count: a batch script's shell is a one-task step inside a bigger job.
        "WORLD_SIZE": environ.get("SLURM_STEP_NUM_TASKS", environ["SLURM_NTASKS"]),
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": (
            _first_count(tasks_per_node) or environ.get("SLURM_NTASKS_PER_NODE") or _one_node_tasks(environ) or "1"
        ),
        "MASTER_ADDR": expand_hostlist(nodelist)[0] if nodelist else "",
        "MASTER_PORT": str(DEFAULT_PORT_BASE + int(environ.get("SLURM_JOB_ID", "0")) % 10000),
    }
    return {key: environ.get(key, value) for key, value in derived.items()}


def _one_node_tasks(environ: dict) -> str:
    """A step on one node holds all its tasks there (SLURM leaves the per-node count out at times)."""
    nodes = environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES")
    return environ.get("SLURM_STEP_NUM_TASKS", environ["SLURM_NTASKS"]) if nodes == "1" else ""


def _first_count(tasks_per_node: str) -> str:
    """'8(x4),7' -> '8': the task count of the first node (this is a per-node figure)."""
    match = re.match(r"(\d+)", tasks_per_node)
    return match.group(1) if match else ""
