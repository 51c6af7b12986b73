"""Two micro-batches in flight (parallel.ep_overlap with one pipeline stage and FSDP that keeps the blocks
gathered: zero1, zero2 or no FSDP): their forwards run in two threads that take turns, one holding the turn at a
time, and hand it over right after posting an expert all-to-all (parallel/ep_exchange.py), so that while one
micro-batch's rows travel the other computes; then one backward of both, in which the autograd engine interleaves
their nodes in the reverse of the order they were made, so each reverse all-to-all travels beside the other
micro-batch's backward (ep_exchange.py's post/wait pair). This is DualPipe's pairing of two micro-batches
(DeepSeek-V3, arXiv 2412.19437 section 3.2.1) on one stage, with the second micro-batch's forward in place of the
other one's backward.

One thread runs at a time and each hands the turn over at the same points on every rank, so the ranks issue their
collectives in the same order; a block's hooks see the two forwards one after the other: a forward waits at a
block's door (`enter`) while the other is inside it, which keeps the second forward one block behind the first and
gives FSDP and activation checkpointing each block's calls whole. Each forward keeps its own thread's autograd,
autocast and checkpointing state; the recompute of a checkpointed block finds its route by the block's input
(expert_parallel.py), whichever micro-batch's backward comes first.

Across pipeline stages (DualPipeV's OVERLAP_F_B, parallel/pipeline_pairing.py) a Pair runs one micro-batch's
forward beside another's backward: `Pair(backward_side=True)`. Its backward side is whatever runs inside an autograd
graph task while the pair is active, on any thread (on a GPU the autograd engine runs a backward's device nodes on its
own thread, not the caller's), and hands the turn over as often a layer as the forward does: after the combine's
reverse all-to-all, once after the two reverses of the rows and their routing (ep_exchange.py), and where the
forward exchanged its counts (`turn_in_backward`); a recomputed forward's all-to-alls hand it over too. The two
sides alternate, so the start sets which segment of one side each post of the other travels beside; the backward
side hands the turn straight back `lead` times before it starts (parallel.ep_pairing_phase, which the planner
chooses: planner/pairing.py).
"""

from __future__ import annotations

import threading

import torch

_LOCAL = threading.local()  # .pair and .side of a thread of a Pair
_ACTIVE: list = []  # the forward-and-backward Pair running now, if any (one at a time per process)


class Pair:
    """Two forwards taking turns (the module docstring): `run(first, second)` -> their results."""

    def __init__(self, backward_side: bool = False, lead: int = 0):
        """`backward_side`: the second runs a backward (the module docstring); `lead`: the turns it hands straight
        back before it starts (parallel.ep_pairing_phase: which segment of the other side each post meets)."""
        self.turns = threading.Condition()
        self.turn, self.running, self.inside = 0, [True, True], [None, None]
        self.backward_side, self.lead = backward_side, lead
        self.handovers = 0  # turns handed to a side still running (the overlap that took place)

    def run(self, first, second) -> list:
        if self.backward_side:
            _ACTIVE.append(self)
        try:
            return self._run(first, second)
        finally:
            if self.backward_side:
                _ACTIVE.remove(self)

    def _run(self, first, second) -> list:
        results = [None, None]

        def body(side: int, work) -> None:
            _LOCAL.pair, _LOCAL.side = self, side
            with self.turns:
                self.turns.wait_for(lambda: self.turn == side)
            try:
                for _ in range(self.lead if side else 0):
                    self.hand_over(side)
                results[side] = work()
            finally:
                _LOCAL.pair = None
                with self.turns:
                    self.running[side], self.turn = False, 1 - side
                    self.turns.notify_all()

        in_threads([lambda side=side, work=work: body(side, work) for side, work in enumerate((first, second))])
        return results

    def hand_over(self, side: int) -> None:
        """The turn to the other forward (while it runs), and back when it hands it over."""
        with self.turns:
            if not self.running[1 - side]:
                return
            self.turn, self.handovers = 1 - side, self.handovers + 1
            self.turns.notify_all()
            self.turns.wait_for(lambda: self.turn == side)


def in_threads(bodies) -> None:
    """Each of `bodies` in a thread of its own, all joined; the first error any raised is raised here."""
    errors = []

    def guarded(body) -> None:
        try:
            body()
        except BaseException as error:  # noqa: BLE001 (raised below, in the caller's thread)
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(body,)) for body in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def pairs_micro_batches(layout) -> bool:
    """Whether parallel.ep_overlap pairs micro-batches in this layout (the module docstring): one pipeline stage,
    two micro-batches a step at least, and blocks FSDP keeps gathered (zero3 reshards each block after its forward,
    under the other forward); otherwise the overlap stays inside each MoE layer (expert_parallel.py)."""
    gathered = not layout.fsdp_enabled or layout.dp_shard_mode != "zero3"
    return layout.ep_overlap and layout.ep > 1 and layout.pp == 1 and layout.microbatches > 1 and gathered


def _side() -> tuple[Pair, int] | None:
    """(the Pair, its side) of what runs now, or None outside one: the backward side of an active forward-and-backward
    pair by its graph task (any thread), else by thread."""
    if _ACTIVE and torch._C._current_graph_task_id() != -1:
        return _ACTIVE[0], 1
    pair = getattr(_LOCAL, "pair", None)
    return (pair, _LOCAL.side) if pair is not None else None


def paired() -> bool:
    """Whether what runs now is one side of a Pair."""
    return _side() is not None


def after_post() -> None:
    """Called right after an expert all-to-all is posted: the other side's turn, if there is one."""
    if (found := _side()) is not None:
        found[0].hand_over(found[1])


class _TurnInBackward(torch.autograd.Function):
    """The identity; its backward hands the turn over, as `after_post` does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        after_post()
        return grad


def turn_in_backward(x: torch.Tensor) -> torch.Tensor:
    """`x`, whose gradient, once complete, hands the backward side's turn over: where a forward hands over without
    a backward counterpart (after the counts it exchanges, which have no gradient), so that a backward hands over
    as often a layer as the forward it is paired with. Otherwise the side with fewer turns finishes first and
    leaves the other's last all-to-alls with nothing beside them, or the two fall into step with one side's posts
    beside the other's shortest segments."""
    return _TurnInBackward.apply(x)


def enter(block, *_args, **_kwargs) -> None:
    """A block's first forward pre-hook: wait (handing the turn over) while the other forward is inside it."""
    if (found := _side()) is None:
        return
    pair, side = found
    while pair.running[1 - side] and pair.inside[1 - side] is block:
        pair.hand_over(side)
    pair.inside[side] = block


def leave(block, *_args, **_kwargs) -> None:
    """A block's last forward hook."""
    if (found := _side()) is not None:
        found[0].inside[found[1]] = None


def apply_pairing_gates(model) -> None:
    """The doors of every block (the trunk's and any multi-token prediction module's), outside every other hook
    (FSDP's included): call after parallelize's last step."""
    for block in model.blocks().values():
        block.register_forward_pre_hook(enter, prepend=True)
        block.register_forward_hook(leave)
