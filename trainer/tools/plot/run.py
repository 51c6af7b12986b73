"""A run's curves from its metrics.jsonl: the training loss, the held-out loss and the throughput by step; and, for
a fault-tolerant run, each replica group's committed steps over wall time (who trained each step, who was away)."""

from __future__ import annotations

import json
from pathlib import Path

from trillion.errors import ConfigError
from trillion.parallel.planner.plot import pyplot, save_figure

NEEDED_BY = "trillion plot"
TOGETHER, ALONE = "C2", "C1"  # a step every replica group trained; one trained without every group


def read_records(path: Path) -> list[dict]:
    """Every record of a metrics.jsonl; a line cut off by a crash (the last one) is left out."""
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: give `trillion plot` a run directory (a job.output_dir).")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def plot_curves(records: list[dict], path: Path, title: str) -> Path:
    """Loss and held-out loss by step above, tokens/s per device by step below."""
    trained = [r for r in records if r.get("loss") is not None]
    evaluated = [r for r in records if r.get("eval_loss") is not None]
    if not trained and not evaluated:
        raise ConfigError(f"{title}: metrics.jsonl holds no logged step yet; plot it once the run has logged one.")
    plt = pyplot(NEEDED_BY)
    fig, (loss, speed) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    loss.plot([r["step"] for r in trained], [r["loss"] for r in trained], lw=1, alpha=0.7, label="training loss")
    loss.plot(
        [r["step"] for r in evaluated], [r["eval_loss"] for r in evaluated], "o-", color="C3", label="held-out loss"
    )
    loss.set(ylabel="loss (nats per token)", title=title)
    loss.grid(alpha=0.3)
    loss.legend()
    timed = [r for r in trained if r.get("tokens_per_s")]
    speed.plot([r["step"] for r in timed], [r["tokens_per_s"] for r in timed], lw=1, color="C2")
    speed.set(xlabel="step", ylabel="tokens/s per device")
    speed.set_ylim(bottom=0)
    speed.grid(alpha=0.3)
    return save_figure(plt, fig, path)


def plot_replica_groups(groups: dict[int, list[dict]], path: Path, title: str) -> Path:
    """One lane per replica group against seconds since the first step: a tick per committed step, coloured by
    whether every group trained it. A gap over which the group's steps jump is the group away (killed, restarting);
    one after which it commits its next step is a pause (waiting for a quorum). Each stretch is labelled with its
    first and last step."""
    plt = pyplot(NEEDED_BY)
    trained = {g: [r for r in records if r.get("loss") is not None] for g, records in sorted(groups.items())}
    start = min(r["time"] for records in trained.values() for r in records)
    everyone = sorted(groups)
    fig, ax = plt.subplots(figsize=(8, 1.2 * len(trained) + 1.4))
    for lane, records in enumerate(trained.values()):
        times = [r["time"] - start for r in records]
        together = [sorted(r.get("replica_groups", everyone)) == everyone for r in records]
        ax.scatter(times, [lane] * len(times), c=[TOGETHER if t else ALONE for t in together], marker="|", s=400)
        for first, last in _stretches(times):
            ax.text(times[first], lane - 0.3, f"step {records[first]['step']}", ha="left", fontsize=7)
            if last != first:
                ax.text(times[last], lane + 0.38, f"step {records[last]['step']}", ha="right", fontsize=7)
        for (_, end), (begin, _) in zip(_stretches(times), _stretches(times)[1:]):
            gap = gap_label(records[end]["step"], records[begin]["step"])
            ax.text((times[end] + times[begin]) / 2, lane, gap, ha="center", va="center", fontsize=8, color="grey")
    ax.set_yticks(range(len(trained)), [f"group {g}" for g in trained])
    ax.set_ylim(len(trained) - 0.4, -0.6)
    ax.set(xlabel="seconds since the first step", title=title)
    ax.legend(
        handles=[plt.Line2D([], [], color=c, marker="|", ls="", ms=12) for c in (TOGETHER, ALONE)],
        labels=["a step every group trained", "a step trained without every group"],
        fontsize=8,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
    )
    ax.grid(axis="x", alpha=0.3)
    return save_figure(plt, fig, path)


def gap_label(before: int, after: int) -> str:
    """A pause in a group's records between its steps `before` and `after`: away if it missed steps (the others
    committed them), else paused (it committed its next step: everyone waited, for a quorum or a retry)."""
    if after == before + 1:
        return "paused"
    return f"away: step {before + 1}" if after == before + 2 else f"away: steps {before + 1}-{after - 1}"


def _stretches(times: list[float]) -> list[tuple[int, int]]:
    """(first, last) indices of the runs of steps without a gap: a pause of over 3 x the median interval."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    usual = sorted(gaps)[len(gaps) // 2] if gaps else 0
    breaks = [i for i, gap in enumerate(gaps) if gap > 3 * usual]
    starts, ends = [0, *(i + 1 for i in breaks)], [*breaks, len(times) - 1]
    return list(zip(starts, ends))
