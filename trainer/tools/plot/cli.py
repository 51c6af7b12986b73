"""`trillion plot`: pictures of a run, or of a layout.

  trillion plot outputs/default                      # curves.png: loss, held-out loss and tokens/s by step
  trillion plot RUN_DIR --out docs/images            # also pipeline.png (a profiled pipeline run) and
                                                     # replica_groups.png (a fault-tolerant run's groups)
  trillion plot --mesh --config FILE --world-size 16 --parallel.tp=2 ...   # mesh.png: which ranks hold what

A run directory gives every picture its records allow: the curves from metrics.jsonl, the newest pipeline trace
of profiles/ (written when profiling.enabled and parallel.pp > 1), and each replica group's steps over time from
replica_*/metrics.jsonl (fault_tolerance.enabled). --mesh draws the layout a `trillion train` of the config would
build on that many ranks (checked as the trainer checks it), with no process started."""

from __future__ import annotations

from pathlib import Path

from trillion.errors import ConfigError
from trillion.trainer.cli.args import CommandParser
from trillion.trainer.config.schema import load_config
from trillion.trainer.tools.plot.mesh import plot_mesh, rank_groups
from trillion.trainer.tools.plot.pipeline import newest_trace, plot_pipeline, read_trace
from trillion.trainer.tools.plot.run import plot_curves, plot_replica_groups, read_records

MAX_COLUMNS = 16  # ranks drawn in a row of the mesh: a node's, up to this


def parse(argv: list[str]):
    p = CommandParser("plot", description=__doc__.split("\n\n", 1)[1])
    p.add_argument("run_dir", nargs="?", default=None, help="a run directory (job.output_dir)")
    p.add_argument(
        "--out", default=None, help="folder for the pictures (default: RUN_DIR/plots, or plots/ with --mesh)"
    )
    p.add_argument("--mesh", action="store_true", help="draw the layout of --config (and overrides) instead of a run")
    p.add_argument("--config", default=None, help="with --mesh: a config `trillion train` accepts")
    p.add_argument(
        "--world-size", type=int, default=None, help="with --mesh: ranks (default: the config's job.world_size)"
    )
    ns, overrides = p.parse_known_args(argv)
    if ns.mesh == (ns.run_dir is not None):
        raise ConfigError(
            "trillion plot takes a run directory (trillion plot outputs/default) or --mesh with a layout "
            "(trillion plot --mesh --world-size 8 --parallel.tp=2), one of the two."
        )
    if overrides and not ns.mesh:
        raise ConfigError(f"Unknown option {overrides[0]!r} for a run directory. See `trillion plot --help`.")
    return ns, overrides


def plot_run(run_dir: Path, out: Path) -> list[Path]:
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a folder: give `trillion plot` a run directory (a job.output_dir).")
    written = []
    replicas = {int(p.parent.name.removeprefix("replica_")): p for p in sorted(run_dir.glob("replica_*/metrics.jsonl"))}
    if (run_dir / "metrics.jsonl").exists() or not replicas:
        written.append(plot_curves(read_records(run_dir / "metrics.jsonl"), out / "curves.png", run_dir.name))
    if trace := newest_trace(run_dir):
        step = trace.stem.removeprefix("pipeline-step")
        title = f"{run_dir.name}: step {step} as it ran, by pipeline rank"
        written.append(plot_pipeline(read_trace(trace), out / "pipeline.png", title))
    if replicas:
        groups = {group: read_records(path) for group, path in replicas.items()}
        title = f"{run_dir.name}: the steps {len(groups)} replica groups committed"
        written.append(plot_replica_groups(groups, out / "replica_groups.png", title))
    return written


def plot_layout(ns, overrides: list[str], out: Path) -> Path:
    from trillion.trainer.assemble import check_model_layout, resolve_layout
    from trillion.trainer.tools.estimate.dry_run import hardware_node, model_args_for

    config = load_config(ns.config, overrides)
    world = ns.world_size or config.job.world_size
    if not world:
        raise ConfigError("trillion plot --mesh needs --world-size N (or a config with job.world_size), e.g. 8.")
    layout = resolve_layout(config, world, hardware_node(config.job.hardware))  # checked as a run checks it
    check_model_layout(layout, model_args_for(config, layout), config.training.seq_len)
    degrees = [f"{name} {getattr(layout, name)}" for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")]
    shown = " x ".join(d for d in degrees[:-1] if not d.endswith(" 1")) or "one rank"
    title = f"{config.model.name} on {world} ranks: {shown}" + (f", {degrees[-1]}" if layout.ep > 1 else "")
    per_row = min(layout.ranks_per_node or world, MAX_COLUMNS, world)
    return plot_mesh(rank_groups(layout, world), world, out / "mesh.png", title, per_row)


def main(argv: list[str]) -> int:
    ns, overrides = parse(argv)
    if ns.mesh:
        written = [plot_layout(ns, overrides, Path(ns.out or "plots"))]
    else:
        run_dir = Path(ns.run_dir)
        written = plot_run(run_dir, Path(ns.out) if ns.out else run_dir / "plots")
    for path in written:
        print(f"wrote {path}")
    return 0
