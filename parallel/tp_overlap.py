"""The chunked TP overlap (`parallel.tp_overlap` = N chunks): tensor parallelism's sequence-parallel all-gathers and
reduce-scatters run beside the GEMMs they feed, on every backend (NCCL, RCCL, gloo), eager.

A HEADS sublayer (grouped-query attention, the dense MLP: models/parts) under tensor parallelism all-gathers its
input from the sequence-parallel stream for its column linears (q, k, v; w1, w3) and reduce-scatters its row linear's
(wo; w2) partial sums back to the stream; the output head all-gathers the final norm's output the same way. DTensor
runs each as one collective the GEMM waits for. Here each rank's slice of the sequence (L positions) is cut into N
chunks of L / N, and:

- column GEMMs, forward: the N chunks' all-gathers are posted at once; the GEMMs start on this rank's own rows, which
  need no transfer, then run each chunk's rows from the other ranks as that chunk arrives. Backward: the input
  gradient is computed chunk by chunk (every rank's rows of chunk j) and each chunk's reduce-scatter is posted as soon
  as it is made, while the next chunk's GEMMs run; the weight gradients (one GEMM each, over the whole sequence, as
  without the overlap) run while the last ones travel.
- the row GEMM, forward: chunk by chunk, each chunk's reduce-scatter posted as soon as its GEMM is done. Backward:
  the output gradient's chunks all-gathered, the input gradient of this rank's rows first, then each chunk's as it
  arrives; then the weight gradient over the whole sequence.

So the exposed transfer is about one chunk's (the first to arrive after the own rows' GEMM, or the last posted),
where DTensor exposes all of it: planner/tp_overlap.py prices it from the same schedule. The numbers are those of
DTensor TP: the same GEMMs on the same rows, the weight gradients summed over the sequence in one GEMM.

How it is wired (tensor_parallel.py calls `overlap_sublayer` and `overlap_head` in place of the DTensor styles):
the linears' weights and biases are distributed as ColwiseParallel / RowwiseParallel would (column: rows of the
weight and the bias; row: columns of the weight, the bias replicated), so checkpoints, FSDP2 and the optimizer see
the same DTensors. A forward pre-hook on the sublayer runs `_GatherColumns` on the stream's local shard and every
column linear's local weight at once, and hands the sublayer the gathered input as a replicated DTensor (as
PrepareModuleInput does) carrying the column outputs; each column linear's forward returns its own from there
(the sublayer's code, unchanged, calls it with that input). The row linear's forward runs `_ScatterRow` and returns
the stream's DTensor. Both are autograd Functions over local tensors: DTensor in and out, as the styles.

Latency injection (`TpCollectives.delay_s`, the benchmark experiments/bench/tp_overlap.py): each collective
completes its share (a chunk's: 1/N) of the delay of its kind at the time it is posted (`delay_s["all_gather"]`,
`delay_s["reduce_scatter"]`: the benchmark sets them per sublayer and pass) later than it would have, and after the
one before it, as on a wire of fixed bandwidth whose transfer starts once every rank has posted; the time waits
block is summed in `blocked_s`, the part of it past the collective's own completion (the injected delay nothing
covered) in `late_s`. Its bookkeeping (a pooled thread noting each collective's completion) runs whenever
a delay is set, and with `instrumented` at a delay of 0 too: the step a delay is measured against pays the same.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

from trillion.models.parts.spec import COLUMN, ROW, Part

NOTING_THREADS = 16  # collectives of a tp group in flight at once, at most: a sublayer's chunks, both directions


class TpCollectives:
    """The tp group's asynchronous all-gathers and reduce-scatters of the stream, in `chunks` chunks per rank."""

    def __init__(self, tp_mesh, chunks: int):
        self.mesh, self.group, self.chunks = tp_mesh, tp_mesh.get_group(), chunks
        self.size, self.rank = tp_mesh.size(), tp_mesh.get_local_rank()
        self.delay_s = {"all_gather": 0.0, "reduce_scatter": 0.0}  # a whole collective's, injected (docstring)
        self.instrumented = False  # the injection's bookkeeping on, whatever the delay (docstring)
        self.blocked_s, self.late_s, self._free_at = 0.0, 0.0, 0.0
        self._notes: ThreadPoolExecutor | None = None  # threads that note when delayed collectives complete

    def all_gather(self, piece: torch.Tensor) -> _Posted:
        """Every rank's `piece`, stacked on a new first dimension."""
        out = piece.new_empty((self.size * piece.shape[0], *piece.shape[1:]))
        work = dist.all_gather_single(out, piece, group=self.group, async_op=True)
        return self._posted(out.view(self.size, *piece.shape), work, self.delay_s["all_gather"])

    def reduce_scatter(self, stacked: torch.Tensor) -> _Posted:
        """The sum over the ranks of `stacked[r]`, for this rank r."""
        out = stacked.new_empty(stacked.shape[1:])
        work = dist.reduce_scatter_single(out, stacked.flatten(0, 1), group=self.group, async_op=True)
        return self._posted(out, work, self.delay_s["reduce_scatter"])

    def _posted(self, out: torch.Tensor, work, delay_s: float) -> _Posted:
        injected = self.instrumented or delay_s > 0
        posted = _Posted(out, work, self, delay_s / self.chunks if injected else None)
        if injected:  # note when the collective itself is done (gloo's works have no future to ask)
            # by a thread of a pool (a new thread a post cost the step its start): gloo may finish two out of order
            self._notes = self._notes or ThreadPoolExecutor(NOTING_THREADS, thread_name_prefix="tp-overlap-arrivals")
            self._notes.submit(posted.arrived)
        return posted


class _Posted:
    """A collective in flight: `wait()` gives its output."""

    def __init__(self, out: torch.Tensor, work, owner: TpCollectives, delay_s: float | None):
        self.out, self.work, self.owner, self.delay_s, self.arrived_at = out, work, owner, delay_s, None

    def arrived(self) -> None:
        self.work.wait()
        self.arrived_at = time.perf_counter()

    def wait(self) -> torch.Tensor:
        start, owner = time.perf_counter(), self.owner
        self.work.wait()
        if self.delay_s is not None:  # its share of the wire, once it is done and the one before it is through
            done = max(self.arrived_at or time.perf_counter(), owner._free_at) + self.delay_s
            owner._free_at, late = done, done - time.perf_counter()
            if late > 0:
                time.sleep(late)
                owner.late_s += late
        owner.blocked_s += time.perf_counter() - start
        return self.out


def _chunk(t: torch.Tensor, chunks: int, j: int) -> torch.Tensor:
    """Chunk j of the sequence (dim 1) of a (batch, L, ...) tensor, contiguous."""
    size = t.shape[1] // chunks
    return t[:, j * size : (j + 1) * size].contiguous()


def _rows(t: torch.Tensor, tp: int, chunks: int, j: int) -> torch.Tensor:
    """Chunk j of every rank's slice of a (batch, tp * L, f) tensor, as (tp, batch, L / chunks, f)."""
    batch, seq, features = t.shape
    return t.view(batch, tp, chunks, seq // (tp * chunks), features)[:, :, j].transpose(0, 1)


def _in_order(own: torch.Tensor, pieces: list[torch.Tensor], tp: int, rank: int) -> torch.Tensor:
    """The whole sequence from this rank's block `own` and the others' chunks (pieces[j][p]: rank p's chunk j)."""
    blocks = []
    for p in range(tp):
        blocks += [own] if p == rank else [piece[p] for piece in pieces]
    return torch.cat(blocks, dim=1)


class _GatherColumns(torch.autograd.Function):
    """(x: this rank's (batch, L, h) slice of the stream; w0, b0, w1, b1, ...: the column linears' local weights and
    biases) -> (the gathered (batch, tp L, h) input, x_all @ w0^T + b0, ...), overlapped as the module docstring
    says."""

    @staticmethod
    def forward(ctx, comm: TpCollectives, x: torch.Tensor, *params):
        ctx.set_materialize_grads(False)
        tp, rank, chunks = comm.size, comm.rank, comm.chunks
        posted = [comm.all_gather(_chunk(x, chunks, j)) for j in range(chunks)]
        pairs = list(zip(params[0::2], params[1::2]))
        own = [F.linear(x, w, b) for w, b in pairs]  # this rank's rows: no transfer to wait for
        gathered, outputs = [], [[] for _ in pairs]
        for chunk in posted:
            received = chunk.wait()
            gathered.append(received)
            for out, (w, b) in zip(outputs, pairs):
                out.append({p: F.linear(received[p], w, b) for p in range(tp) if p != rank})
        full = _in_order(x, gathered, tp, rank)
        ys = [_in_order(mine, pieces, tp, rank) for mine, pieces in zip(own, outputs)]
        ctx.comm, ctx.biases = comm, [b is not None for _, b in pairs]
        ctx.save_for_backward(full, *params[0::2])
        return (full, *ys)

    @staticmethod
    def backward(ctx, grad_full, *grad_ys):
        comm = ctx.comm
        full, *weights = ctx.saved_tensors
        tp, chunks = comm.size, comm.chunks
        used = [(g, w) for g, w in zip(grad_ys, weights) if g is not None]
        posted = []
        for j in range(chunks):  # each chunk's input gradient, on its way while the next is computed
            stacked = sum(_rows(g, tp, chunks, j) @ w for g, w in used)
            if grad_full is not None:  # the gathered input read elsewhere too
                stacked = stacked + _rows(grad_full, tp, chunks, j)
            posted.append(comm.reduce_scatter(stacked.contiguous()))
        flat = full.reshape(-1, full.shape[-1])
        grads = []
        for g, has_bias in zip(grad_ys, ctx.biases):
            if g is None:
                grads += [None, None]
                continue
            g = g.reshape(-1, g.shape[-1])
            grads += [g.t() @ flat, g.sum(0) if has_bias else None]
        grad_x = torch.cat([chunk.wait() for chunk in posted], dim=1)
        return (None, grad_x, *grads)


class _ScatterRow(torch.autograd.Function):
    """(x: the row linear's (batch, tp L, f / tp) input on this rank, w, b) -> this rank's (batch, L, h) slice of
    x_all @ w_all^T + b (the partial sums reduce-scattered chunk by chunk, as the module docstring says)."""

    @staticmethod
    def forward(ctx, comm: TpCollectives, x: torch.Tensor, weight: torch.Tensor, bias):
        tp, chunks = comm.size, comm.chunks
        posted = [comm.reduce_scatter((_rows(x, tp, chunks, j) @ weight.t()).contiguous()) for j in range(chunks)]
        out = torch.cat([chunk.wait() for chunk in posted], dim=1)
        ctx.comm, ctx.has_bias = comm, bias is not None
        ctx.save_for_backward(x, weight)
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_out):
        comm = ctx.comm
        x, weight = ctx.saved_tensors
        tp, rank, chunks = comm.size, comm.rank, comm.chunks
        posted = [comm.all_gather(_chunk(grad_out, chunks, j)) for j in range(chunks)]
        own = grad_out @ weight  # this rank's rows first
        gathered, pieces = [], []
        for chunk in posted:
            received = chunk.wait()
            gathered.append(received)
            pieces.append({p: received[p] @ weight for p in range(tp) if p != rank})
        grad_x = _in_order(own, pieces, tp, rank)
        grad_all = _in_order(grad_out, gathered, tp, rank)
        flat = grad_all.reshape(-1, grad_all.shape[-1])
        grad_weight = flat.t() @ x.reshape(-1, x.shape[-1])
        return None, grad_x, grad_weight, flat.sum(0) if ctx.has_bias else None


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _distribute(linear: nn.Module, mesh, split: str) -> None:
    """The linear's parameters as DTensors, as ColwiseParallel (weight and bias by rows: `split` COLUMN) or
    RowwiseParallel (weight by columns, bias replicated: ROW) distribute them."""

    def partition(_name, module, device_mesh):
        for name, param in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if split == COLUMN else (Shard(1) if name == "weight" else Replicate())
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [placement])))

    distribute_module(linear, mesh, partition)


def _columns_of(name: str):
    """A column linear's forward under the overlap: its output, computed with its sublayer's gather."""

    def forward(gathered):
        return gathered.column_outputs[name]

    return forward


def _row_of(linear: nn.Module, comm: TpCollectives):
    @torch.compiler.disable  # under compile the collectives run eager between the block's compiled parts
    def forward(x):
        weight, bias = _local(linear.weight), _local(linear.bias) if linear.bias is not None else None
        out = _ScatterRow.apply(comm, _local(x), weight, bias)
        return DTensor.from_local(out, comm.mesh, [Shard(1)], run_check=False)

    forward.comm = comm
    return forward


def _gather(comm: TpCollectives, x: DTensor, columns: list[nn.Module]):
    """(the gathered input as a replicated DTensor, the column outputs as local tensors)."""
    assert isinstance(x, DTensor) and x.placements == (Shard(1),), "the stream reaches a sublayer sequence-parallel"
    params = [_local(t) if t is not None else None for linear in columns for t in (linear.weight, linear.bias)]
    full, *outputs = _GatherColumns.apply(comm, x.to_local(), *params)
    return DTensor.from_local(full, comm.mesh, [Replicate()], run_check=False), outputs


def overlap_sublayer(block: nn.Module, part: Part, comm: TpCollectives) -> None:
    """Shard a HEADS part of `block` over comm's mesh with its collectives overlapped (the module docstring)."""
    columns = [x.name for x in part.linears if x.split == COLUMN]
    for linear in part.linears:  # a replicated linear stays as the plain plan leaves it
        module = block.get_submodule(linear.name)
        if linear.split in (COLUMN, ROW):
            _distribute(module, comm.mesh, linear.split)
            module.forward = _columns_of(linear.name) if linear.split == COLUMN else _row_of(module, comm)
    modules = [block.get_submodule(name) for name in columns]

    @torch.compiler.disable
    def gather_input(_module, args, kwargs):
        gathered, outputs = _gather(comm, args[0], modules)
        gathered.column_outputs = dict(zip(columns, outputs))
        return (gathered, *args[1:]), kwargs

    block.get_submodule(part.module).register_forward_pre_hook(gather_input, with_kwargs=True)


def overlap_head(output: nn.Module, comm: TpCollectives) -> None:
    """The output projection column-wise over the vocabulary, its input gathered from the stream chunk by chunk;
    the logits a DTensor sharded on the vocabulary (for loss_parallel), as tensor_parallel.py's plain style."""
    _distribute(output, comm.mesh, COLUMN)

    @torch.compiler.disable
    def forward(x):
        _, (logits,) = _gather(comm, x, [output])
        return DTensor.from_local(logits, comm.mesh, [Shard(-1)], run_check=False)

    forward.comm = comm
    output.forward = forward


def collectives(model: nn.Module) -> set[TpCollectives]:
    """The TpCollectives of `model`'s overlapped linears (one per model: its delay and waits, for the benchmark)."""
    return {m.forward.comm for m in model.modules() if hasattr(m.__dict__.get("forward"), "comm")}
