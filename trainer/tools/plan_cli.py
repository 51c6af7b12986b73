"""`trillion plan`: rank the parallel layouts of a model on a machine, predict their throughput,
memory, time-to-train, energy and cost, and write the best one as a `trillion train` config.

  trillion plan --model gpt-1t --hardware frontier --gpus 3072 --global-batch 1024 --tokens 20e12
  trillion plan ... --tp 4 --pp 128 --micro-batch-size 1     (fixed settings: evaluate one layout)
  trillion plan ... --optimizer muon                           (Muon's state and step instead of AdamW's)
  trillion plan ... --format json | --plot DIR | --config-out FILE
  trillion plan ... --mtbf-hours-per-gpu 50000 --checkpoint-save-s 20 --restart-s 600   (goodput under failures)
  trillion plan ... --documents DIR     (document-masked training: attention priced from a token store's documents)
  trillion plan --calibrate [--model M --seq-len S --micro-batch-size B] [--calibrate-out FILE]
      (measure this machine into a profile: M's own GEMM shapes and attention, memory, collectives)
"""

import argparse
import json
import math
import sys
from pathlib import Path

from trillion.errors import ConfigError
from trillion.models import parts
from trillion.models.parts import PartSettings
from trillion.models.parts.mtp import MTPSettings
from trillion.models.presets import PRESETS, get_preset
from trillion.parallel.float8_recipes import FLOAT8_RECIPES
from trillion.parallel.modes import SCHEDULES, ZERO_MODES
from trillion.parallel.planner.explain import ep_choice
from trillion.parallel.planner.hardware import load_profile, profile_names
from trillion.parallel.planner.moe import MOE_LOAD_IMBALANCE
from trillion.parallel.planner.optimizer import host_ema_bytes, host_ema_line
from trillion.parallel.planner.search import Request, metrics, model_summary, rank_states, search
from trillion.parallel.planner.space import (
    ASSUMPTION_FIELDS,
    LAYOUT_FIELDS,
    OPTIMIZER_STATE_DTYPES,
    OPTIMIZERS,
    SEARCHED_CHECKPOINT_MODES,
)
from trillion.trainer.cli.args import CommandParser
from trillion.trainer.config.checks import creatable_problem
from trillion.trainer.config.schema import load_config
from trillion.trainer.data.token_store import TokenStore
from trillion.trainer.tools.goodput_args import (
    add_goodput_arguments,
    check_goodput_arguments,
    checkpoint_share,
    goodput,
)
from trillion.trainer.tools.plan_args import (
    PART_FLAGS,
    add_dispatch_arguments,
    add_documents_argument,
    add_float8_arguments,
    add_part_arguments,
    add_pipeline_arguments,
    add_tp_hiding_arguments,
)
from trillion.trainer.tools.plan_config import train_config_toml


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser("plan", description=__doc__)
    p.add_argument("--model", help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--hardware", help=f"profile name ({', '.join(profile_names())}) or a profile TOML file")
    p.add_argument("--gpus", type=int, help="number of GPUs (GCDs on Frontier)")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (default: the model's max_seq_len)")
    p.add_argument("--tokens", type=float, default=0.0, help="training budget in tokens, e.g. 20e12")
    p.add_argument("--price-per-gpu-hour", type=float, default=None, help="USD (default: the hardware profile's)")
    p.add_argument("--top", type=int, default=10, help="rows of the table / candidates in the JSON")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument(
        "--config-out",
        default=None,
        help="where to write the best layout as a `trillion train` config "
        "(default: outputs/plan/<model>-<hardware>-<gpus>.toml; '' = do not write)",
    )
    p.add_argument("--plot", metavar="DIR", default=None, help="write tradeoff.png and scaling.png there")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine (GEMMs of --model's shapes, attention, memory, collectives) into a profile",
    )
    p.add_argument("--calibrate-out", default="outputs/plan/calibrated.toml", help="profile file --calibrate writes")
    p.add_argument(
        "--calibrate-processes",
        type=int,
        default=2,
        help="on a CPU: processes (ranks) per node the profile describes, measured all busy at once",
    )
    fixed = p.add_argument_group("layout settings (each one given is fixed; the rest are searched)")
    for name, kind, choices in (
        ("tp", int, None),
        ("pp", int, None),
        ("dp_replicate", int, None),
        ("dp_shard", int, None),
        ("dp_shard_mode", str, ZERO_MODES),
        ("pp_schedule", str, tuple(SCHEDULES)),
        ("virtual_stages", int, None),
        ("micro_batch_size", int, None),
        ("activation_checkpoint", str, SEARCHED_CHECKPOINT_MODES),
        ("cp", int, None),
        ("ep", int, None),
        ("etp", int, None),
        ("optimizer", str, OPTIMIZERS),
        ("optimizer_state_dtype", str, OPTIMIZER_STATE_DTYPES),
        ("ema_decay", float, None),
    ):
        fixed.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            type=kind,
            default=None,
            help=f"one of {', '.join(choices)}" if choices else None,
        )
    fixed.add_argument(
        "--compile",
        action="store_const",
        const=True,
        default=None,
        help="plan for torch.compile of each block (fused element-wise kernels; the trainer's compile.enabled)",
    )
    add_float8_arguments(fixed)
    add_dispatch_arguments(fixed)
    add_pipeline_arguments(fixed)
    add_tp_hiding_arguments(fixed)
    fixed.add_argument(
        "--moe-load-imbalance",
        dest="moe_load_imbalance",
        type=float,
        default=None,
        help="MoE models: the busiest expert-parallel rank's routed tokens over the mean (default "
        f"{MOE_LOAD_IMBALANCE:g}, assumed: parallel/planner/moe.py)",
    )
    add_part_arguments(p)
    add_goodput_arguments(p)
    add_documents_argument(p)
    return p


DEFAULT_CONFIG_OUT = "outputs/plan/{model}-{hardware}-{gpus}.toml"
EXAMPLE = "`trillion plan --model gpt-1t --hardware frontier --gpus 3072 --global-batch 1024 --tokens 20e12`"


def argument_problems(ns: argparse.Namespace) -> tuple[list[str], object]:
    """Every problem of the arguments themselves, not only the first (a missing --global-batch does not
    hide an unknown --model), and the hardware profile when it loads."""
    problems, profile = [], None
    missing = [
        f"--{k.replace('_', '-')}" for k in ("model", "hardware", "gpus", "global_batch") if getattr(ns, k) is None
    ]
    if missing:
        problems.append(f"it needs {', '.join(missing)}")
    if ns.model is not None and ns.model not in PRESETS:
        problems.append(f"--model {ns.model!r} is not a known preset (use one of: {', '.join(PRESETS)})")
    if ns.hardware is not None:
        try:
            profile = load_profile(ns.hardware)
        except ConfigError as error:
            problems.append(str(error).rstrip("."))
    for flag, value in (("--gpus", ns.gpus), ("--global-batch", ns.global_batch)):
        if value is not None and value < 1:
            problems.append(f"{flag} {value} must be at least 1")
    for key in ("tp", "pp", "dp_replicate", "dp_shard", "virtual_stages", "micro_batch_size", "cp", "ep", "etp"):
        if getattr(ns, key) is not None and getattr(ns, key) < 1:
            problems.append(f"--{key.replace('_', '-')} {getattr(ns, key)} must be at least 1")
    for flag, setting in PART_FLAGS.items():
        if getattr(ns, flag) is not None and getattr(ns, flag) < 0:
            problems.append(f"--{flag.replace('_', '-')} {getattr(ns, flag)} must be 0 or more (0: none; {setting})")
    if ns.ema_decay is not None and not 0 <= ns.ema_decay < 1:
        problems.append(f"--ema-decay {ns.ema_decay:g} must be in [0, 1) (optimizer.ema_decay; 0: no average)")
    if ns.ep_capacity is not None and ns.ep_capacity < 1:
        problems.append(
            f"--ep-capacity {ns.ep_capacity:g} must be at least 1 (an even share; moe.rank_capacity_factor)"
        )
    problems += check_goodput_arguments(ns)
    if ns.seq_len < 0:
        problems.append(f"--seq-len {ns.seq_len} must be positive (or 0: the model's max_seq_len)")
    if not math.isfinite(ns.tokens) or ns.tokens < 0:
        problems.append(f"--tokens {ns.tokens:g} must be a number of tokens, 0 or more (0: no budget)")
    if ns.price_per_gpu_hour is not None and not (math.isfinite(ns.price_per_gpu_hour) and ns.price_per_gpu_hour >= 0):
        problems.append(f"--price-per-gpu-hour {ns.price_per_gpu_hour:g} must be 0 or more (USD)")
    config_out = DEFAULT_CONFIG_OUT if ns.config_out is None else ns.config_out  # checked before the search
    for flag, value, wanted in (("--config-out", config_out, "file"), ("--plot", ns.plot, "folder")):
        if not value:
            continue
        if Path(value).exists() and Path(value).is_dir() != (wanted == "folder"):
            problems.append(f"{flag} {value} is a {'file' if wanted == 'folder' else 'folder'}; give a {wanted}")
        elif not Path(value).exists() and (problem := creatable_problem(value)):
            problems.append(f"{flag} {value} cannot be written: {problem}")
    return problems, profile


def request_from(ns: argparse.Namespace) -> Request:
    problems, profile = argument_problems(ns)
    if problems:
        listed = (
            problems[0]
            if len(problems) == 1
            else f"{len(problems)} problems: " + "; ".join(f"({i}) {problem}" for i, problem in enumerate(problems, 1))
        )
        example = f" For example: {EXAMPLE}." if any(problem.startswith("it needs") for problem in problems) else ""
        raise ConfigError(f"{listed}.{example}")
    given = {flag: value for flag in PART_FLAGS if (value := getattr(ns, flag)) is not None}  # else the preset's
    settings = PartSettings(ns.model, mtp=MTPSettings(modules=given.get("mtp_modules", -1)))
    args = parts.apply_settings(get_preset(ns.model), settings)
    fixed = {k: value for k in (*LAYOUT_FIELDS, *ASSUMPTION_FIELDS) if (value := getattr(ns, k, None)) is not None}
    for switch in ("ep_overlap", "defer_weight_grads", "async_tp", "float8_linears"):  # on | off
        if switch in fixed:
            fixed[switch] = fixed[switch] == "on"
    seq_len = ns.seq_len or args.max_seq_len
    if ns.documents:
        lengths = TokenStore(ns.documents, setting="--documents", sample_seed=None).document_lengths()
        fixed["attention_share"] = lengths.attention_share(seq_len)
    return Request(ns.model, args, profile, ns.gpus, ns.global_batch, seq_len, ns.tokens, ns.price_per_gpu_hour, fixed)


def low_precision_note(fixed: dict) -> str:
    """The table's header note of --float8 and its recipe."""
    if not fixed.get("float8"):
        return ""
    recipe = fixed.get("float8_recipe", "tensorwise")
    return ", float8 linears" if recipe == "tensorwise" else f", {recipe} linears"


def documents_note(request: Request) -> str:
    share = request.fixed.get("attention_share")
    return "" if share is None else f", documents masked (attention {100 * share:.1f}% of the unmasked)"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def format_table(request: Request, rows: list[dict], considered: int, fitting: int) -> str:
    s = model_summary(request)
    lines = [
        f"{request.model} ({s['parameters'] / 1e9:.1f}B parameters) on {request.gpus} x {request.hardware.name} "
        f"({request.hardware.device.name}, {request.hardware.device.memory_gb:g} GB), global batch "
        f"{request.global_batch} x {request.seq_len} tokens"
        f"{low_precision_note(request.fixed)}"
        f"{', Muon' if request.fixed.get('optimizer') == 'muon' else ''}{documents_note(request)}: "
        f"{considered} layouts considered, "
        f"{fitting} fit in memory{'' if fitting else ' (those that fit in the device are shown, with a warning)'}.",
        "Shares of the step: bub = pipeline bubble, imb = stage imbalance, tp/pp/dp/cp/ep = exposed communication "
        "(ep: MoE all-to-alls). tpo = how TP's collectives run: - exposed, N the chunked overlap's chunks "
        "(parallel.tp_overlap), async = async TP. Memory GB per GPU: params/grads/optim/activations/buffers.",
        "",
    ]
    budget = request.tokens > 0
    head = (
        f"{'#':>3} {'tp':>2} {'tpo':>5} {'pp':>3} {'cp':>2} {'ep':>3} {'dp (rep x shard)':>18} {'schedule':>22} "
        f"{'mb':>2} {'m':>5} {'ckpt':>9} {'step s':>7} {'tokens/s':>10} {'TF/GPU':>6} {'MFU%':>5} {'HFU%':>5} "
        f"{'bub%':>5} {'imb%':>5} {'tp%':>4} {'pp%':>4} {'dp%':>4} {'cp%':>4} {'ep%':>4} {'memory GB (P/G/O/A/B)':>28}"
    )
    if budget:
        head += f" {'days':>6} {'GPU-h':>9} {'MWh':>7} {'cost $':>10}"
    lines += [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        sh, mem = r["time_shares"], r["memory"]
        dp = f"{r['dp_replicate']}x{r['dp_shard']} {r['dp_shard_mode']}"
        sched = (
            r["pp_schedule"] + (f" v{r['virtual_stages']}" if r["virtual_stages"] > 1 else "") if r["pp"] > 1 else "-"
        )
        breakdown = "/".join(
            f"{mem[k]:.1f}" for k in ("parameters", "gradients", "optimizer", "activations", "buffers")
        )
        line = (
            f"{i:>3} {r['tp']:>2} {_hiding(r):>5} {r['pp']:>3} {r['cp']:>2} {r['ep']:>3} {dp:>18} {sched:>22} "
            f"{r['micro_batch_size']:>2} {r['microbatches']:>5} {r['activation_checkpoint']:>9} "
            f"{r['step_time_s']:>7.2f} "
            f"{r['tokens_per_s']:>10,.0f} {r['tflops_per_gpu']:>6.1f} {_flagged(r, 'mfu'):>5} {_flagged(r, 'hfu'):>5} "
            f"{_pct(sh['bubble']):>5} {_pct(sh['imbalance']):>5} {_pct(sh['tp_exposed']):>4} "
            f"{_pct(sh['pp_exposed']):>4} {_pct(sh['dp_exposed']):>4} {_pct(sh['cp_exposed']):>4} "
            f"{_pct(sh['ep_exposed']):>4} "
            f"{breakdown + ' = ' + format(r['memory_gb'], '.1f') + ('!' if r['memory_warning'] else ''):>28}"
        )
        if budget:
            line += (
                f" {r['time_to_train_days']:>6.1f} {r['gpu_hours']:>9.3g} "
                f"{r['energy_mwh']:>7.3g} {r['cost_usd']:>10.3g}"
            )
        lines.append(line)
    return "\n".join(lines + warnings(rows))


def _hiding(row: dict) -> str:
    """The tpo column: how the row's TP collectives run."""
    return "async" if row["async_tp"] else str(row["tp_overlap"]) if row["tp_overlap"] else "-"


def _flagged(row: dict, metric: str) -> str:
    """The utilisation in percent, marked '!' where it passes the best published on this hardware."""
    return _pct(row[metric]) + ("!" if metric.upper() in row["utilisation_warning"] else "")


def warnings(rows: list[dict]) -> list[str]:
    """One line per distinct warning (figures marked '!'), naming the rows it concerns."""
    by_text: dict[str, list[int]] = {}
    for i, r in enumerate(rows, 1):
        for text in (r["utilisation_warning"], r["memory_warning"]):
            if text:
                by_text.setdefault(text, []).append(i)
    return [f"! row{'s' * (len(ids) > 1)} {', '.join(map(str, ids))}: {text}." for text, ids in by_text.items()]


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    if ns.calibrate:
        from trillion.parallel.planner.calibrate import calibrate

        if ns.model and ns.model not in PRESETS:
            raise ConfigError(f"--model {ns.model!r} is not a known preset. Use one of: {', '.join(PRESETS)}.")
        args = get_preset(ns.model) if ns.model else None
        seq_len = ns.seq_len or (args.max_seq_len if args else 0)
        out = calibrate(Path(ns.calibrate_out), args, seq_len, ns.micro_batch_size or 1, ns.calibrate_processes)
        print(f"wrote {out}")
        return 0
    request = request_from(ns)
    result = search(request)
    rows = [metrics(request, c) for c in result.ranked[: max(ns.top, 1)]]
    why_ep = ep_choice(request, result)
    hw, ema_decay = request.hardware, request.assumptions.ema_decay
    states = rank_states(request, result.ranked[0].layout)
    saved = max(checkpoint_share(n, state, host_ema_bytes(n)[1] if ema_decay else 0) for n, state in states)
    best = goodput(ns, request.gpus, saved, rows[0]["step_time_s"], hw.node_bandwidth_gbs / hw.gpus_per_node)
    shard = max(n for n, _ in states)
    if ns.format == "json":
        json.dump(
            {
                "request": model_summary(request),
                "considered": result.considered,
                "fitting": sum(c.fits for c in result.ranked),
                "candidates": rows,
                **({"ep_choice": why_ep} if why_ep else {}),
                "goodput": best.as_dict(),
            },
            sys.stdout,
            indent=1,
        )
        print()
    else:
        print(format_table(request, rows, result.considered, sum(c.fits for c in result.ranked)))
        if why_ep:
            print(why_ep["why"])
        if rows[0]["pp_layout"]:  # the stages the plan timed (balanced: stage_balance.py), as parallel.pp_layout
            print(f"best layout: pipeline stages {rows[0]['pp_layout']} (parallel.pp_layout)")
        print("\n".join(f"best layout: {line}" for line in best.lines()))
        if ema_decay:
            print(f"best layout: {host_ema_line(ema_decay, shard, hw.gpus_per_node)}")
    out = (
        ns.config_out
        if ns.config_out is not None
        else DEFAULT_CONFIG_OUT.format(model=request.model, hardware=request.hardware.name, gpus=request.gpus)
    )
    untrainable = FLOAT8_RECIPES[rows[0]["float8_recipe"]].untrainable if rows[0]["float8"] else ""
    if out and untrainable:
        recipe = rows[0]["float8_recipe"]
        print(f"no config written: the trainer cannot train {recipe} ({untrainable})", file=sys.stderr)
    elif out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(train_config_toml(request, rows[0]))
        load_config(str(path))  # what we hand to `trillion train` must load
        print(f"wrote the best layout to {path} (run it with `trillion train --config {path}`)", file=sys.stderr)
    if ns.plot:
        from trillion.parallel.planner.plot import plot_request

        for written in plot_request(request, result, Path(ns.plot)):
            print(f"wrote {written}", file=sys.stderr)
    return 0
