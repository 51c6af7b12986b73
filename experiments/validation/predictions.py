"""The planner's predictions of the published runs of runs.toml (validate.py writes them up as
VALIDATION.md): each run's layout and model in the planner's terms, the prediction with the shipped
hardware profiles, the costs of the published systems' own kernels charged beside it, and the fitted
constants refitted to their rows or with one source left out.
"""

import dataclasses
import math
from pathlib import Path

import tomllib

from trillion.devices import fitted_constants
from trillion.models.parts.moe import member_reach
from trillion.models.presets import get_preset
from trillion.parallel.ep_checks import ep_stride, resolve_pairing_phase
from trillion.parallel.layout import Float8Training, Layout, StageLayers, resolve_etp, resolve_float8
from trillion.parallel.planner.hardware import HardwareProfile, load_profile
from trillion.parallel.planner.memory import pipeline_ranks
from trillion.parallel.planner.moe import (
    MOE_LOAD_IMBALANCE,
    dispatch_seconds,
    effective_imbalance,
    expert_gemm_seconds,
    permutation_rows,
    routed_block,
    routed_tokens,
)
from trillion.parallel.planner.search import Request, evaluate, metrics, scaling
from trillion.parallel.planner.stage_balance import balanced
from trillion.parallel.planner.timing import _memory_bound, all_to_all_time

HERE = Path(__file__).parent
RUNS_FILE = HERE / "runs.toml"
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
# Its all-to-alls carry a token R times; Trillion's per-rank dispatch (the default) too, but the planner's model of it
# (moe.py dispatch_rows) counts the ranks an evenly routed token reaches, where the recipe's fake gate sends each token
# to one rank. The planner charges Trillion's layer (moe.py): its permutation's rows per token (permutation_rows: under
# ep the dispatch's own gathers), forward and backward.


def deepep_routing_rows(top_k: int, ranks: int) -> int:
    """Rows of dim one token's routing reads and writes in one pass of Automodel's DeepEP layer (above)."""
    return 4 * ranks + (ranks + top_k) + (top_k + ranks) + (3 * ranks + 1)


def load_runs() -> list[dict]:
    """The runs, each outside_reason and finding resolved to its text in [reason] and [finding]."""
    table = tomllib.loads(RUNS_FILE.read_text())
    texts = {"outside_reason": table["reason"], "finding": table.get("finding", {})}
    return [{**run, **{key: texts[key][run[key]] for key in texts if key in run}} for run in table["run"]]


def load_pairs() -> list[dict]:
    """The [[pair]]s of runs.toml: two runs that differ in one technique, each reason resolved to its text."""
    table = tomllib.loads(RUNS_FILE.read_text())
    return [{**pair, "reason": table["reason"][pair["reason"]]} for pair in table.get("pair", [])]


def with_plateau(profile: HardwareProfile, entry: dict | None, value: float | None) -> HardwareProfile:
    """The profile with a fitted entry's scalar (its GEMM plateau or its sustained share) set to `value` (None: as
    shipped)."""
    if entry is None or value is None or profile.device.name not in entry["devices"]:
        return profile
    field = {"gemm_plateau": {"gemm_efficiency": ((1e12, value),)}, "sustained": {"sustained": value}}[entry["field"]]
    return dataclasses.replace(profile, device=dataclasses.replace(profile.device, **field))


def run_layout(run: dict, gpus: int) -> Layout:
    spec, hardware = run["layout"], load_profile(run["hardware"])
    dp = gpus // (spec["tp"] * spec["pp"])
    dp_shard = spec.get("dp_shard", dp // spec["dp_replicate"])
    microbatches = run["global_batch"] // (dp * spec["micro_batch_size"])
    layout = Layout(
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
        float8=run_float8(spec),
        ep=spec.get("ep", 1),
        # as the run set it, else as the trainer's parallel.etp=auto resolves it
        etp=spec.get("etp") or resolve_etp(0, tp=spec["tp"], ep=spec.get("ep", 1), dp_shard=dp_shard)[0],
        ep_dispatch=spec.get("ep_dispatch", Layout.ep_dispatch),
        ep_overlap=spec.get("ep_overlap", False),
        defer_weight_grads=spec.get("defer_weight_grads", False),
        tp_overlap=spec.get("tp_overlap", 0),
        async_tp=spec.get("async_tp", False),
        stage_layers=StageLayers(written=spec["pp_layout"])
        if spec.get("pp_layout", "auto") != "auto"
        else StageLayers(),
        ranks_per_node=hardware.scale_up,  # the expert dispatch's node: the scale-up domain (an NVL72 rack's 72)
    )
    # the pairing's phase as the run set it, else the trainer's auto (the stages are balanced at it)
    phase = resolve_pairing_phase(layout, spec.get("ep_pairing_phase", -1), run_args(run), run["seq_len"])
    return dataclasses.replace(layout, ep_pairing_phase=phase)


def run_float8(spec: dict) -> Float8Training | None:
    """The run's low-precision recipe (tensorwise unless it says otherwise), its linears and experts as its layout
    says, resolved as the trainer resolves it: FSDP's float8 all-gather on where the recipe has it, unless the
    layout says otherwise (the planner costs it only where FSDP gathers); None without float8."""
    if not spec.get("float8", False):
        return None
    return resolve_float8(
        spec.get("float8_recipe", "tensorwise"),
        fsdp_enabled=True,
        fsdp_all_gather="auto" if spec.get("float8_all_gather", True) else "off",
        experts=spec.get("float8_experts", "auto"),
        dispatch=spec.get("float8_dispatch", False),
        linears=spec.get("float8_linears", True),
        cache_activations=spec.get("float8_cache_activations", False),
        combine_gradient=spec.get("float8_combine_gradient", False),
    )


def run_imbalance(run: dict) -> float:
    """The load imbalance the planner assumes for the run: its layout's, else the planner's default."""
    return run["layout"].get("moe_load_imbalance", MOE_LOAD_IMBALANCE)


def run_args(run: dict):
    """The run's model: its preset, reshaped by `model_shape` where the publisher's model has no preset of its own."""
    return dataclasses.replace(get_preset(run["model"]), **run.get("model_shape", {}))


def predict(run: dict, profile: HardwareProfile | None = None) -> tuple[float, dict]:
    """(the run's metric as the planner predicts it, the planner's figures of the run's layout)."""
    args, hardware = run_args(run), profile or load_profile(run["hardware"])
    if run["metric"] in ("weak_scaling", "strong_scaling"):
        first, last = run["gpus"]
        # the published layout, cp 1 unless it says otherwise (none of these runs split sequences),
        # and TP's collectives as it ran them (exposed unless it says otherwise)
        fixed = {
            "cp": 1,
            "tp_overlap": 0,
            "async_tp": False,
            **{k: v for k, v in run["layout"].items() if k != "dp_shard"},
        }
        weak = run["metric"] == "weak_scaling"
        batch = run["global_batch"] if weak else run["global_batch"] * last // first
        request = Request(run["model"], args, hardware, first, batch, run["seq_len"], fixed=fixed)
        points = scaling(request, [first, last], weak=weak)
        return points[-1][1], points[-1][2]
    assumed = {"moe_load_imbalance": run_imbalance(run)}  # the plan's assumptions (planner/assumptions.py)
    assumed |= {k: run["layout"][k] for k in ("optimizer_state_dtype",) if k in run["layout"]}
    request = Request(run["model"], args, hardware, run["gpus"], run["global_batch"], run["seq_len"], fixed=assumed)
    layout = run_layout(run, run["gpus"])
    if run["layout"].get("pp_layout") == "auto":  # the stages as `trillion plan` balances them (stage_balance.py)
        layout = balanced(args, hardware, layout, run["seq_len"], request.assumptions)
    row = metrics(request, evaluate(request, layout))
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


def even_ranks_per_token(args, ep: int) -> float:
    """The ep ranks an evenly routed token reaches (each holding E / ep consecutive experts): what the planner's
    per-rank dispatch sends it to (moe.py dispatch_rows)."""
    routing = routed_block(args).routing
    return ep * member_reach(routing, routing.n_experts // ep)


def deepep_share(run: dict, row: dict) -> float:
    """The share of the planner's step that Automodel's DeepEP dispatch and fused permutation do not pay (negative):
    the routing's element-wise traffic and the all-to-alls' copies beyond the run's ranks per token, of each MoE
    layer and micro-batch in the forward, the backward and the recomputed forward, at the planner's memory-bound and
    all-to-all times."""
    args, layout, hw = run_args(run), run_layout(run, run["gpus"]), load_profile(run["hardware"])
    k, ranks = args.moe.top_k, run.get("moe_ranks_per_token") or even_ranks_per_token(args, layout.ep)
    recomputed = int(layout.activation_checkpoint == "full")
    tokens = routed_tokens(layout.micro_batch_size * run["seq_len"] // layout.cp, layout)  # folded: 1/tp of them
    row_bytes = tokens * args.dim * hw.element_bytes * effective_imbalance(layout.ep, run_imbalance(run))
    # moe_passes: the forward, the backward and the recomputed forward (the per-token rows taken at the imbalance too)
    forward, backward = (choice * k + token for choice, token in permutation_rows(layout.ep).values())
    trillion_rows = forward * (1 + recomputed) + backward
    routing = _memory_bound(hw, (trillion_rows - deepep_routing_rows(k, ranks) * (2 + recomputed)) * row_bytes)
    modeled = dispatch_seconds(args, hw, tokens, layout, imbalance=1.0)
    per_copy = modeled * effective_imbalance(layout.ep, run_imbalance(run)) - all_to_all_time(
        hw, row_bytes * ranks, layout.ep, ep_stride(layout)
    )
    copies = 2 * (2 + recomputed) * per_copy  # the dispatch and the combine of each pass
    routed_layers = pipeline_ranks(args, layout)[0].routed_layers
    return -(routing + copies) * routed_layers * row["microbatches"] / row["step_time_s"]


def grouped_mm_share(run: dict, row: dict) -> float:
    """The share of the planner's step a run's own bf16 grouped GEMM adds (torchtitan's torch._grouped_mm, at the
    share of the bf16 peak `grouped_mm_share` measured for it), against the planner's rate for the experts (the dense
    plateau, Trillion's grouped GEMM): each routed layer's experts on the busiest rank in the forward, both gradients
    and a recomputed forward (full checkpointing), per micro-batch."""
    args, layout, hw = run_args(run), run_layout(run, run["gpus"]), load_profile(run["hardware"])
    measured = dataclasses.replace(hw.device, gemm_efficiency=((1e12, run["grouped_mm_share"]),))
    tokens = routed_tokens(layout.micro_batch_size * run["seq_len"] // layout.cp, layout)  # folded: 1/tp of them
    seconds = [
        expert_gemm_seconds(args, profile, tokens, layout.expert_tp, layout.ep, run_imbalance(run))
        for profile in (hw, dataclasses.replace(hw, device=measured))
    ]
    passes = 3 + (layout.activation_checkpoint == "full")
    routed_layers = pipeline_ranks(args, layout)[0].routed_layers
    return (seconds[1] - seconds[0]) * passes * routed_layers * row["microbatches"] / row["step_time_s"]


def charge_of(run: dict, row: dict) -> tuple[float, str] | None:
    """What the published system's own kernels cost beyond (positive) or short of (negative) Trillion's, which the
    planner models, as a share of the planner's step, and its name; None for a run that ran Trillion-like kernels."""
    if run.get("attention") == "unfused":
        return unfused_attention_share(run, row), "unfused attention"
    if run.get("moe_dispatch") == "deepep":
        return deepep_share(run, row), "DeepEP dispatch and fused permutation"
    if "grouped_mm_share" in run:
        return grouped_mm_share(run, row), "torch._grouped_mm at its measured rate"
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
