"""The exposed share of a sublayer's TP collectives when they run beside its GEMMs, priced from the mechanism: the
pieces each collective is cut into, each piece's GEMM at its own (smaller) shape on the device's GEMM curve, and
each piece's transfer at the link's bandwidth and latency (timing.collective_time), scheduled as the trainer runs
them. No discount: what is hidden is what the schedule leaves of each transfer behind the GEMMs beside it.

Two mechanisms, for the HEADS parts (attention, dense MLP: parallel/tp_overlap.py's reach; an MoE layer's and latent
attention's collectives stay exposed, as DTensor runs them):
- the chunked overlap (parallel.tp_overlap = N, tp_overlap.py): an all-gather in N pieces posted at once, the column
  GEMMs on this rank's own rows first, then each piece's rows from the others as it arrives; the row GEMM in N
  pieces, each piece's reduce-scatter posted when its GEMM is done. Backward: the column linears' input gradient in
  N pieces, each reduce-scattered as it is made, with the weight gradients (over the whole sequence) after them; the
  row linear's output gradient all-gathered in N pieces beside its input gradient, own rows first.
- async TP (parallel.async_tp, torch's fused_all_gather_matmul / fused_matmul_reduce_scatter: async_tp.py): one
  step per other rank (tp - 1 pieces, each moving one rank's share of the whole collective's time), own rows first
  for the all-gather, own rows last for the reduce-scatter (their GEMM hides the last step).

A transfer piece of the chunked overlap is a collective of 1/N of the bytes (its latency paid N times); the pieces
travel one after another on the link. Not modelled (named where rows are checked): the GEMMs' slowdown from sharing
the device with the transfers (NCCL's kernels take SMs; torch's async TP and Megatron's ring exchange move the bytes
with copy engines).
"""

from dataclasses import dataclass

from trillion.parallel.planner.timing import _gemm


@dataclass(frozen=True)
class Hiding:
    """How a HEADS sublayer's collectives run beside its GEMMs: `pieces` per collective; `own_last`: the
    reduce-scatter's own rows are computed last, with no transfer after them (async TP's per-rank steps)."""

    pieces: int
    own_last: bool = False


def hiding_of(layout) -> Hiding | None:
    """The mechanism `layout` runs (None: DTensor's collectives, exposed)."""
    if layout.tp <= 1:
        return None
    if layout.async_tp:
        return Hiding(layout.tp - 1, own_last=True)
    return Hiding(layout.tp_overlap) if layout.tp_overlap else None


def _gemms(hw, rows: float, shapes) -> float:
    """Seconds of the GEMMs `shapes` ((k, n, low-precision recipe or None) each) over `rows` rows."""
    return sum(_gemm(hw, max(1, round(rows)), k, n, recipe) for k, n, recipe in shapes)


def _piece_seconds(hiding: Hiding, whole: float, piece: float) -> float:
    """One transfer piece: the chunked overlap's is a collective of its own (`piece`, priced on its bytes); async TP's
    a step of the whole collective's time (`whole` / (tp - 1))."""
    return whole / hiding.pieces if hiding.own_last else piece


def gather_exposed(hw, hiding: Hiding, tp: int, rows: int, shapes, whole: float, piece: float) -> float:
    """Seconds an all-gather of `rows` rows (whole collective `whole`, one chunked piece `piece`) adds to the GEMMs
    `shapes` that read it, own rows first, each piece's rows as they arrive."""
    compute_end = _gemms(hw, rows / tp, shapes)
    arrived = 0.0
    for _ in range(hiding.pieces):
        arrived += _piece_seconds(hiding, whole, piece)
        compute_end = max(compute_end, arrived) + _gemms(hw, rows * (tp - 1) / tp / hiding.pieces, shapes)
    return max(0.0, compute_end - _gemms(hw, rows, shapes))


def scatter_exposed(
    hw, hiding: Hiding, tp: int, rows: int, shapes, whole: float, piece: float, after: float = 0.0
) -> float:
    """Seconds a reduce-scatter of the GEMMs `shapes` over `rows` rows adds, each piece's transfer posted when its
    GEMM is done; `after`: compute that does not wait for it (the weight gradients, in the backward)."""
    if hiding.own_last:
        pieces, share = [rows / tp] * hiding.pieces, _piece_seconds(hiding, whole, piece)
    else:
        pieces, share = [rows / hiding.pieces] * hiding.pieces, piece
    computed, link_free = 0.0, 0.0
    for rows_of_piece in pieces:
        computed += _gemms(hw, rows_of_piece, shapes)
        link_free = max(link_free, computed) + share
    if hiding.own_last:
        computed += _gemms(hw, rows / tp, shapes)  # this rank's own rows: nothing to send
    return max(0.0, max(computed + after, link_free) - _gemms(hw, rows, shapes) - after)


@dataclass(frozen=True)
class SublayerTP:
    """One sublayer's TP collectives' seconds: the whole all-gathers (forward: its input; backward: its output's
    gradient), its reduce-scatter, and each one's chunked piece (1/N of the bytes)."""

    gather_forward: float
    gather_backward: float
    scatter: float
    piece_gather_forward: float = 0.0
    piece_gather_backward: float = 0.0
    piece_scatter: float = 0.0

    def exposed(self, hw, hiding: Hiding | None, tp: int, rows: int, columns, row) -> tuple[float, float]:
        """(forward, backward) seconds exposed, with `columns` and `row` the sublayer's GEMM shapes on a rank."""
        if hiding is None or not columns or not row:
            return self.gather_forward + self.scatter, self.gather_backward + self.scatter
        forward = gather_exposed(hw, hiding, tp, rows, columns, self.gather_forward, self.piece_gather_forward)
        forward += scatter_exposed(hw, hiding, tp, rows, row, self.scatter, self.piece_scatter)
        weight_grads = _gemms(hw, rows, columns)  # the column linears' weight gradients, after their input's
        backward = scatter_exposed(hw, hiding, tp, rows, columns, self.scatter, self.piece_scatter, weight_grads)
        backward += gather_exposed(hw, hiding, tp, rows, row, self.gather_backward, self.piece_gather_backward)
        return forward, backward
