"""Writes experiments/validation/VALIDATION.md: the planner against published training runs.

  python experiments/validation/validate.py            # evaluate runs.toml, write VALIDATION.md
  python experiments/validation/validate.py --refit    # also print each fitted constant refitted

Every run of runs.toml is evaluated by the planner with the shipped hardware profiles; the rows
trillion/fitted.toml fitted a constant to are marked, with the error when that row is left out
of the fit (the constant refitted to the others). The CPU table comes from cpu_results.toml, which
cpu_check.py writes (calibrate, predict and measure in one run).
"""

import argparse
import dataclasses
import math
from pathlib import Path

import tomllib

from trillion.devices import fitted_constants
from trillion.models.presets import get_preset
from trillion.parallel.planner.hardware import HardwareProfile, load_profile
from trillion.parallel.planner.layout import Layout
from trillion.parallel.planner.memory import pipeline_ranks
from trillion.parallel.planner.moe import ROUTING_ROWS_PER_CHOICE, effective_imbalance
from trillion.parallel.planner.search import Request, evaluate, metrics, scaling
from trillion.parallel.planner.timing import _memory_bound, all_to_all_time
from trillion.parallel.planner.work import BACKWARD_ELEMENTWISE

HERE = Path(__file__).parent
RUNS_FILE = HERE / "runs.toml"
CPU_FILE = HERE / "cpu_results.toml"
TOLERANCE = 0.15  # published rows
CPU_TOLERANCE = 0.30
# A run with `attention = "unfused"` (Megatron-LM before FlashAttention) writes each layer's fp16 score matrix (heads x
# s x s per sequence) to memory and reads it back: forward 13 bytes per score (QK^T written 2, the fused scale-mask
# softmax read and written 4, attention dropout read and written 4 plus its 1-byte mask, read by the PV product 2),
# backward 19 (dP written 2, dropout's backward 5, softmax's backward reads the gradient and the probabilities and
# writes dS 6, dS read by two products 4, the dropped probabilities read for dV 2), and the recomputed forward 13.
# The planner models flash attention, which keeps the scores on chip; validate.py charges this traffic apart.
UNFUSED_BYTES_PER_SCORE = 45
# A run with `moe_dispatch = "deepep"` ran NeMo Automodel's MoE layer (nemo_automodel/components/moe at 8d9bfb90:
# GroupedExpertsDeepEP, its MoEFlexTokenDispatcher with DeepEP and TransformerEngine 2.5's fused permutation). Per
# token, MoE layer and pass, R the ranks that hold any of its top_k experts (`moe_ranks_per_token`), its routing moves
# rows of dim: DeepEP's intranode dispatch 4 R (the sender reads a row and writes it into the peer's buffer, the
# receiver reads it and writes it out), TE's permute R + top_k (a read per received copy, a write per expert), TE's
# unpermute top_k + R (the sum only: the router's weights are applied inside the experts' SwiGLU) and DeepEP's combine
# 3 R + 1 (a copy into the origin's buffer, the fp32 sum written once); the backward runs the same kernels reversed.
# Its all-to-alls carry a token R times where Trillion's carry it top_k times. The planner charges Trillion's layer
# (moe.py): ROUTING_ROWS_PER_CHOICE top_k rows per forward, BACKWARD_ELEMENTWISE times that in the backward.


def deepep_routing_rows(top_k: int, ranks: int) -> int:
    """Rows of dim one token's routing reads and writes in one pass of Automodel's DeepEP layer (above)."""
    return 4 * ranks + (ranks + top_k) + (top_k + ranks) + (3 * ranks + 1)


def load_runs() -> list[dict]:
    """The runs, each outside_reason and finding resolved to its text in [reason] and [finding]."""
    table = tomllib.loads(RUNS_FILE.read_text())
    texts = {"outside_reason": table["reason"], "finding": table.get("finding", {})}
    return [{**run, **{key: texts[key][run[key]] for key in texts if key in run}} for run in table["run"]]


def with_plateau(profile: HardwareProfile, entry: dict | None, value: float | None) -> HardwareProfile:
    """The profile with a fitted entry's scalar (its GEMM plateau or its sustained share) set to `value` (None: as
    shipped)."""
    if entry is None or value is None or profile.device.name not in entry["devices"]:
        return profile
    field = {"gemm_plateau": {"gemm_efficiency": ((1e12, value),)}, "sustained": {"sustained": value}}[entry["field"]]
    return dataclasses.replace(profile, device=dataclasses.replace(profile.device, **field))


def run_layout(run: dict, gpus: int) -> Layout:
    spec = run["layout"]
    dp = gpus // (spec["tp"] * spec["pp"])
    dp_shard = spec.get("dp_shard", dp // spec["dp_replicate"])
    microbatches = run["global_batch"] // (dp * spec["micro_batch_size"])
    return Layout(
        tp=spec["tp"],
        pp=spec["pp"],
        dp_replicate=spec["dp_replicate"],
        dp_shard=dp_shard,
        dp_shard_mode=spec["dp_shard_mode"],
        pp_schedule=spec["pp_schedule"],
        virtual_stages=spec.get("virtual_stages", 1),
        micro_batch_size=spec["micro_batch_size"],
        microbatches=microbatches,
        activation_checkpoint=spec["activation_checkpoint"],
        compile=spec.get("compile", False),
        float8=spec.get("float8", False),
        float8_all_gather=spec.get("float8_all_gather", True),
        ep=spec.get("ep", 1),
        moe_load_imbalance=spec.get("moe_load_imbalance", Layout.moe_load_imbalance),
    )


def run_args(run: dict):
    """The run's model: its preset, reshaped by `model_shape` where the publisher's model has no preset of its own."""
    return dataclasses.replace(get_preset(run["model"]), **run.get("model_shape", {}))


def predict(run: dict, profile: HardwareProfile | None = None) -> tuple[float, dict]:
    """(the run's metric as the planner predicts it, the planner's figures of the run's layout)."""
    args, hardware = run_args(run), profile or load_profile(run["hardware"])
    if run["metric"] in ("weak_scaling", "strong_scaling"):
        first, last = run["gpus"]
        # the published layout, cp 1 unless it says otherwise (none of these runs split sequences)
        fixed = {"cp": 1, **{k: v for k, v in run["layout"].items() if k != "dp_shard"}}
        weak = run["metric"] == "weak_scaling"
        batch = run["global_batch"] if weak else run["global_batch"] * last // first
        request = Request(run["model"], args, hardware, first, batch, run["seq_len"], fixed=fixed)
        points = scaling(request, [first, last], weak=weak)
        return points[-1][1], points[-1][2]
    request = Request(run["model"], args, hardware, run["gpus"], run["global_batch"], run["seq_len"])
    row = metrics(request, evaluate(request, run_layout(run, run["gpus"])))
    value = {
        "megatron_share_of_peak": row["megatron_share_of_peak"],
        "tokens_per_s_per_gpu": row["tokens_per_s"] / run["gpus"],
        "model_tflops_per_gpu": row["tflops_per_gpu"],
    }[run["metric"]]
    return value, row


def unfused_attention_share(run: dict, row: dict) -> float:
    """The share of the planner's step that a run's unfused attention adds at least (UNFUSED_BYTES_PER_SCORE per score
    per layer and micro-batch, at the device's achieved memory bandwidth, on the layers of one pipeline stage; the
    bubble's share of it not counted)."""
    shape, layout = run_args(run), run["layout"]
    device = load_profile(run["hardware"]).device
    scores = shape.n_heads / layout["tp"] * run["seq_len"] ** 2 * layout["micro_batch_size"]
    per_layer = UNFUSED_BYTES_PER_SCORE * scores / (device.memory_bandwidth_gbs * 1e9 * device.memory_efficiency)
    return per_layer * shape.n_layers / layout["pp"] * row["microbatches"] / row["step_time_s"]


def deepep_share(run: dict, row: dict) -> float:
    """The share of the planner's step that Automodel's DeepEP dispatch and fused permutation do not pay (negative):
    the routing's element-wise traffic and the all-to-alls' extra copies of each MoE layer and micro-batch in the
    forward, the backward and the recomputed forward, at the planner's memory-bound and all-to-all times."""
    args, layout, hw = run_args(run), run_layout(run, run["gpus"]), load_profile(run["hardware"])
    k, ranks = args.moe.top_k, run["moe_ranks_per_token"]
    recomputed = int(layout.activation_checkpoint == "full")
    row_bytes = layout.micro_batch_size * run["seq_len"] * args.dim * hw.element_bytes
    row_bytes *= effective_imbalance(layout.ep, layout.moe_load_imbalance)
    # moe_passes: the forward, the backward (BACKWARD_ELEMENTWISE times it) and the recomputed forward
    trillion_rows = ROUTING_ROWS_PER_CHOICE * k * (1 + BACKWARD_ELEMENTWISE + recomputed)
    routing = _memory_bound(hw, (trillion_rows - deepep_routing_rows(k, ranks) * (2 + recomputed)) * row_bytes)
    per_copy = all_to_all_time(hw, row_bytes * k, layout.ep, layout.tp) - all_to_all_time(
        hw, row_bytes * ranks, layout.ep, layout.tp
    )
    copies = 2 * (2 + recomputed) * per_copy  # the dispatch and the combine of each pass
    moe_layers = pipeline_ranks(args, layout)[0].moe_layers
    return -(routing + copies) * moe_layers * row["microbatches"] / row["step_time_s"]


def charge_of(run: dict, row: dict) -> tuple[float, str] | None:
    """What the published system's own kernels cost beyond (positive) or short of (negative) Trillion's, which the
    planner models, as a share of the planner's step, and its name; None for a run that ran Trillion-like kernels."""
    if run.get("attention") == "unfused":
        return unfused_attention_share(run, row), "unfused attention"
    if run.get("moe_dispatch") == "deepep":
        return deepep_share(run, row), "DeepEP dispatch and fused permutation"
    return None


def log_error(run: dict, entry: dict, value: float) -> float:
    profile = with_plateau(load_profile(run["hardware"]), entry, value)
    return math.log(predict(run, profile)[0] / run["published"])


def refit(entry: dict, runs: list[dict], lo: float = 0.1, hi: float = 1.0) -> float:
    """The plateau minimizing the sum of squared log errors over `runs` (golden-section search;
    the error is monotone in the plateau, so the sum is unimodal)."""

    def loss(value: float) -> float:
        return sum(log_error(run, entry, value) ** 2 for run in runs)

    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    while b - a > 1e-4:
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if loss(c) < loss(d):
            b = d
        else:
            a = c
    return round((a + b) / 2, 3)


def evaluate_all() -> list[dict]:
    """One record per run: predicted, published, error, and for fitted rows the leave-one-out error and, for a
    `sustained` fit, the share of the predicted step its cost is (the step with the scalar against without)."""
    runs, fitted = load_runs(), fitted_constants()
    records = []
    for run in runs:
        value, row = predict(run)
        record = {"run": run, "predicted": value, "error": value / run["published"] - 1, "row": row}
        charge = charge_of(run, row)
        if charge:  # every metric here is a rate: the step grows (or shrinks) by the share
            record["charge_share"], record["charge_name"] = charge
            record["charged_error"] = (1 + record["error"]) / (1 + record["charge_share"]) - 1
        entry = next((e for e in fitted if run["id"] in e["fitted_to"]), None)
        if entry:
            others = [r for r in runs if r["id"] in entry["fitted_to"] and r["id"] != run["id"]]
            held_out = refit(entry, others)
            loo = predict(run, with_plateau(load_profile(run["hardware"]), entry, held_out))[0]
            record.update(fitted=entry, loo_value=held_out, loo_error=loo / run["published"] - 1)
            if entry["field"] == "sustained":  # every metric here is a rate: the step scales as its inverse
                record["fitted_share"] = (
                    1 - value / predict(run, with_plateau(load_profile(run["hardware"]), entry, 1.0))[0]
                )
        records.append(record)
    return records


def source_of(run_id: str) -> str:
    """The publisher a row's id starts with (frontier, torchtitan, trainy, megatron, ...)."""
    return run_id.split("-")[0]


def leave_source_out(entry: dict) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """For a fit over rows of several publishers: each publisher's rows predicted by the scalar refitted to the
    others' ((publisher, refitted value, [(row id, error)])): does the fit carry across trainers and machines?"""
    runs = {r["id"]: r for r in load_runs()}
    sources = sorted({source_of(i) for i in entry["fitted_to"]})
    out = []
    for source in sources if len(sources) > 1 else []:
        held = [i for i in entry["fitted_to"] if source_of(i) == source]
        value = refit(entry, [runs[i] for i in entry["fitted_to"] if i not in held])
        errors = [
            (
                i,
                predict(runs[i], with_plateau(load_profile(runs[i]["hardware"]), entry, value))[0]
                / runs[i]["published"]
                - 1,
            )
            for i in held
        ]
        out.append((source, value, errors))
    return out


def _figure(metric: str, value: float) -> str:
    if metric == "model_tflops_per_gpu":
        return f"{value:.1f} TFLOP/s"
    return f"{value:,.0f}" if metric == "tokens_per_s_per_gpu" else f"{100 * value:.2f}%"


def _model(run: dict) -> str:
    shape = run.get("model_shape")
    if not shape:
        return run["model"]
    return (
        f"{run['model']} as {shape['n_layers']} x {shape['dim']}, {shape['n_heads']} heads, vocab {shape['vocab_size']}"
    )


def _layout(spec: dict) -> str:
    dp = f"dp {spec['dp_replicate']}x{spec.get('dp_shard', 'n')} {spec['dp_shard_mode']}"
    return (
        f"tp {spec['tp']}, pp {spec['pp']}, {dp}, {spec['pp_schedule']}, mb {spec['micro_batch_size']}, "
        f"ckpt {spec['activation_checkpoint']}{', compile' if spec.get('compile') else ''}"
        f"{_float8(spec)}{_ep(spec)}"
    )


def _ep(spec: dict) -> str:
    return f", ep {spec['ep']}" if spec.get("ep", 1) > 1 else ""


def _float8(spec: dict) -> str:
    if not spec.get("float8"):
        return ""
    return ", float8" + (" (float8 all-gather)" if spec.get("float8_all_gather", True) else "")


def comparable(record: dict) -> bool:
    """False for a published layout Trillion's trainer cannot express (`expressible = false` in runs.toml, with its
    reason): reported beside the validation, not counted in it."""
    return record["run"].get("expressible", True)


def row_error(record: dict, charged: bool = False) -> float:
    """The row's error (leave-one-out for a fitted row); `charged`: with its system's own kernels charged."""
    if charged and "charged_error" in record:
        return record["charged_error"]
    return record.get("loo_error", record["error"])


def worst(records: list[dict], charged: bool = False) -> tuple[float, str]:
    """The largest error the planner makes on a row no constant was fitted to (leave-one-out for fitted rows)."""
    return max((abs(row_error(r, charged)), r["run"]["id"]) for r in records if comparable(r))


def cpu_section() -> list[str]:
    if not CPU_FILE.is_file():
        return [
            "## Predicted vs measured on this CPU",
            "",
            "Not measured yet: run `python experiments/validation/cpu_check.py`.",
            "",
        ]
    data = tomllib.loads(CPU_FILE.read_text())
    lines = [
        "## Predicted vs measured on a CPU (calibrate, predict, measure in one script)",
        "",
        f"`{data['command']}` on {data['machine']}, {data['date']}. {data['load']}",
        "",
        f"Calibrated profile: {data['profile_summary']}",
        "",
        f"| layout | processes | predicted s/step (median of {data['repeats']}) | measured s/step (median of "
        f"{data['repeats']}) | measured min-max | error | within ±{CPU_TOLERANCE:.0%} | error of each repeat |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in data["row"]:
        error = row["predicted_s"] / row["measured_s"] - 1
        each = ", ".join(
            f"{100 * (p / m - 1):+.0f}%" for p, m in zip(row["predicted_by_repeat"], row["measured_by_repeat"])
        )
        lines.append(
            f"| {row['layout']} | {row['processes']} | {row['predicted_s']:.3f} | {row['measured_s']:.3f} "
            f"| {row['measured_min_s']:.3f}-{row['measured_max_s']:.3f} | {100 * error:+.1f}% "
            f"| {'yes' if abs(error) <= CPU_TOLERANCE else '**no**'} | {each} |"
        )
    return lines + ["", data.get("note", ""), "", " ".join(data.get("finding", "").split()), ""]


def render(records: list[dict]) -> str:
    worst_error, worst_id = worst(records)
    charged_error, charged_id = worst(records, charged=True)
    apart = [r for r in records if not comparable(r)]
    records = [r for r in records if comparable(r)]
    lines = [
        "# The planner against published training runs",
        "",
        "Generated by `python experiments/validation/validate.py` from `runs.toml` (each run's source, model, "
        "machine, layout, batch, sequence length, precision, checkpointing and published figure) with the shipped "
        "hardware profiles. Error = predicted / published - 1.",
        "",
        f"**Worst error on a row no constant was fitted to: {100 * worst_error:.1f}% ({worst_id})**; "
        f"rows within ±{TOLERANCE:.0%}: {sum(abs(row_error(r)) <= TOLERANCE for r in records)} "
        f"of {len(records)}. With the costs of the published systems' own kernels charged beside them (the unfused "
        f"attention of Megatron-LM of 2021, NeMo Automodel's DeepEP dispatch and fused permutation): worst "
        f"{100 * charged_error:.1f}% ({charged_id}), "
        f"{sum(abs(row_error(r, charged=True)) <= TOLERANCE for r in records)} of {len(records)} "
        f"within ±{TOLERANCE:.0%}.",
        "",
        (
            "| run | model | machine | layout | GPUs | batch x seq | published | predicted | error "
            "| fitted: leave-one-out error |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        run = r["run"]
        gpus = " -> ".join(map(str, run["gpus"])) if isinstance(run["gpus"], list) else run["gpus"]
        fitted = (
            f"yes ({r['fitted']['field']} {r['loo_value']:.3f} without it): {100 * r['loo_error']:+.1f}%"
            + (f"; its cost {r['fitted_share']:.0%} of the step" if "fitted_share" in r else "")
            if "fitted" in r
            else "no"
        )
        lines.append(
            f"| {run['id']} | {_model(run)} | {run['hardware']} | {_layout(run['layout'])} | {gpus} "
            f"| {run['global_batch']} x {run['seq_len']} | {_figure(run['metric'], run['published'])} "
            f"| {_figure(run['metric'], r['predicted'])} | {100 * r['error']:+.1f}% | {fitted} |"
        )
    memory = [r for r in records if "published_memory_gib" in r["run"]]
    if memory:
        lines += [
            "",
            "Memory (not validated: the published figures are another trainer's allocator peaks):",
            "",
            "| run | published GiB | predicted GiB |",
            "|---|---|---|",
        ]
        lines += [
            f"| {r['run']['id']} | {r['run']['published_memory_gib']} | {r['row']['memory_gb'] * 1e9 / 2**30:.1f} |"
            for r in memory
        ]
    lines += ["", "## Fitted constants", ""]
    for entry in fitted_constants():
        lines.append(
            f"- {entry['family']}: `{entry['field']}` = {entry['value']} ({', '.join(entry['devices'])}), fitted to "
            f"{', '.join(entry['fitted_to'])} by {entry['method']}. {' '.join(entry['why'].split())}"
        )
        for source, value, errors in leave_source_out(entry):
            lines.append(
                f"  - {source}'s rows left out ({entry['field']} {value:.3f} from the others): "
                + ", ".join(f"{i} {100 * e:+.1f}%" for i, e in errors)
            )
    lines += findings_section(records)
    outside = [r for r in records if abs(row_error(r)) > TOLERANCE]
    lines += ["", f"## Rows outside ±{TOLERANCE:.0%}", ""]
    reasons = {}
    for r in outside:  # rows sharing a reason are listed together
        reasons.setdefault(r["run"].get("outside_reason", "no reason found yet."), []).append(r)
    paragraphs = [
        ", ".join(f"**{r['run']['id']}** ({'; '.join([f'{100 * row_error(r):+.1f}%', *_charge(r)])})" for r in rows)
        + f": {' '.join(reason.split())}"
        for reason, rows in reasons.items()
    ]
    lines += ["\n\n".join(paragraphs) or "None."]  # one paragraph per reason
    lines += [""] + inexpressible_section(apart) + cpu_section()
    return "\n".join(lines) + "\n"


def _charge(record: dict) -> list[str]:
    """The charge beside a row whose system's own kernels it is (none for the others)."""
    if "charge_share" not in record:
        return []
    return [
        f"{record['charge_name']} {100 * record['charge_share']:+.1f}% of the step, "
        f"with it {100 * record['charged_error']:+.1f}%"
    ]


def findings_section(records: list[dict]) -> list[str]:
    """What the decomposition of each row against the planner's terms found, one paragraph per finding."""
    found = {}
    for r in records:
        if "finding" in r["run"]:
            label = " ".join([f"**{r['run']['id']}**", *(f"({charge})" for charge in _charge(r))])
            found.setdefault(r["run"]["finding"], []).append(label)
    if not found:
        return []
    lines = ["", "## What the rows show (the planner's terms against the published step)", ""]
    return lines + ["\n\n".join(f"{', '.join(ids)}: {' '.join(t.split())}" for t, ids in found.items())]


def inexpressible_section(records: list[dict]) -> list[str]:
    """Published runs in layouts Trillion's trainer cannot express, planned at the nearest layout it can."""
    if not records:
        return []
    lines = [
        "## Published layouts the trainer cannot express (reported, not validated)",
        "",
        "Planned at the nearest layout Trillion runs; the error is that layout's prediction against the published "
        "run, not the planner's error on the run's own layout.",
        "",
        "| run | model | machine | planned as | GPUs | batch x seq | published | predicted | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        run = r["run"]
        lines.append(
            f"| {run['id']} | {_model(run)} | {run['hardware']} | {_layout(run['layout'])} | {run['gpus']} "
            f"| {run['global_batch']} x {run['seq_len']} | {_figure(run['metric'], run['published'])} "
            f"| {_figure(run['metric'], r['predicted'])} | {100 * r['error']:+.1f}% |"
        )
    reasons = {}
    for r in records:
        reasons.setdefault(r["run"]["outside_reason"], []).append(r["run"]["id"])
    lines += [""] + [
        "\n\n".join(f"{', '.join(f'**{i}**' for i in ids)}: {' '.join(t.split())}" for t, ids in reasons.items())
    ]
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(HERE / "VALIDATION.md"))
    parser.add_argument("--refit", action="store_true", help="print each fitted constant refitted to its rows")
    ns = parser.parse_args()
    if ns.refit:
        runs = load_runs()
        for entry in fitted_constants():
            value = refit(entry, [r for r in runs if r["id"] in entry["fitted_to"]])
            print(f"{entry['family']} {entry['field']}: fitted.toml {entry['value']}, refitted {value}")
    text = render(evaluate_all())
    Path(ns.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
