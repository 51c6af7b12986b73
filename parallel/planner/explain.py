"""Why the plan's expert-parallel degree and placement (parallel.etp): the best layout of each other (ep, etp)
against the chosen one, the all-to-alls it pays (moe.py) against the FSDP traffic and memory it saves, in one line
for the table and a record for `--format json`."""

import dataclasses

from trillion.models import parts
from trillion.parallel.ep_checks import ep_stride
from trillion.parallel.planner.memory import MEMORY_HEADROOM
from trillion.parallel.planner.search import Request, SearchResult, evaluate
from trillion.parallel.planner.space import expert_layouts


def ep_choice(request: Request, result: SearchResult) -> dict | None:
    """None for a dense model; else the chosen ep and etp, each other (ep, etp)'s best fitting layout (or, where none
    fits, the memory the best layout needs there) and a sentence saying why."""
    if not parts.routed_experts(request.args):
        return None
    best = result.ranked[0]
    layout, step = best.layout, best.step
    span = layout.ep * ep_stride(layout)  # the consecutive GPUs one ep group spans
    where = "the node's link" if span <= request.hardware.scale_up else "the network"
    chosen = (
        f"{_name(layout.ep, layout.expert_tp, layout.tp)}: its all-to-alls cost {step.ep_exposed:.2f} s of the "
        f"{step.total:.2f} s step "
        f"({step.ep_exposed / step.total:.1%}, on {where}), exposed FSDP traffic {step.dp_exposed:.2f} s, "
        f"{best.memory.total / 1e9:.1f} GB per GPU"
        if layout.ep > 1
        else f"ep 1: no all-to-alls; exposed FSDP traffic {step.dp_exposed:.2f} s, {best.memory.total / 1e9:.1f} GB"
    )
    alternatives, notes = [], []
    mine = (layout.ep, layout.expert_tp)
    pairs = set(expert_layouts(request.args, layout.tp, layout.cp, layout.dp_shard))
    pairs |= {(c.layout.ep, c.layout.expert_tp) for c in result.ranked if c.layout.tp == layout.tp}
    for ep, etp in sorted(pairs - {mine}):
        name = _name(ep, etp, layout.tp)
        rival = next((c for c in result.ranked if (c.layout.ep, c.layout.expert_tp) == (ep, etp)), None)
        if rival is not None:
            slower = rival.step.total / step.total - 1
            record = {"ep": ep, "etp": etp, "step_time_s": rival.step.total, "memory_gb": rival.memory.total / 1e9}
            alternatives.append(record)
            notes.append(
                f"{name} at best {rival.step.total:.2f} s ({slower:+.1%}, {_mostly(rival.step, step, ep < layout.ep)})"
            )
        else:
            same = evaluate(request, dataclasses.replace(layout, ep=ep, etp=etp), only_if_fits=True)
            step_time = same.step.total if same.fits else None  # fits, where the search was held to another ep
            alternatives.append({"ep": ep, "etp": etp, "step_time_s": step_time, "memory_gb": same.memory.total / 1e9})
            gb = f"{same.memory.total / 1e9:.1f} GB of {MEMORY_HEADROOM * request.capacity_bytes / 1e9:.0f}"
            if same.fits:
                slower = same.step.total / step.total - 1
                notes.append(f"{name} in this layout {same.step.total:.2f} s ({slower:+.1%}), {gb}")
            else:
                notes.append(f"{name} fits no layout (this one would need {gb})")
    why = f"why {chosen}" + ("; " + "; ".join(_nearest(notes, alternatives, layout.ep)) if notes else "") + "."
    return {"ep": layout.ep, "etp": layout.expert_tp, "why": why, "alternatives": alternatives}


def _name(ep: int, etp: int, tp: int) -> str:
    """An expert layout in words: ep alone without tp (or ep 1), else with its etp."""
    return f"ep {ep}" if tp == 1 or ep == 1 else f"ep {ep} etp {etp}"


PARTS = {
    "ep_exposed": "all-to-alls",
    "dp_exposed": "exposed FSDP traffic",
    "compute": "compute",
    "bubble": "pipeline bubble",
    "tp_exposed": "TP traffic",
}


def _mostly(rival, best, smaller_ep: bool) -> str:
    """The part of the step that differs most between two layouts' steps."""
    part = max(PARTS, key=lambda name: abs(getattr(rival, name) - getattr(best, name)))
    delta = getattr(rival, part) - getattr(best, part)
    why = " (fewer rows per expert GEMM)" if part == "compute" and smaller_ep and delta > 0 else ""
    return f"mostly {PARTS[part]} {delta:+.2f} s{why}"


def _nearest(notes: list[str], alternatives: list[dict], ep: int, keep: int = 4) -> list[str]:
    """The notes of the `keep` degrees nearest the chosen one (by factor), in ep order."""
    order = sorted(range(len(notes)), key=lambda i: abs(alternatives[i]["ep"] / ep - 1) + (alternatives[i]["ep"] < ep))
    return [notes[i] for i in sorted(order[:keep])]
