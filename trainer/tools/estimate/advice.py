"""When a simulated rank does not fit: one paragraph naming the rank, its shortfall, what dominates its
memory and which setting to change (trainer/tools/estimate/dry_run.py's figures; the CLI prints it and exits 1)."""

from __future__ import annotations

import math

KINDS = ("parameters", "gradients", "optimizer", "activations", "buffers", "framework")
DOMINATE = {
    "parameters": "parameters dominate",
    "gradients": "gradients dominate",
    "optimizer": "the optimizer state dominates",
    "activations": "activations dominate",
    "buffers": "buffers dominate",
    "framework": "the framework allowance dominates",
}


def shortfall_message(result) -> str | None:
    """One paragraph about the worst rank of an Estimate that does not fit, or None when all fit (or
    capacity is unknown)."""
    over = [r for r in result.ranks if r.fits is False]
    if not over:
        return None
    worst = max(over, key=lambda r: r.total - r.usable)
    where = ", ".join(f"{k} {v}" for k, v in worst.coords.items()) or "the only rank"
    why = advice(worst, result.layout)
    return (
        f"rank {worst.rank} ({where}) of {result.world_size} needs {size(worst.total)} but a "
        f"{result.device} offers {size(worst.usable)} usable ({size(worst.capacity)} at the planner's "
        f"headroom): short by {size(worst.total - worst.usable)}"
        + (f" ({len(over)} of the {len(result.ranks)} simulated ranks do not fit)" if len(over) > 1 else "")
        + f". {why[0].upper()}{why[1:]}."
    )


def advice(rank, layout: dict) -> str:
    """What dominates a RankEstimate's memory and which setting to change."""
    kind = max(KINDS, key=lambda k: getattr(rank, k))
    fixes = {"activations": _activations, "buffers": _buffers}.get(
        kind, _states if kind in ("parameters", "gradients", "optimizer") else lambda *_: "a device with more memory"
    )
    return (
        f"{DOMINATE[kind]} ({size(getattr(rank, kind))}, {getattr(rank, kind) / rank.total:.0%}); "
        f"to fit, {fixes(rank, layout, kind)}"
    )


def size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _now(layout: dict, key: str) -> str:
    return f"now {layout[key]}"


def _states(rank, layout: dict, kind: str) -> str:
    pipelined = layout["pp"] > 1
    more = [
        f"--parallel.dp_shard ({_now(layout, 'dp_shard')}, with dp_replicate {layout['dp_replicate']})",
        f"--parallel.tp ({_now(layout, 'tp')})",
    ]
    if pipelined and len(layout["stage_units"]) < _layers(layout) + 2:  # a stage per unit is the most
        more.insert(0, f"--parallel.pp ({_now(layout, 'pp')}: fewer layers per stage)")
    fixes = [
        _even_split(rank, layout),
        f"shard the model states over more ranks: raise {', '.join(more)}, or launch more GPUs",
    ]
    if pipelined and kind == "gradients":
        fixes.append(
            "the pipeline schedule accumulates each stage's unsharded fp32 gradients through the step "
            "whatever parallel.dp_shard_mode says"
        )
    elif layout["dp_shard_mode"] != "zero3" and not pipelined:
        fixes.append(f"--parallel.dp_shard_mode=zero3 ({_now(layout, 'dp_shard_mode')}) frees the gathered copy")
    return "; ".join(x for x in fixes if x)


def _activations(rank, layout: dict, kind: str) -> str:
    fixes = [
        f"--parallel.activation_checkpoint=full ({_now(layout, 'activation_checkpoint')})"
        if layout["activation_checkpoint"] != "full"
        else "",
        f"--parallel.pp_schedule=1F1B ({_now(layout, 'pp_schedule')} keeps all {layout['microbatches']} "
        "micro-batches in flight)"
        if layout["pp_schedule"] in ("GPipe", "LoopedBFS")
        else "",
        f"a smaller --training.micro_batch_size ({_now(layout, 'micro_batch_size')})",
        f"a larger --parallel.tp ({_now(layout, 'tp')})",
        f"a larger --parallel.cp ({_now(layout, 'cp')}: each rank holds 1/cp of every sequence)",
    ]
    return "; ".join(x for x in fixes if x)


def _buffers(rank, layout: dict, kind: str) -> str:
    parts = {"pipeline_receive": 0, "fsdp_gathered": 0, **rank.detail}
    if parts["pipeline_receive"] > 0 and parts["pipeline_receive"] >= parts["fsdp_gathered"]:
        return (
            f"the pipeline's receive buffers ({size(parts['pipeline_receive'])}: an activation and a gradient "
            f"per micro-batch of the step, {layout['microbatches']}) shrink with fewer sequences per pipeline: "
            f"a smaller --training.global_batch_size ({_now(layout, 'global_batch_size')}) or a larger "
            f"--parallel.dp_shard ({_now(layout, 'dp_shard')})"
        )
    if layout["pp"] > 1:
        return "; ".join(
            x
            for x in (
                _even_split(rank, layout),
                (
                    "the pipeline schedule keeps the rank's stages gathered through the step whatever "
                    f"parallel.dp_shard_mode says: smaller stages (a larger --parallel.pp, {_now(layout, 'pp')}) or a "
                    f"larger --parallel.tp ({_now(layout, 'tp')})"
                ),
            )
            if x
        )
    if layout["dp_shard_mode"] != "zero3":
        return f"--parallel.dp_shard_mode=zero3 ({_now(layout, 'dp_shard_mode')}) keeps only two blocks gathered"
    return f"a larger --parallel.tp ({_now(layout, 'tp')}) shrinks each gathered block"


def _layers(layout: dict) -> int:
    return max(stop for _, stop in layout["stage_units"]) - 2


def _even_split(rank, layout: dict) -> str:
    """Stage sizes that even the layers out, when this rank's stage holds more than its share (the
    automatic split counts the embedding and the output as a layer each)."""
    if layout["pp"] == 1:
        return ""
    n_layers, stages = _layers(layout), len(layout["stage_units"])
    held = [sum(0 < u <= n_layers for u in range(*layout["stage_units"][s])) for s in rank.detail["stages"]]
    per_stage, most = n_layers // stages, math.ceil(n_layers / stages)
    if max(held) <= most or stages < 3 or per_stage < 1:  # 0 layers per stage would mean "automatic"
        return ""
    ends = n_layers - (stages - 2) * per_stage
    return (
        f"this rank's stage holds {max(held)} layers where an even split gives "
        f"{per_stage if per_stage == most else f'{per_stage}-{most}'}: --parallel.pp_layers_per_stage={per_stage} "
        f"--parallel.pp_first_stage_layers={ends // 2} --parallel.pp_last_stage_layers={ends - ends // 2}"
    )
