"""Optimizer groups, LR schedules, and gradient accumulation that changes nothing."""

import contextlib
import dataclasses

import pytest
import torch

from trillion.models import PRESETS, Transformer
from trillion.parallel.forward_backward import MicroBatchLoop
from trillion.trainer.config.schema import LRSchedule, Optimizer
from trillion.trainer.optim import build_lr_scheduler, build_optimizer, lr_multiplier
from trillion.trainer.step import train_step


def tiny_model(seed=0):
    model = Transformer(dataclasses.replace(PRESETS["debug-gpt"], n_layers=2, dim=64, n_heads=4, max_seq_len=64))
    model.init_weights(seed)
    return model


def test_no_weight_decay_on_norms_biases_and_embeddings():
    model = tiny_model()
    decay, no_decay = build_optimizer(model, Optimizer(weight_decay=0.1), "cpu").param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decayed and all(n.endswith("weight") and "norm" not in n and "embeddings" not in n for n in decayed)
    assert {names[id(p)] for p in no_decay["params"]} >= {
        "tok_embeddings.weight",
        "pos_embeddings.weight",
        "norm.weight",
        "norm.bias",
    }


@pytest.mark.parametrize("name", ["cosine", "linear", "wsd", "constant"])
def test_schedules_warm_up_then_end_where_configured(name):
    cfg = LRSchedule(name=name, warmup_steps=10, min_lr_ratio=0.1, decay_ratio=0.2)
    values = [lr_multiplier(s, 100, cfg) for s in range(100)]
    assert all(a < b for a, b in zip(values[:10], values[1:11]))  # rising through warmup
    assert max(values) == pytest.approx(1.0, abs=0.01)
    end = {"constant": 1.0}.get(name, 0.1)
    assert values[-1] == pytest.approx(end, abs=0.02)
    if name == "wsd":
        assert values[10:80] == [1.0] * 70  # stable until the last 20% of the steps


def test_scheduler_drives_the_optimizer():
    model = tiny_model()
    optimizer = build_optimizer(model, Optimizer(lr=1.0), "cpu")
    scheduler = build_lr_scheduler(optimizer, LRSchedule(name="linear", warmup_steps=0, min_lr_ratio=0.0), 10)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1 - 5 / 9)  # update 5 of 0..9, reaching 0 at update 9


def test_gradient_accumulation_gives_the_same_update():
    """1 micro-batch of 8 and 4 micro-batches of 2: same loss, same weights after the step (fp32).

    Plain SGD with lr 1 makes the weight change the clipped gradient itself; Adam's first step
    (g / |g|) would magnify float noise in near-zero gradients."""
    tokens = torch.randint(0, 320, (8, 33), generator=torch.Generator().manual_seed(1))
    tokens[:3, -5:] = -100  # unequal target counts per micro-batch: a mean of means would differ
    inputs, labels = tokens[:, :-1].clamp(min=0), tokens[:, 1:]
    results = []
    for micro in (8, 2):
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        batches = list(zip(inputs.split(micro), labels.split(micro)))
        loss, grad_norm = train_step(
            MicroBatchLoop(model), batches, optimizer, scaler, contextlib.nullcontext(), max_grad_norm=0.5
        )
        results.append((loss, grad_norm, [p.detach().clone() for p in model.parameters()]))
    (loss_a, norm_a, params_a), (loss_b, norm_b, params_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norm_a, norm_b, rtol=1e-5, atol=1e-6)
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a, p) for a, p in zip(params_a, tiny_model().parameters())), (
        "the step must change weights"
    )
