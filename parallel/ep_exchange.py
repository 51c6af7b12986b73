"""The all-to-alls of expert parallelism (parallel/expert_parallel.py): rows posted to the members of one process
group with uneven splits, started and finished apart so that compute can run while they travel, in the forward
and in the backward; counted where they are posted; optionally completed late (latency injection).

`Exchange.rows(x, send, recv)` posts the all-to-all and returns a `Pending`; `.wait()` gives the received rows.
With a `wire` (ep_routing.Wire: float8 dispatch's) the rows travel encoded and are decoded on arrival; their
gradient travels back in the compute dtype, straight through the encoding. Autograd sees two nodes: the post, and
the wait. The wait's backward posts the reverse all-to-all of the gradient
and returns at once; the post's backward waits for it. So whatever the forward computed between the post and the
wait (the shared experts, the other chunk's experts) has its backward run between the two in the backward too: the
autograd engine runs a node's backward after every node created later that feeds it, and in reverse creation order
among the rest. Nothing else reads the buffers in flight.

Counting (`Exchange.traffic`, a Traffic): the bytes each post sends to every other member, split by whether that
member sits on this rank's node (ranks_per_node consecutive ranks) or across the network; forward posts only (the
backward sends the same bytes back), but for a gradient sent back in a wire form of its own (`back_wire`:
float8.combine_gradient's, "combine gradient"). Latency injection (`Exchange.delay_s` > 0, the benchmarks'): each post
completes no earlier than that many seconds after it was posted; its wait sleeps to that deadline, so the delay costs
no CPU (nor a thread a post, whose start-up the machine would charge to both of the benchmarks' arms), and compute that
runs between the post and the wait hides it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trillion.parallel.ep_routing import Wire
from trillion.parallel.expert_overlap import after_post

STAGES = ("inter-node", "intra-node")


@dataclass
class Traffic:
    """Bytes and rows one rank's forward posts sent to other ranks, by (what, stage): what is a label the dispatch
    gives ("dispatch": rows to the experts, "routing": their weights and expert ids beside them, "combine": the
    outputs back, "counts": split sizes);
    stage is one of STAGES. `posted_rows`: by what, every row posted, the rank's own share included. `tokens`: the
    MoE layers' input tokens in those forwards."""

    sent_bytes: dict = field(default_factory=dict)
    sent_rows: dict = field(default_factory=dict)
    posted_rows: dict = field(default_factory=dict)
    tokens: int = 0

    def add(self, what: str, stage: str, rows: int, nbytes: int) -> None:
        self.sent_bytes[what, stage] = self.sent_bytes.get((what, stage), 0) + nbytes
        self.sent_rows[what, stage] = self.sent_rows.get((what, stage), 0) + rows

    def per_token(self, what: str, stage: str, rows: bool = False) -> float:
        table = self.sent_rows if rows else self.sent_bytes
        return table.get((what, stage), 0) / max(self.tokens, 1)


class _Late:
    """A posted collective that completes no earlier than `delay` seconds after its post (its wait sleeps to that
    deadline: no thread, no CPU); the time its waits block is added to `exchange.blocked_s` (the communication left
    exposed, as the benchmarks read it)."""

    def __init__(self, work, delay: float, exchange: Exchange):
        self.work, self.due, self.exchange = work, time.perf_counter() + delay, exchange

    def wait(self) -> None:
        start = time.perf_counter()
        self.work.wait()
        time.sleep(max(0.0, self.due - time.perf_counter()))
        self.exchange.blocked_s += time.perf_counter() - start


class Exchange:
    """All-to-alls among the members of `mesh` (a 1-D DeviceMesh); `ranks_per_node` places them on nodes. A
    subclass may move the rows otherwise (`_all_to_all`): the byte count stays where the rows are posted."""

    def __init__(self, mesh, ranks_per_node: int):
        self.group = mesh.get_group()
        self.place(mesh.get_local_rank(), mesh.mesh.flatten().tolist(), ranks_per_node)

    def place(self, me: int, ranks: list[int], ranks_per_node: int) -> None:
        """This rank's member index `me` among the members' global `ranks`, on nodes of `ranks_per_node`."""
        self.size, self.me = len(ranks), me
        nodes = [rank // max(ranks_per_node, 1) for rank in ranks]
        self.stage_of = [STAGES[nodes[j] == nodes[me]] for j in range(self.size)]
        self.traffic: Traffic | None = None
        self.delay_s, self.blocked_s = 0.0, 0.0

    def post(self, x: torch.Tensor, send: list[int], recv: list[int], what: str = "", hand_over: bool = True):
        """(the receive buffer, the work) of an all-to-all sending send[j] rows of `x` to member j; then, with
        `hand_over`, a paired micro-batch's turn while they travel (expert_overlap.py)."""
        x = x.contiguous()
        out = x.new_empty((sum(recv), *x.shape[1:]))
        if self.traffic is not None and what:
            self.traffic.posted_rows[what] = self.traffic.posted_rows.get(what, 0) + sum(send)
            row_bytes = x.element_size() * x[0].numel() if x.shape[0] else 0
            for member, rows in enumerate(send):
                if member != self.me:
                    self.traffic.add(what, self.stage_of[member], rows, rows * row_bytes)
        work = self._all_to_all(out, x, recv, send)
        work = _Late(work, self.delay_s, self) if self.delay_s > 0 else work
        if hand_over:
            after_post()
        return out, work

    def _all_to_all(self, out: torch.Tensor, x: torch.Tensor, recv: list[int], send: list[int]):
        return dist.all_to_all_single(out, x, recv, send, group=self.group, async_op=True)

    def counts(self, counts: torch.Tensor) -> torch.Tensor:
        """An even all-to-all of a counts tensor (its chunks in member order), on the device, waited for at once:
        no turn handed over (ExpertDispatch.exchanges_counts says why)."""
        even = [counts.numel() // self.size] * self.size
        out, work = self.post(counts, even, even, "counts", hand_over=False)
        work.wait()
        return out

    def rows(
        self, x: torch.Tensor, send: list[int], recv: list[int], what: str = "", wire=None, beside=None, back_wire=None
    ) -> Pending:
        """`beside`: a Pending posted just before this one in the same turn (the dispatch's rows, beside which their
        routing travels): one turn handed over for the two, after the second post, forward and backward.
        `back_wire`: the gradient travels back in that wire form (float8.combine_gradient), counted as
        "<what> gradient"."""
        return Pending(self, x, send, recv, what, wire, beside, back_wire)


class Pending:
    """An all-to-all in flight: `wait()` returns the rows received (autograd: the module docstring)."""

    def __init__(
        self, exchange: Exchange, x: torch.Tensor, send, recv, what: str, wire=None, beside=None, back_wire=None
    ):
        self.box = _Box(exchange, send, recv, what, wire, back_wire)
        if beside is not None:
            self.box.partner, beside.box.partner = beside.box, self.box
        self.out = _Post.apply(x, self.box)

    def wait(self) -> torch.Tensor:
        return _Finish.apply(self.out, self.box)


@dataclass
class _Box:
    exchange: Exchange
    send: list[int]
    recv: list[int]
    what: str
    wire: Wire | None
    back_wire: Wire | None = None  # the gradient's form on the way back (None: the compute dtype)
    work: object = None
    arrived: torch.Tensor | None = None  # with a wire: the encoded rows received (the wait decodes them)
    row_shape: tuple = ()  # with a wire: (dim, dtype) of the rows sent, which the decoded rows take
    back_shape: tuple = ()  # with a back_wire: (dim, dtype) of the gradient, which the decoded gradient takes
    back: torch.Tensor | None = None  # the reverse all-to-all's buffer (the backward)
    back_work: object = None
    back_input: torch.Tensor | None = None  # kept alive while it travels
    partner: _Box | None = None  # the all-to-all posted in the same turn (Exchange.rows's `beside`)
    reversed: bool = False  # the reverse all-to-all has been posted


class _Post(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, box: _Box) -> torch.Tensor:
        """The receive buffer; with a wire an empty tensor that only links the wait to this post in autograd (the
        encoded buffer is not differentiable), the buffer kept in the box."""
        rows = x if box.wire is None else box.wire.encode(x)
        # the dispatch's rows are followed in the same turn by their routing (Exchange.rows's `beside`)
        out, box.work = box.exchange.post(rows, box.send, box.recv, box.what, hand_over=box.what != "dispatch")
        ctx.box = box
        if box.wire is None:
            return out
        box.arrived, box.row_shape = out, (x.shape[1], x.dtype)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        box = ctx.box
        box.back_work.wait()
        back, box.back, box.back_input, box.back_work = box.back, None, None, None
        if box.back_wire is not None:
            back = box.back_wire.decode(back, *box.back_shape)
        return back, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, box: _Box) -> torch.Tensor:
        box.work.wait()
        box.work = None  # a finished work still holds its buffers; the graph keeps the box until the backward
        ctx.box = box
        if box.wire is None:
            return out.view_as(out)
        rows, box.arrived = box.wire.decode(box.arrived, *box.row_shape), None
        return rows

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        box = ctx.box
        box.back_input = grad.contiguous()
        what = ""  # the reverse sends the forward's bytes back: counted once, forward
        if box.back_wire is not None:
            box.back_shape, what = (grad.shape[1], grad.dtype), f"{box.what} gradient"
            box.back_input = box.back_wire.encode(box.back_input)
        last = box.partner is None or box.partner.reversed  # the turn's second reverse post hands it over
        box.back, box.back_work = box.exchange.post(box.back_input, box.recv, box.send, what, hand_over=last)
        box.reversed = True
        return (grad if box.wire is None else grad.new_zeros(0)), None
