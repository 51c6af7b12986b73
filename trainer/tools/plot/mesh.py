"""Which ranks hold what: a layout's DeviceMesh as the trainer builds it (parallel/dims.py), read rank by rank in a
fake process group (as `trillion estimate` simulates ranks), drawn as one panel per parallel axis: every rank a box
(its number, its index along the axis below it), the ranks of one group in one colour."""

from __future__ import annotations

import math
from pathlib import Path

from trillion.parallel.dims import ParallelDims
from trillion.parallel.layout import AXES, Layout
from trillion.parallel.planner.plot import pyplot, save_figure
from trillion.trainer.tools.estimate.rank import fake_world, meshed_dims

# what the ranks of one group share (and split) along each axis
MEANING = {
    "pp": "one pipeline: each rank runs another stage",
    "dp_replicate": "replicas of the same shards",
    "dp_shard": "FSDP: one block's parameters sharded",
    "cp": "one sequence, in chunks",
    "tp": "one layer's weights, in slices",
    "ep": "the routed experts, split",
}


def rank_groups(layout: Layout, world_size: int) -> dict[str, list[tuple[int, ...]]]:
    """axis -> its process groups (each a tuple of ranks), for every axis of size > 1 and ep, as each rank's mesh
    holds them."""
    found: dict[str, set[tuple[int, ...]]] = {}
    for rank in range(world_size):
        with fake_world(rank, world_size):
            dims = meshed_dims(ParallelDims(layout, world_size))
            meshes = {name: dims.mesh[name] for name in AXES if dims.mesh and name in dims.mesh.mesh_dim_names}
            if dims.ep_mesh is not None:
                meshes["ep"] = dims.ep_mesh
            for name, mesh in meshes.items():
                if mesh.size() > 1:
                    found.setdefault(name, set()).add(tuple(mesh.mesh.flatten().tolist()))
    order = [*AXES, "ep"]
    return {name: sorted(found[name]) for name in sorted(found, key=order.index)}


def plot_mesh(groups: dict[str, list[tuple[int, ...]]], world_size: int, path: Path, title: str, per_row: int) -> Path:
    plt = pyplot("trillion plot --mesh")
    rows = math.ceil(world_size / per_row)
    columns = min(len(groups), 2)
    panels = math.ceil(len(groups) / columns)
    fig, axes = plt.subplots(
        panels, columns, figsize=(0.55 * per_row * columns + 0.6, (0.5 * rows + 0.7) * panels + 0.5), squeeze=False
    )
    for ax in axes.flat[len(groups) :]:
        ax.axis("off")
    for ax, (name, members) in zip(axes.flat, groups.items()):
        colors = plt.get_cmap("tab20", max(len(members), 2))
        for index, group in enumerate(members):
            for position, rank in enumerate(group):
                x, y = rank % per_row, rank // per_row
                ax.add_patch(plt.Rectangle((x, y), 0.92, 0.88, color=colors(index)))
                ax.text(x + 0.46, y + 0.36, str(rank), ha="center", va="center", fontsize=9, weight="bold")
                ax.text(x + 0.46, y + 0.7, f"{name} {position}", ha="center", va="center", fontsize=5.5)
        ax.set_xlim(-0.1, per_row)
        ax.set_ylim(rows, -0.1)
        ax.set_aspect("equal")
        ax.axis("off")
        size = len(members[0])
        ax.set_title(f"{name}: {len(members)} groups of {size} ({MEANING[name]})", fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save_figure(plt, fig, path)
