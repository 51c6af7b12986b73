"""The planner's pictures: throughput against memory of every fitting layout, and weak and strong
scaling curves. matplotlib is an optional dependency (`pip install trillion[plot]`), imported here
only when a plot is asked for."""

from pathlib import Path

from trillion.errors import ConfigError
from trillion.parallel.planner.search import Request, SearchResult, metrics, scaling


def pyplot(needed_by: str = "--plot"):
    """matplotlib's pyplot, drawing to files; without matplotlib a user error naming `needed_by` and the extra."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(f"{needed_by} needs matplotlib: pip install 'trillion[plot]'.") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt, fig, path: Path) -> Path:
    """Writes `fig` to `path` (its folder made) and frees it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_tradeoff(request: Request, result: SearchResult, path: Path) -> Path:
    plt = pyplot()
    rows = [metrics(request, c) for c in result.ranked]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, marker in (("none", "o"), ("selective", "s"), ("full", "^")):
        chosen = [r for r in rows if r["activation_checkpoint"] == mode]
        ax.scatter(
            [r["memory_gb"] for r in chosen],
            [r["tokens_per_s"] for r in chosen],
            s=10,
            marker=marker,
            alpha=0.6,
            label=f"checkpointing {mode}",
        )
    best = rows[0]
    ax.scatter([best["memory_gb"]], [best["tokens_per_s"]], s=120, facecolors="none", edgecolors="red", label="best")
    ax.axvline(request.hardware.device.memory_gb, color="grey", linestyle="--", label="device memory")
    ax.set(
        xlabel="memory per GPU (GB)",
        ylabel="tokens/s",
        title=f"{request.model} on {request.gpus} x {request.hardware.name}: layouts that fit",
    )
    ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


def plot_scaling(
    curves: dict[str, list[tuple[int, float]]],
    path: Path,
    title: str,
    reference: dict[str, tuple[int, float]] | None = None,
) -> Path:
    """curves: label -> [(gpus, efficiency)]; reference: label -> (gpus, efficiency) published points."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in curves.items():
        ax.plot([g for g, _ in points], [100 * e for _, e in points], marker="o", label=label)
    for label, (gpus, efficiency) in (reference or {}).items():
        ax.scatter([gpus], [100 * efficiency], marker="*", s=160, zorder=5, label=label)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="GPUs", ylabel="scaling efficiency (%)", title=title, ylim=(0, efficiency_top(curves, reference)))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


def efficiency_top(curves: dict[str, list[tuple[int, float]]], reference: dict | None = None) -> float:
    """The scaling plot's upper limit in percent: 110, or above the highest point (the planner may predict a
    superlinear efficiency where the smallest GPU count can only hold a slower layout)."""
    points = [e for line in curves.values() for _, e in line] + [e for _, e in (reference or {}).values()]
    return max(110.0, 105.0 * max(points, default=0.0))


def plot_request(request: Request, result: SearchResult, directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    counts = [request.gpus // k for k in (8, 4, 2, 1) if request.gpus % k == 0 and request.global_batch % k == 0]
    weak = scaling(_at(request, counts[0]), counts, weak=True)
    strong = scaling(_at(request, counts[0]), counts, weak=False)
    curves = {
        "weak (global batch grows with GPUs)": [(g, e) for g, e, _ in weak],
        "strong (global batch fixed)": [(g, e) for g, e, _ in strong],
    }
    return [
        plot_tradeoff(request, result, directory / "tradeoff.png"),
        plot_scaling(
            curves, directory / "scaling.png", f"{request.model} on {request.hardware.name}: predicted scaling"
        ),
    ]


def _at(request: Request, gpus: int) -> Request:
    """The request scaled down to `gpus`, keeping the global batch per GPU (weak-scaling base)."""
    import dataclasses

    return dataclasses.replace(request, gpus=gpus, global_batch=request.global_batch * gpus // request.gpus)
