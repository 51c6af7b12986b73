"""ParallelDims: the parallel degrees of a layout (parallel/layout.py), checked against the world, and the one
DeviceMesh with named axes (pp, dp_replicate, dp_shard, cp, tp) built from them; a run builds it once. What the
model asks of a layout is `check_layout`'s, a function of the Layout.

Ranks are laid out with tp innermost (consecutive ranks, so a tensor-parallel group stays inside a
node), then cp, dp_shard, dp_replicate, and pp outermost. Only axes of size > 1 are created, so a
size-1 axis costs no process group; the accessors below hide which ones exist.

Sub-meshes other code needs:
- `fsdp_mesh`: what FSDP2 shards over: (dp_replicate, dp_shard x cp) for HSDP, else dp_shard x cp
  (the cp ranks hold the same weights, so they share the sharding and the gradient reduction).
- `tp_mesh`, `cp_mesh`: the tensor- and context-parallel axes.
- `dp_group` / `dp_rank` / `dp_size`: the flattened dp_replicate x dp_shard coordinate; the data
  loader's slice of the global batch uses it (the cp ranks of a data-parallel rank read the same
  sequences and each keeps its share of them).
- `all_reduce_dp`: sums over every rank holding other tokens of the global batch (dp x cp): the
  token count and the loss.

Expert parallelism (`ep`, parallel/expert_parallel.py) views the ranks of each pp stage a second time, as
torchtitan and Megatron-Core's MoE parallel folding do: the flattened dp_replicate x dp_shard x cp x tp ranks as
(dp_replicate, efsdp, ep, etp), etp innermost. With parallel.etp = tp the etp axis is the tp ranks (the routed
experts tensor-parallel over it) and ep the inner dp_shard x cp ranks, tp apart; with etp = 1 (folded) there is no
etp axis and ep is the innermost ranks: every tp rank, then cp, then some of dp_shard. `ep_mesh` spreads the routed
experts (`expert_tp_mesh` the (ep, etp) pair they are split over with etp = tp); `expert_fsdp_mesh` is what FSDP2
shards them over, the data-parallel ranks left: (dp_replicate, efsdp) for HSDP, else efsdp (kept even of size 1, so
the experts have their own FSDP group). Everything else is placed as without ep. Folded, each tp rank routes its own
tokens: the MoE layers' statistics are summed over the cp x tp ranks of a sequence (`routed_sequence_group`) and
their tallies over every rank (`all_reduce_routed`). With ep = 1 none of this exists: no extra mesh, no extra
process group.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trillion.errors import ConfigError
from trillion.models import parts
from trillion.parallel.context_parallel import check_sequence
from trillion.parallel.ep_checks import check_ep_dispatch, check_expert_shards, ep_nodes
from trillion.parallel.layout import AXES, Layout, check_degrees, degrees_of, divisors, layout_on
from trillion.parallel.tp_checks import check_tp_overlap

log = logging.getLogger("trillion")

GPUS_PER_NODE = 8  # tensor parallelism beyond one node's GPUs crosses the slow network


@dataclass
class ParallelDims:
    """The mesh of `layout`'s degrees over `world_size` ranks (checked to make exactly that many)."""

    layout: Layout = field(default_factory=Layout)
    world_size: int = 1
    mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    expert_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    ep_node_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)  # (ep_node, ep_local)

    def __post_init__(self) -> None:
        check_degrees(self.world_size, **degrees_of(self.layout))

    @classmethod
    def of(cls, world_size: int = 1, **fields) -> ParallelDims:
        """The dims of a layout built in code (parallel/layout.py layout_on: dp_shard -1 or left out is what the
        world size leaves; every other field Layout's default unless given)."""
        return cls(layout_on(world_size, **fields), world_size)

    # --- the degrees ---------------------------------------------------------------------------
    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp_replicate(self) -> int:
        return self.layout.dp_replicate

    @property
    def dp_shard(self) -> int:
        return self.layout.dp_shard

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def ep(self) -> int:
        """Expert parallelism, within dp_shard x cp (x tp folded: parallel.etp=1); not a mesh axis of its own."""
        return self.layout.ep

    # --- what is on -----------------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.layout.fsdp_enabled

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """The sharded data-parallel ranks left to the routed experts: dp_shard x cp (x tp folded) / ep."""
        return self.layout.efsdp

    @property
    def ep_nodes(self) -> tuple[int, int]:
        """(nodes the ep group spans, its ranks in each): ep_checks.ep_nodes."""
        return ep_nodes(self.layout)

    # --- the mesh ------------------------------------------------------------------------------
    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The named mesh of all axes of size > 1 (None in one process); call after init_process_group."""
        # dp_shard stays (even of size 1) beside dp_replicate: FSDP2 replicates only on a 2-D mesh.
        names = [n for n in AXES if getattr(self, n) > 1 or (n == "dp_shard" and self.dp_replicate > 1)]
        if not names:
            return None
        self.mesh = init_device_mesh(device_type, tuple(getattr(self, n) for n in names), mesh_dim_names=tuple(names))
        if self.dp_replicate > 1:
            self.mesh["dp_replicate", "dp_shard"]._flatten("dp")
        flats = [(("dp_shard", "cp"), "dp_shard_cp"), (("dp_replicate", "dp_shard", "cp"), "dp_cp")] * (self.cp > 1)
        if self.layout.folded:  # the ranks routing other positions of the same sequences: cp x tp
            flats.append((("cp", "tp"), "cp_tp"))
        for axes, flat in flats:
            present = tuple(n for n in axes if n in names)
            if len(present) > 1:
                self.mesh[present]._flatten(flat)
        if self.ep > 1:
            self._build_expert_mesh()
        return self.mesh

    def _build_expert_mesh(self) -> None:
        """(dp_replicate, efsdp, ep[, etp]) viewed on the flattened data-parallel x cp x tp ranks of each pp stage."""
        present = tuple(n for n in ("dp_replicate", "dp_shard", "cp", "tp") if n in self.mesh.mesh_dim_names)
        region = self.mesh[present[0]] if len(present) == 1 else self.mesh[present]._flatten("expert_region")
        sizes, names = (self.efsdp, self.ep), ("efsdp", "ep")
        if self.dp_replicate > 1:
            sizes, names = (self.dp_replicate, *sizes), ("edp_replicate", *names)
        if self.layout.expert_tp > 1:
            sizes, names = (*sizes, self.tp), (*names, "etp")
        self.expert_mesh = region._unflatten(0, sizes, names)
        nodes, members = self.ep_nodes
        if self.layout.ep_dispatch == "node" and nodes > 1:  # the per-node dispatch's two hops
            self.ep_node_mesh = self.expert_mesh["ep"]._unflatten(0, (nodes, members), ("ep_node", "ep_local"))

    def _axis(self, *names: str) -> DeviceMesh | None:
        present = tuple(n for n in names if getattr(self, n) > 1)
        if self.mesh is None or not present:
            return None
        return self.mesh[present if len(present) > 1 else present[0]]

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self._axis("tp")

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        return self._axis("cp")

    def _flat(self, axes: tuple[str, ...], flat: str) -> str:
        """The name of the mesh dimension spanning the present ones of `axes` (flattened in build_mesh)."""
        present = [n for n in axes if n in self.mesh.mesh_dim_names]
        return present[0] if len(present) == 1 else flat

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """FSDP2's mesh: 2-D (replicate, shard) gives HSDP (plain replication when dp_shard x cp is 1)."""
        if self.mesh is None or not self.fsdp_enabled:
            return None
        shard = self._flat(("dp_shard", "cp"), "dp_shard_cp")
        if self.dp_replicate > 1:
            return self.mesh["dp_replicate", shard]
        return self.mesh[shard]

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """The 1-D mesh the routed experts are split over (None with ep = 1)."""
        return self.expert_mesh["ep"] if self.expert_mesh is not None else None

    @property
    def expert_tp_mesh(self) -> DeviceMesh | None:
        """The 2-D (ep, etp) mesh the routed experts are split over with parallel.etp = tp > 1 (None otherwise)."""
        if self.expert_mesh is None or "etp" not in self.expert_mesh.mesh_dim_names:
            return None
        return self.expert_mesh["ep", "etp"]

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """FSDP2's mesh for the routed experts under ep: the data-parallel ranks ep leaves."""
        if self.expert_mesh is None:
            return None
        if self.dp_replicate > 1:
            return self.expert_mesh["edp_replicate", "efsdp"]
        return self.expert_mesh["efsdp"]

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """1-D: all data-parallel ranks, flattened (replicate major, shard minor)."""
        if self.mesh is None or self.dp_size == 1:
            return None
        if self.dp_replicate > 1:
            return self.mesh["dp"]
        return self.mesh["dp_shard"]

    @property
    def dp_group(self):
        """The process group that sums token counts and losses over data-parallel ranks (None: one rank)."""
        mesh = self.dp_mesh
        return mesh.get_group() if mesh is not None else None

    @property
    def dp_rank(self) -> int:
        mesh = self.dp_mesh
        return mesh.get_local_rank() if mesh is not None else 0

    @property
    def routed_sequence_group(self):
        """Folded (parallel.etp=1): the process group of the ranks holding other positions of this rank's sequences
        in the MoE layers, cp x tp; None otherwise (context parallelism alone: its cp group)."""
        if not self.layout.folded:
            return None
        return self.mesh[self._flat(("cp", "tp"), "cp_tp")].get_group()

    def all_reduce_routed(self, tensor):
        """Sum `tensor` in place over the ranks routing other tokens through the MoE layers: data-parallel x cp, and
        the tp ranks when ep folds over them (each routes its own tokens)."""
        if not self.layout.folded:
            return self.all_reduce_dp(tensor)
        region = self._flat(("dp_replicate", "dp_shard", "cp", "tp"), "expert_region")  # _build_expert_mesh's
        dist.all_reduce(tensor, group=self.mesh[region].get_group())
        return tensor

    def all_reduce_dp(self, tensor, op=dist.ReduceOp.SUM):
        """Sum (or `op`) `tensor` in place over the ranks holding other tokens: data-parallel x cp (a no-op on one)."""
        if self.cp > 1:
            dist.all_reduce(
                tensor, op=op, group=self.mesh[self._flat(("dp_replicate", "dp_shard", "cp"), "dp_cp")].get_group()
            )
        elif self.dp_group is not None:
            dist.all_reduce(tensor, op=op, group=self.dp_group)
        return tensor


# --- checks against the model and the run --------------------------------------------------------------
def check_layout(layout: Layout, model_args, seq_len: int, gpus_per_node: int | None = None) -> None:
    """Raise ConfigError for a layout this model or this build cannot run; warn on slow ones."""
    if layout.pp > 1 and layout.pp > model_args.n_layers + 2:
        raise ConfigError(
            f"parallel.pp={layout.pp} is more than the model's {model_args.n_layers} layers + embedding "
            f"+ output = {model_args.n_layers + 2} pipeline units; each stage needs at least one. "
            f"Use --parallel.pp={model_args.n_layers + 2} or less."
        )  # schedules: parallel/pipeline.py
    check_sequence(layout.cp, layout.tp, seq_len)
    check_tp_overlap(layout, seq_len)
    _check_ep(layout, model_args)
    if layout.tp > 1:
        _check_tensor_parallel(layout, model_args, seq_len, gpus_per_node)


def _check_tensor_parallel(layout: Layout, a, seq_len: int, gpus_per_node: int | None) -> None:
    tp = layout.tp
    checks = [
        ("model.n_heads", a.n_heads, "query heads"),
        ("model.n_kv_heads", a.kv_heads, "key/value heads"),
        ("model.ffn_dim", a.ffn_hidden, "feed-forward width"),
        ("model.vocab_size", a.vocab_size, "vocabulary (pad it to a multiple of tp)"),
        ("training.seq_len", seq_len // layout.cp, "sequence length per cp rank (sequence parallelism splits it)"),
    ]
    if a.positions == "learned":
        checks.append(("model max_seq_len", a.max_seq_len, "learned position table"))
    valid = [d for d in range(1, max(tp, GPUS_PER_NODE) + 1) if all(value % d == 0 for _, value, _ in checks)]
    for setting, value, what in checks:
        if value % tp:
            raise ConfigError(
                f"parallel.tp={tp} does not divide {setting}={value} (the {what}); tensor parallelism splits it "
                f"evenly. Use a tp that divides all of heads, KV heads, FFN width, vocabulary and sequence "
                f"length (e.g. --parallel.tp={max(d for d in valid if d <= tp)} with --parallel.dp_shard=-1; "
                f"valid: {', '.join(map(str, valid))})."
            )
    if a.norm_impl != "torch":
        raise ConfigError(
            f"kernels.norm={a.norm_impl!r} cannot run on sequence-parallel (DTensor) activations. "
            "Use --kernels.norm=torch with parallel.tp > 1."
        )
    if a.tie_embeddings:
        raise ConfigError(
            "parallel.tp > 1 with tied input/output embeddings is not supported: tensor parallelism "
            "would untie them. Use --parallel.tp=1 or a model without tie_embeddings."
        )
    node = gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", GPUS_PER_NODE))
    if tp > node:
        log.warning(
            "parallel.tp=%d is larger than the %d devices of a node: tensor-parallel collectives run on "
            "every layer and will cross the inter-node network. Prefer tp <= %d and raise dp_shard.",
            tp,
            node,
            node,
        )


def _check_ep(layout: Layout, model_args) -> None:
    if layout.ep == 1:
        if layout.ep_overlap:
            raise ConfigError(
                "parallel.ep_overlap=true overlaps the expert all-to-alls with compute, but parallel.ep=1 has "
                "none. Give --parallel.ep=2 or more (an MoE model), or drop --parallel.ep_overlap."
            )
        return
    check_ep_dispatch(layout, ep_nodes(layout), model_args)
    experts = parts.routed_experts(model_args)
    if not experts:
        raise ConfigError(
            f"parallel.ep={layout.ep}, but the model is dense (no experts to spread). Use --parallel.ep=1, or an "
            "MoE preset (e.g. --model.name=debug-moe)."
        )
    if experts % layout.ep:
        region, named = layout.dp_shard * layout.cp, "dp_shard x cp"
        if layout.folded:
            region, named = region * layout.tp, "dp_shard x cp x tp (parallel.etp=1)"
        valid = [d for d in divisors(experts) if region % d == 0]
        raise ConfigError(
            f"parallel.ep={layout.ep} does not divide the model's {experts} routed experts "
            "(model.n_experts): each expert-parallel rank holds the same number of whole experts. Use an ep "
            f"that divides both n_experts and {named} (valid: {', '.join(map(str, valid))}), or set "
            "--model.n_experts to a multiple of ep."
        )
    check_expert_shards(layout, model_args)
