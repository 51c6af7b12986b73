"""Why the plan's expert-parallel degree: the best layout of each other ep against the chosen one, the
all-to-alls it pays (moe.py) against the FSDP traffic and memory it saves, in one line for the table
and a record for `--format json`."""

import dataclasses

from trillion.models import parts
from trillion.parallel.planner.memory import MEMORY_HEADROOM
from trillion.parallel.planner.moe import ep_degrees
from trillion.parallel.planner.search import Request, SearchResult, evaluate


def ep_choice(request: Request, result: SearchResult) -> dict | None:
    """None for a dense model; else the chosen ep, each other ep's best fitting layout (or, where none fits,
    the memory the best layout needs at that ep) and a sentence saying why."""
    if not parts.routed_experts(request.args):
        return None
    best = result.ranked[0]
    layout, step = best.layout, best.step
    where = "the node's link" if layout.ep * layout.tp <= request.hardware.scale_up else "the network"
    chosen = (
        f"ep {layout.ep}: its all-to-alls cost {step.ep_exposed:.2f} s of the {step.total:.2f} s step "
        f"({step.ep_exposed / step.total:.1%}, on {where}), exposed FSDP traffic {step.dp_exposed:.2f} s, "
        f"{best.memory.total / 1e9:.1f} GB per GPU"
        if layout.ep > 1
        else f"ep 1: no all-to-alls; exposed FSDP traffic {step.dp_exposed:.2f} s, {best.memory.total / 1e9:.1f} GB"
    )
    alternatives, notes = [], []
    degrees = set(ep_degrees(request.args, layout.dp_shard * layout.cp)) | {c.layout.ep for c in result.ranked}
    for ep in sorted(degrees - {layout.ep}):
        rival = next((c for c in result.ranked if c.layout.ep == ep), None)
        if rival is not None:
            slower = rival.step.total / step.total - 1
            alternatives.append({"ep": ep, "step_time_s": rival.step.total, "memory_gb": rival.memory.total / 1e9})
            notes.append(
                f"ep {ep} at best {rival.step.total:.2f} s ({slower:+.1%}, {_mostly(rival.step, step, ep < layout.ep)})"
            )
        else:
            same = evaluate(request, dataclasses.replace(layout, ep=ep), only_if_fits=True)
            alternatives.append({"ep": ep, "step_time_s": None, "memory_gb": same.memory.total / 1e9})
            notes.append(
                f"ep {ep} fits no layout (this one would need {same.memory.total / 1e9:.1f} GB of "
                f"{MEMORY_HEADROOM * request.capacity_bytes / 1e9:.0f})"
            )
    why = f"why {chosen}" + ("; " + "; ".join(_nearest(notes, alternatives, layout.ep)) if notes else "") + "."
    return {"ep": layout.ep, "why": why, "alternatives": alternatives}


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
