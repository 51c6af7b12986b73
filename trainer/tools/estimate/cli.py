"""`trillion estimate`: a full-scale dry run of a config's layout on one CPU (see trainer/tools/estimate/dry_run.py).

  trillion estimate --config experiments/configs/debug_2d_cpu.toml --world-size 4 --hardware frontier
  trillion estimate --config experiments/configs/gpt_1t_frontier.toml --hardware frontier --ranks all
  trillion estimate --config FILE --world-size 3072 --parallel.tp=8 --parallel.dp_shard=384 --steps 2
  trillion estimate --config outputs/plan/qwen3-235b-a22b-dgx-h100-256.toml --world-size 256 --ep 8 --hardware dgx-h100
  trillion estimate ... --mtbf-hours-per-gpu 50000 --checkpoint-save-s 20 --restart-s 600   (goodput under failures)

Prints, per simulated rank (first, second, middle and last pipeline stage and the rank with the most
parameters by default), parameter, gradient, optimizer, activation-peak and buffer bytes next to the
device's capacity and the planner's prediction; exits 1 with a message naming the rank, the
shortfall, what dominates and which setting to change when a rank does not fit. `--steps N` also
runs the training loop for N steps of a tiny model of the layout (trainer/tools/estimate/steps.py).
"""

import contextlib
import dataclasses
import json
import re
import sys

from trillion.errors import ConfigError
from trillion.trainer.cli.args import CommandParser
from trillion.trainer.config.schema import load_config
from trillion.trainer.tools.estimate.dry_run import DEFAULT_RANKS, KINDS, Estimate, estimate, shortfall_message
from trillion.trainer.tools.estimate.steps import run_steps, summary
from trillion.trainer.tools.goodput_args import add_goodput_arguments, checkpoint_share, goodput


def parse(argv: list[str]):
    p = CommandParser("estimate", description=__doc__.split("\n")[0])
    p.add_argument("--config", default=None, help="a config `trillion train` accepts (or --model for the defaults)")
    p.add_argument("--model", default=None, help="a preset (model.name; e.g. qwen3-235b-a22b), over the config's")
    p.add_argument(
        "--ep",
        type=int,
        default=None,
        help="expert-parallel degree of an MoE model (parallel.ep; default: the config's)",
    )
    p.add_argument(
        "--etp",
        type=int,
        default=None,
        help="expert tensor parallelism, 1 (ep folded over the tp ranks) or tp (parallel.etp; default: the config's)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="processes of the run (default: the config's job.world_size, or its `# world_size = N` comment)",
    )
    p.add_argument(
        "--ranks",
        default=DEFAULT_RANKS,
        help=f"first, second, middle, last, max (most parameters), all, or rank numbers (default {DEFAULT_RANKS})",
    )
    p.add_argument(
        "--hardware",
        default=None,
        help="hardware profile whose device capacity to compare (e.g. frontier; default: the config's job.hardware)",
    )
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--no-measure", action="store_true", help="skip the meta activation run; use the planner's figure")
    p.add_argument(
        "--steps",
        type=int,
        default=0,
        help="also run N training steps of a tiny model of the same layout on the fake backend, as the "
        "first and the last simulated rank (see trainer/tools/estimate/steps.py)",
    )
    add_goodput_arguments(p)
    ns, overrides = p.parse_known_args(argv)
    if ns.config is None and ns.model is None:
        raise ConfigError("trillion estimate needs --config FILE or --model NAME (e.g. --model qwen3-235b-a22b).")
    flags = [f"--model.name={ns.model}"] * (ns.model is not None) + [f"--parallel.ep={ns.ep}"] * (ns.ep is not None)
    flags += [f"--parallel.etp={ns.etp}"] * (ns.etp is not None)
    return ns, [*overrides, *flags]


def world_from_comment(path: str) -> int | None:
    try:
        match = re.search(r"^#\s*world_size\s*=\s*(\d+)", open(path).read(), re.M)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def gb(value) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def table(result: Estimate) -> str:
    lay = result.layout
    pipelined = lay["pp"] > 1
    cp = f"cp {lay['cp']} x " if lay["cp"] > 1 else ""
    folded = " folded over tp (etp 1)" if lay.get("etp", 1) == 1 and lay["tp"] > 1 else ""
    ep = f", ep {lay['ep']}{folded} (experts sharded over efsdp {lay['efsdp']})" if lay.get("ep", 1) > 1 else ""
    lines = [
        f"# trillion estimate: {result.config_model} on {result.world_size} ranks "
        f"(pp {lay['pp']} x dp_replicate {lay['dp_replicate']} x dp_shard {lay['dp_shard']} x {cp}tp {lay['tp']}{ep}, "
        f"{lay['dp_shard_mode']}, activation_checkpoint {lay['activation_checkpoint']}, micro-batch "
        f"{lay['micro_batch_size']} x {lay['seq_len']} tokens, {lay['microbatches']} per step, {lay['compute_dtype']})",
        f"# device: {result.device or 'unknown (pass --hardware)'}; simulated {len(result.ranks)} rank(s) "
        f"in {result.seconds:.1f} s; GB = 1e9 bytes",
    ]
    if pipelined:
        receives = (
            "receive buffers live while their micro-batch is in flight (counted in activations)"
            if lay["pp_receive_buffers"] == "in flight"
            else "buffers hold the schedule's receive buffers "
            "(an activation and a gradient for every micro-batch of the step)"
        )
        lines.append(
            f"# pipeline: {lay['pp_schedule']}, {len(lay['stage_units'])} stages ({lay['pp_virtual_stages']} "
            f"per rank); {receives}; buffers hold the stages FSDP keeps gathered through the step"
        )
    header = ["rank", "coords", *(("stages", "in flight") if pipelined else ()), *KINDS, "total", "usable", "fits"]
    rows = [header]
    for r in result.ranks:
        act = gb(r.activations) + ("" if r.activations_source == "measured" else " (predicted)")
        stages = (",".join(map(str, r.detail["stages"])), str(r.detail["in_flight"] or "-")) if pipelined else ()
        rows.append(
            [
                str(r.rank),
                ",".join(f"{k}={v}" for k, v in r.coords.items()) or "-",
                *stages,
                gb(r.parameters),
                gb(r.gradients),
                gb(r.optimizer),
                act,
                gb(r.buffers),
                gb(r.framework),
                gb(r.total),
                gb(r.usable),
                {True: "yes", False: "NO", None: "?"}[r.fits],
            ]
        )
    planner = result.ranks[0].planner if result.ranks else None
    if planner:
        rows.append(
            [
                "planner",
                "(its fullest rank)",
                *(("", "") if pipelined else ()),
                *(gb(planner[k]) for k in KINDS[:5]),
                "(in buffers)",
                gb(planner["total"]),
                gb(result.ranks[0].usable),
                "",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines += [f"# note: {n}" for n in result.notes]
    return "\n".join(lines)


def job_goodput(ns, config, result: Estimate):
    """Goodput of the job (every replica group's GPUs) from the largest checkpoint share of a simulated rank (its
    measured shard and optimizer state); the step time and links from the planner on --hardware (without it,
    unknown: 0)."""
    step_s, link_gbs = 0.0, 0.0
    if ns.hardware:
        from trillion.parallel.planner.cost import step_time
        from trillion.parallel.planner.hardware import load_profile
        from trillion.trainer.tools.estimate.dry_run import layout_dims, planner_assumptions, runnable_here

        hw = load_profile(ns.hardware)
        link_gbs = hw.node_bandwidth_gbs / hw.gpus_per_node
        dims, model_args = layout_dims(runnable_here(config)[0], result.world_size)
        with contextlib.suppress(ConfigError, KeyError):  # a layout the planner has no model of: no step time
            seq_len = config.training.seq_len
            step_s = step_time(model_args, hw, dims.layout, seq_len, planner_assumptions(config)).total
    from trillion.parallel.planner.optimizer import host_ema_bytes

    def average(shard: int) -> int:  # the parameters' float32 average, saved beside them
        return host_ema_bytes(shard)[1] if config.optimizer.ema_decay else 0

    shares = [checkpoint_share(r.parameter_count, r.optimizer, average(r.parameter_count)) for r in result.ranks]
    saved = max(shares, default=0)
    return goodput(ns, result.world_size * config.fault_tolerance.groups, saved, step_s, link_gbs)


def largest_shard(result: Estimate) -> int:
    """The most parameter elements a simulated rank's shard holds (the dry run's local shapes)."""
    return max((r.parameter_count for r in result.ranks), default=0)


def main(argv: list[str]) -> int:
    ns, overrides = parse(argv)
    config = load_config(ns.config, overrides)
    world = ns.world_size or config.job.world_size or (world_from_comment(ns.config) if ns.config else None)
    if world is None:
        raise ConfigError(
            "trillion estimate needs --world-size N"
            + (f" (the config {ns.config} sets no job.world_size)" if ns.config else "")
            + ", e.g. --world-size 3072."
        )
    hardware = ns.hardware or config.job.hardware or None
    config = dataclasses.replace(config, job=dataclasses.replace(config.job, world_size=world))  # --world-size wins

    def progress(done, total, rank):
        if total > 8 and ns.format == "table":
            print(f"\rsimulated rank {rank} ({done}/{total})", end="" if done < total else "\n", file=sys.stderr)

    result = estimate(config, world, ranks=ns.ranks, hardware=hardware, measure=not ns.no_measure, progress=progress)
    message = shortfall_message(result)
    runs, model = [], ""
    if ns.steps > 0:
        ranks = sorted(r.rank for r in result.ranks)
        runs, model = run_steps(config, world, ns.steps, sorted({ranks[0], ranks[-1]}))
    failed = next((run for run in runs if run.failed), None)
    if failed:
        message = " ".join(
            x for x in (message, f"With --steps, the training loop failed as rank {failed.rank}: {failed.failed}") if x
        )
    failures = job_goodput(ns, config, result)
    if ns.format == "json":
        steps = [run.as_dict() for run in runs]
        print(
            json.dumps({**result.as_dict(), "error": message, "steps": steps, "goodput": failures.as_dict()}, indent=1)
        )
    else:
        lines = [table(result), *(f"# {line}" for line in summary(runs, model) if runs)]
        if config.optimizer.ema_decay:  # the parameters' average, in host memory
            from trillion.parallel.planner.hardware import load_profile
            from trillion.parallel.planner.optimizer import host_ema_line

            nodes = load_profile(hardware).gpus_per_node if hardware else 1
            lines.append(f"# {host_ema_line(config.optimizer.ema_decay, largest_shard(result), nodes)}")
        print("\n".join([*lines, *(f"# {line}" for line in failures.lines())]))
    if message:
        print(f"trillion estimate: {message}", file=sys.stderr)
        return 1
    return 0
