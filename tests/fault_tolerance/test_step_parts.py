"""Parts of the fault-tolerant step, each against a reference written here, in one process and without a
Lighthouse (the multi-group runs: test_kill_rejoin.py, test_semi_sync.py): which rows of every global batch each
data-parallel rank of each replica group reads (docs/checkpoints.md's rule, several ranks a group); an attempt
that does not commit leaves an MoE layer's balancing bias where it was; DiLoCo's outer step is Nesterov's
(the DiLoCo paper's outer optimizer, written out in float64)."""

import contextlib
import dataclasses

import pytest
import torch

from tests.moe.harness import BASE
from trillion.models import Transformer
from trillion.models.step_hooks import find_step_hooks
from trillion.trainer.config.fault_sections import FaultTolerance
from trillion.trainer.data.loader import DataLoader


class Numbered:
    """Windows that say which they are: window i holds i in every position."""

    def __init__(self):
        self.next = 0

    def next_windows(self, count: int) -> torch.Tensor:
        rows = torch.arange(self.next, self.next + count)[:, None].expand(count, 5)
        self.next += count
        return rows


@pytest.mark.parametrize(("groups", "ranks"), [(2, 2), (3, 2), (2, 4)])
def test_each_group_reads_its_share_of_every_batch_split_by_its_own_ranks(groups, ranks):
    """Group g trains the g-th share of each global batch (global_batch_size / group_size sequences), its
    data-parallel rank d the d-th part of that share; together the ranks of all groups read each window once."""
    batch = 4 * groups * ranks
    share = batch // groups
    for g in range(groups):
        for d in range(ranks):
            rank, world = FaultTolerance(enabled=True, replica_id=g, group_size=groups).data_rank(d, ranks)
            loader = DataLoader(Numbered(), batch, micro_batch_size=1, dp_rank=rank, dp_size=world)
            rows = [int(inputs[0, 0]) for inputs, _ in loader.next_batch()]
            first = g * share + d * (share // ranks)
            assert rows == list(range(first, first + share // ranks)), (g, d, rows)


def _moe_model():
    moe = dataclasses.replace(BASE.moe, bias_update_rate=1e-2)
    model = Transformer(dataclasses.replace(BASE, n_layers=2, moe=moe))
    model.init_weights(0)
    return model


def _biases(model) -> list[torch.Tensor]:
    return [m.expert_bias.clone() for m in model.modules() if getattr(m, "expert_bias", None) is not None]


def test_an_attempt_that_does_not_commit_leaves_the_balancing_bias_where_it_was():
    """The bias after a discarded attempt is the bias before it (nothing of that attempt happened); the same
    attempt committed moves it (the tallies do reach it)."""
    from trillion.trainer.fault_tolerance.step import CommitGate, Discardable

    model = _moe_model()
    tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(0))
    before = _biases(model)
    assert before, "the model has no balancing bias"
    for committed in (False, True):
        gate = CommitGate(manager=None, guard=None)
        gate.committed = committed
        hooks = [Discardable(h, gate) for h in find_step_hooks(model)]
        for hook in hooks:
            hook.before_step(torch.tensor(1.0 / tokens[:, 1:].numel()))
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        for hook in hooks:
            hook.after_step(lambda tensor: tensor)  # one group alone: the sum over ranks is the tally itself
        after = _biases(model)
        if committed:
            assert any(not torch.equal(a, b) for a, b in zip(after, before)), "a committed step moves the bias"
        else:
            assert all(torch.equal(a, b) for a, b in zip(after, before)), "a discarded attempt moved the bias"


def test_diloco_takes_an_outer_nesterov_step(monkeypatch):
    """The outer optimizer handed to torchft's DiLoCo, stepped on two pseudo-gradients (DiLoCo sets each as the
    parameters' gradient), against Nesterov momentum written out: buf = m buf + g; x -= lr (g + m buf)."""
    pytest.importorskip("torchft")
    from torchft import local_sgd

    from trillion.trainer.fault_tolerance.semi_sync import SemiSynchronous

    handed = {}

    class Recorder(contextlib.nullcontext):
        def __init__(self, manager, models, inner, outer, sync_every):
            super().__init__()
            handed["outer"], handed["sync_every"] = outer, sync_every

    monkeypatch.setattr(local_sgd, "DiLoCo", Recorder)
    cfg = FaultTolerance(enabled=True, semi_sync_method="diloco", sync_steps=3, outer_lr=0.7, outer_momentum=0.9)
    model = torch.nn.Linear(3, 2, dtype=torch.float64)
    start = [p.detach().clone() for p in model.parameters()]
    SemiSynchronous(cfg, None, model, torch.optim.SGD(model.parameters(), lr=0.1)).close()
    assert handed["sync_every"] == 3
    generator = torch.Generator().manual_seed(0)
    pseudo = [[torch.randn(p.shape, dtype=torch.float64, generator=generator) for p in start] for _ in range(2)]
    expected, buffers = [p.clone() for p in start], [torch.zeros_like(p) for p in start]
    for gradients in pseudo:
        for p, g in zip(model.parameters(), gradients):
            p.grad = g.clone()
        handed["outer"].step()
        for x, buf, g in zip(expected, buffers, gradients):
            buf.mul_(0.9).add_(g)
            x.sub_(0.7 * (g + 0.9 * buf))
    for p, x in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), x, rtol=1e-12, atol=1e-12)
