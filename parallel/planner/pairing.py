"""A forward paired with a backward across pipeline stages (parallel/pipeline_pairing.py), priced turn by turn. Each
side hands the turn over right after posting an expert all-to-all and waits for it once the turn comes back, so each
all-to-all travels while the other side computes one segment of its layer: its work between two of its own posts.
The sides alternate, so the start of each paired chunk fixes which segment each post meets for the whole chunk;
parallel.ep_pairing_phase sets it (the backward hands the turn straight back that many times before it starts).

One MoE layer of each side, in the order it runs, as (segment, the post that ends it) (expert_parallel.py):

- rank and expert modes: forward attention -> counts, shared -> rows, experts -> combine; backward attention ->
  the combine's reverse, experts -> the rows' reverse, shared -> a turn;
- with a capacity: forward attention -> rows, shared + experts -> combine; backward attention + shared -> the
  combine's reverse, experts -> the rows' reverse;
- node: forward attention -> counts, shared -> hop 1, - -> hop 2, experts -> hop 2 back, - -> hop 1 back; backward
  attention -> hop 1 back's reverse, - -> hop 2 back's reverse, experts -> hop 2's reverse, - -> hop 1's reverse,
  shared -> a turn.

"attention" is the rest of the block (norms, attention, the router; the tensor- and context-parallel collectives
left out, as they do not compute), "-" nothing but a wait and a gather, and the backward's last "turn" posts
nothing (expert_overlap.turn_in_backward: the counts have no gradient). At phase p the forward's post i travels
beside the backward's segment i - p, and the backward's post k beside the forward's segment k + p + 1 (indices a
layer's turns apart, modulo its count), so the phase that puts each long all-to-all beside a long segment depends on
the layer's shapes: at DeepSeek-V3's per rank, where the shared experts are a small segment, phase 0 leaves the
combine and its reverse beside them.

Not modelled: each chunk's ends, where one side has finished and the other's last posts (phase p: the forward's
first p) travel beside nothing; two all-to-alls in flight at once sharing the links; the recomputed forward's posts
under a checkpoint that replays blocks (moe.py prices that by the mean segment).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Segments:
    """A MoE layer's compute on one side, in seconds: the rest of the block, the shared experts, the routed experts."""

    attention: float
    shared: float
    experts: float


@dataclass(frozen=True)
class Turns:
    """A side's layer in the order it runs: `segments[i]` ends in the post that travels `posts[i]` seconds."""

    segments: tuple[float, ...]
    posts: tuple[float, ...]


def forward_turns(mode: str, capacity: bool, counts: float, hops: list, back: list, work: Segments) -> Turns:
    """The forward's layer: `counts` (0 with a capacity), the rows' `hops` (the dispatch, one a hop: per node two)
    and the combine's (`back`, in the order they are sent back)."""
    a, s, e = work.attention, work.shared, work.experts
    if mode == "node":
        return Turns((a, s, 0.0, e, 0.0), (counts, hops[0], hops[1], back[1], back[0]))
    if capacity:
        return Turns((a, s + e), (hops[0], back[0]))
    return Turns((a, s, e), (counts, hops[0], back[0]))


def backward_turns(mode: str, capacity: bool, combine: list, rows: list, work: Segments) -> Turns:
    """The backward's layer: the combine's reverse (`combine`, a hop each, in float8 with float8.combine_gradient),
    then the rows' (`rows`, in the compute dtype)."""
    a, s, e = work.attention, work.shared, work.experts
    if mode == "node":
        return Turns((a, 0.0, e, 0.0, s), (combine[0], combine[1], rows[1], rows[0], 0.0))
    if capacity:
        return Turns((a + s, e), (combine[0], rows[0]))
    return Turns((a, e, s), (combine[0], rows[0], 0.0))


def exposed_at_phase(forward: Turns, backward: Turns, phase: int) -> tuple[float, float]:
    """Seconds of (the forward's, the backward's) all-to-alls of one layer left exposed at `phase`: each post less
    the other side's segment it travels beside (the module docstring)."""
    n = len(forward.posts)
    ahead = sum(max(0.0, post - backward.segments[(i - phase) % n]) for i, post in enumerate(forward.posts))
    behind = sum(max(0.0, post - forward.segments[(k + phase + 1) % n]) for k, post in enumerate(backward.posts))
    return ahead, behind
