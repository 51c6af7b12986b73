"""What the expert dispatch needs of a layout, checked before any work (dims.check_layout) and by the planner:
the per-node dispatch's nodes, group-limited routing lined up with them, the per-rank capacity, the overlap and the
pairing's phase.
No torch here: the planner and the config checks import it."""

import logging

from trillion.errors import ConfigError
from trillion.models import parts
from trillion.parallel.modes import pairs_across_stages

log = logging.getLogger("trillion")


def ep_stride(layout) -> int:
    """How far apart the ep group's ranks are: tp (tp innermost, the group at one tp coordinate), or 1 folded over the
    tp ranks (parallel.etp=1: consecutive ranks)."""
    return 1 if layout.folded else layout.tp


def ep_nodes(layout) -> tuple[int, int]:
    """(nodes the ep group spans, its ranks in each): the group's ranks are ep_stride apart, so a node of
    ranks_per_node holds ranks_per_node / stride of them. (1, ep) inside one node."""
    members = max(1, layout.ranks_per_node // ep_stride(layout))
    return (layout.ep // members, members) if layout.ep > members else (1, layout.ep)


def resolve_dispatch(requested: str, nodes: int) -> str:
    """parallel.ep_dispatch: auto is node where the ep group spans nodes, else rank."""
    return ("node" if nodes > 1 else "rank") if requested == "auto" else requested


def check_ep_dispatch(layout, nodes_and_members: tuple[int, int], model_args, warn: bool = True) -> None:
    """ConfigError where the dispatch cannot run; with `warn`, a warning where group-limited routing is not lined up
    with the nodes (each node should hold whole groups, so that a token reaches at most its groups' nodes)."""
    if layout.ranks_per_node < layout.gpus:  # more than one node
        _check_ranks_per_node(layout)
    if layout.ep_dispatch == "node":
        _check_node_dispatch(layout, nodes_and_members[0], model_args, warn)
    if layout.ep_capacity > 0 and layout.ep_dispatch != "rank":
        raise ConfigError(
            f"moe.rank_capacity_factor={layout.ep_capacity:g} gives each destination rank fixed-size buffers, which "
            f"the per-rank dispatch has; parallel.ep_dispatch={layout.ep_dispatch} has not. Use "
            "--parallel.ep_dispatch=rank, or --moe.rank_capacity_factor=0 (dropless)."
        )
    turns = pairing_turns(layout)  # -1: auto, until the model is known (resolve_pairing_phase)
    if pairs_across_stages(layout) and not -1 <= layout.ep_pairing_phase < turns:
        raise ConfigError(
            f"parallel.ep_pairing_phase={layout.ep_pairing_phase}: each side of a paired forward and backward hands "
            f"the turn over {turns} times a MoE layer with parallel.ep_dispatch={layout.ep_dispatch}"
            f"{' and a per-rank capacity' if layout.ep_capacity > 0 else ''}, so the phases are 0 to {turns - 1} (a "
            f"larger one repeats one of them and leaves the forward alone for longer at each start). Use one of 0 to "
            f"{turns - 1} (`trillion plan` gives the best)."
        )


# parallel.ep_pairing_phase=auto, by (dispatch mode, whether the attention outweighs the shared experts): the phase at
# which the rows, the combine and their reverses each travel beside one of the other side's two longest segments, the
# routed experts and the heavier of the attention and the shared experts (planner/pairing.py's table: the turns'
# order is fixed, so only that comparison moves it; the per-expert mode turns as the per-rank one)
AUTO_PAIRING_PHASE = {("rank", True): 1, ("rank", False): 0, ("node", True): 4, ("node", False): 2}


def resolve_pairing_phase(layout, requested: int, model_args, seq_len: int) -> int:
    """parallel.ep_pairing_phase: `requested`, or for -1 (auto) AUTO_PAIRING_PHASE's where the layout pairs a
    forward with a backward across stages; 0 with a capacity (two turns a side, both posts long and both segments
    holding compute) and where nothing pairs."""
    if requested >= 0:
        return requested
    if not pairs_across_stages(layout) or layout.ep_capacity > 0:
        return 0
    mode = "node" if layout.ep_dispatch == "node" else "rank"
    return AUTO_PAIRING_PHASE[mode, attention_outweighs_shared(model_args, seq_len)]


def attention_outweighs_shared(model_args, seq_len: int) -> bool:
    """Whether a routed layer's attention (its linears, and its scores over `seq_len` as models/flops.py counts them)
    takes more forward FLOPs a token than its shared experts."""
    block = parts.block(model_args, True)
    sublayer = {part.module: part for part in block.sublayers}
    scores = block.heads.heads * (block.heads.qk_head_dim + block.heads.v_head_dim) * seq_len
    attention = sum(x.numel for x in sublayer["attention"].linears) + scores
    return attention > sum(x.numel for x in sublayer["feed_forward"].linears)


def pairing_turns(layout) -> int:
    """Turns each side of a paired forward and backward hands over a MoE layer (parallel/expert_overlap.py): after
    the counts (dropless; the per-node mode's among the node's ranks is waited for at once), the rows and the
    combine; per node after each of the two hops' rows and combines."""
    if layout.ep_dispatch == "node":
        return 5
    return 2 if layout.ep_capacity > 0 else 3


def check_expert_shards(layout, model_args) -> None:
    """FSDP2 shards each ep rank's expert stacks over the dp_shard x cp (x tp folded) / ep ranks left (efsdp) on their
    expert dim, or on the next where that does not split evenly (parallel/fsdp.py), and shards nothing unevenly:
    refuse where neither splits, before FSDP does mid-setup."""
    block = parts.block(model_args, True) if parts.routed_experts(model_args) else None
    efsdp = layout.efsdp
    if block is None or layout.ep <= 1 or efsdp <= 1:  # ep 1: the experts shard with their block, dim 0 padded
        return
    local = block.routing.n_experts // layout.ep
    for stack in block.experts:
        if local % efsdp and stack.in_features % efsdp:
            raise ConfigError(
                f"parallel.ep={layout.ep} leaves {local} experts on each expert-parallel rank, sharded by FSDP over "
                f"the {efsdp} ranks left (parallel.dp_shard x cp{' x tp' if layout.folded else ''} / ep = "
                f"{efsdp * layout.ep} / {layout.ep}); "
                f"neither {local} nor the expert stack's next dim ({stack.in_features}) divides by {efsdp}, and "
                "FSDP2 shards nothing unevenly. Pick an ep whose leftover ranks divide the experts per rank (e.g. a "
                "larger ep), or a dp_shard that keeps them a divisor."
            )


def _check_ranks_per_node(layout) -> None:
    stride = ep_stride(layout)
    per_node = max(1, layout.ranks_per_node // stride)
    apart = "consecutive: parallel.etp=1 folds them over tp" if stride == 1 else f"parallel.tp={stride} apart"
    if layout.ranks_per_node % stride or (layout.ep > per_node and layout.ep % per_node):
        raise ConfigError(
            f"parallel.ranks_per_node={layout.ranks_per_node} puts {layout.ranks_per_node / stride:g} of the "
            f"parallel.ep={layout.ep} expert-parallel ranks on a node (they are {apart}), which "
            f"does not divide ep: the per-node dispatch needs every node to hold the same number of them. Use an ep "
            f"that is a multiple of {per_node} (or divides it), or give the true ranks per node "
            "(--parallel.ranks_per_node; 0 reads the launcher's LOCAL_WORLD_SIZE)."
        )
    if layout.ep < per_node and per_node % layout.ep:
        raise ConfigError(
            f"parallel.ep={layout.ep} does not divide the {per_node} expert-parallel ranks of a node "
            f"(parallel.ranks_per_node={layout.ranks_per_node}, the ep ranks {apart}), so some ep groups straddle two "
            f"nodes. Use an ep that divides {per_node} or is a multiple of it."
        )


def _check_node_dispatch(layout, nodes: int, model_args, warn: bool) -> None:
    if nodes == 1:
        raise ConfigError(
            f"parallel.ep_dispatch=node, but the parallel.ep={layout.ep} ranks of each ep group share one node "
            f"(parallel.ranks_per_node={layout.ranks_per_node}): there is no network hop to spare. Use "
            "--parallel.ep_dispatch=rank (or auto), or a larger ep."
        )
    routing = parts.routing(model_args)
    if not warn or routing is None or routing.groups <= 1 or routing.groups % nodes == 0:
        return
    log.warning(
        "parallel.ep_dispatch=node: the routing's %d groups do not line up with the %d nodes the ep group spans "
        "(each node should hold whole groups), so a token may cross the network to more nodes than its %d groups'. "
        "Pick an ep whose node count divides the %d groups.",
        routing.groups,
        nodes,
        routing.groups_chosen,
        routing.groups,
    )
