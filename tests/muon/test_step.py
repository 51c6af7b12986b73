"""Muon in the trainer's step: a non-finite step changes no weight and no state; `trillion estimate` counts the
optimizer state Muon really keeps."""

import contextlib

import torch

from tests.muon.harness import MODELS
from trillion.models import Transformer
from trillion.parallel.forward_backward import MicroBatchLoop
from trillion.parallel.muon.matrices import hidden_matrices
from trillion.trainer.config.schema import Optimizer
from trillion.trainer.optim import build_optimizer
from trillion.trainer.resilience import NonFiniteGuard, RunCounters
from trillion.trainer.step import train_step
from trillion.trainer.tools.estimate.rank import state_bytes


def _setup():
    args = MODELS["moe"]
    model = Transformer(args)
    model.init_weights(0)
    optimizer = build_optimizer(model, Optimizer(name="muon", implementation="foreach"), "cpu")
    tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    return args, model, optimizer, [(tokens[:, :-1], tokens[:, 1:])]


def _step(model, optimizer, batch, clip=None, guard=None):
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    extra = {"clip": clip} if clip else {}
    train_step(MicroBatchLoop(model), batch, optimizer, scaler, contextlib.nullcontext(), 1.0, guard=guard, **extra)


def test_a_non_finite_step_changes_nothing_and_the_next_one_trains():
    _, model, optimizer, batch = _setup()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    guard = NonFiniteGuard(10, RunCounters())
    _step(model, optimizer, batch, clip=lambda *_: torch.tensor(float("nan")), guard=guard)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()) and not optimizer.state
    _step(model, optimizer, batch, guard=guard)
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.ndim >= 2)
    assert any("momentum_buffer" in s for s in optimizer.state.values())


def test_the_estimate_counts_the_state_muon_keeps():
    args, model, optimizer, batch = _setup()
    _step(model, optimizer, batch)
    kept = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    assert state_bytes([model], frozenset(hidden_matrices(args))).optimizer == kept
