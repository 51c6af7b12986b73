"""A pipeline schedule as it ran: the trace a profiled pipeline step writes (trainer/metrics/pipeline_timeline.py,
`profiles/pipeline-stepN.json`) drawn as one row per pipeline rank against time, a bar per forward or backward of a
micro-batch (its number on the bar); the gaps are the bubble and the transfers."""

from __future__ import annotations

import json
from pathlib import Path

from trillion.parallel.planner.plot import pyplot, save_figure

COLORS = {"forward": "C0", "backward": "C1", "backward (inputs)": "C1", "backward (weights)": "C4"}


def newest_trace(run_dir: Path) -> Path | None:
    """The last profiled step's pipeline trace of a run directory (None: it recorded none)."""
    traces = sorted(
        (run_dir / "profiles").glob("pipeline-step*.json"), key=lambda p: int(p.stem.removeprefix("pipeline-step"))
    )
    return traces[-1] if traces else None


def plot_pipeline(trace: dict, path: Path, title: str) -> Path:
    plt = pyplot("trillion plot")
    actions = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ranks = sorted({e["pid"] for e in actions})
    start = min(e["ts"] for e in actions)
    several = {r for r in ranks if len({e["args"]["stage"] for e in actions if e["pid"] == r}) > 1}
    fig, ax = plt.subplots(figsize=(9, 0.9 * len(ranks) + 1.6))
    for event in actions:
        left, width = (event["ts"] - start) / 1e3, event["dur"] / 1e3
        row = ranks.index(event["pid"])
        ax.barh(row, width, left=left, height=0.7, color=COLORS[event["cat"]], edgecolor="white")
        # a rank holding several stages (interleaved, V schedules) labels each bar with its stage too
        label = f"{event['args']['micro_batch']}" + (f"/s{event['args']['stage']}" if event["pid"] in several else "")
        ax.text(left + width / 2, row, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(ranks)), [f"pipeline rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set(xlabel="milliseconds into the step", title=title)
    used = sorted({e["cat"] for e in actions}, key=list(COLORS).index)
    ax.legend(
        handles=[plt.Rectangle((0, 0), 1, 1, color=COLORS[c]) for c in used],
        labels=used,
        fontsize=8,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
    )
    ax.grid(axis="x", alpha=0.3)
    return save_figure(plt, fig, path)


def read_trace(path: Path) -> dict:
    return json.loads(path.read_text())
