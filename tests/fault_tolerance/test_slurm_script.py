"""experiments/slurm/ft.sbatch run by bash with SLURM's commands replaced by recorders: it starts the
Lighthouse on the first node, one torchrun per replica group on its own nodes with its own rendezvous, all
pointed at the Lighthouse, and refuses nodes that do not split into whole groups."""

import subprocess
from pathlib import Path

from tests.helpers.slurm_stubs import ROOT, stubbed

STUBS = {
    "scontrol": 'echo "$SLURM_JOB_NODELIST" | tr "," "\\n"',
    "srun": 'echo "TORCHFT_LIGHTHOUSE=$TORCHFT_LIGHTHOUSE $*" >> "$RECORD"',
    "torchft_lighthouse": 'echo "lighthouse $*" >> "$RECORD"; exec sleep 30',
}


def run_script(tmp_path: Path, nodes: str, groups: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    env, record = stubbed(tmp_path, STUBS, SLURM_JOB_NODELIST=nodes)
    script = ROOT / "experiments" / "slurm" / "ft.sbatch"
    result = subprocess.run(
        ["bash", str(script), groups, "my.toml", "--training.steps=5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result, record.read_text().splitlines() if record.exists() else []


def test_the_job_script_starts_the_lighthouse_and_one_torchrun_per_group(tmp_path):
    result, calls = run_script(tmp_path, "n1,n2,n3,n4", "2")
    assert result.returncode == 0, result.stderr
    # The Lighthouse and the groups start in the background: their lines land in either order.
    lighthouse = [line for line in calls if line.startswith("lighthouse ")]
    assert len(lighthouse) == 1 and lighthouse[0].startswith("lighthouse --min_replicas 1")
    groups = sorted(line for line in calls if not line.startswith("lighthouse "))
    assert len(groups) == 2
    for g, (line, hosts) in enumerate(zip(groups, ("n1,n2", "n3,n4"))):
        assert line.startswith("TORCHFT_LIGHTHOUSE=http://n1:29510 ")
        assert f"--nodelist {hosts}" in line and f"--rdzv-endpoint {hosts[:2]}:29500" in line
        assert f"--fault_tolerance.replica_id={g} --fault_tolerance.group_size=2 --training.steps=5" in line


def test_nodes_that_do_not_split_into_groups_are_refused(tmp_path):
    result, calls = run_script(tmp_path, "n1,n2,n3", "2")
    assert result.returncode == 2 and "do not split into 2 replica groups" in result.stderr and calls == []
