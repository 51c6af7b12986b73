"""Muon in one process against torch's own: torch.optim.Muon (same hyperparameters, adjust_lr_fn
"match_rms_adamw") on every hidden matrix (chosen here by Moonlight's rule, not by the code under test),
torch.optim.AdamW on the rest, in float64 to 1e-10 over 10 steps.

torch.optim.Muon casts each update to bfloat16 before Newton-Schulz (torch/optim/_muon.py,
`_zeropower_via_newtonschulz`: `grad.bfloat16()`), which would make any float64 comparison a comparison of bf16
rounding; while the reference steps, that one cast is lifted (`Tensor.bfloat16` returns a copy in the tensor's
own dtype), so the float64 run measures torch's algorithm. An expert stack (E, in, out), which torch's Muon
refuses (2-D only), is stepped there as E separate 2-D parameters holding its slices."""

import dataclasses

import pytest
import torch

from tests.moe.harness import MODELS as MOE_MODELS
from trillion.models import Transformer
from trillion.parallel.muon.matrices import hidden_matrices
from trillion.trainer.config.schema import Optimizer
from trillion.trainer.optim import build_optimizer

STEPS, LR, DECAY, SEED = 10, 2e-2, 0.1, 3
# debug-moe's kind (a dense block, then routed expert stacks, their gate and a shared expert) and debug-deepseek's
# (latent attention's low-rank projections, group-limited routing), at the expert-parallel tests' small sizes
MODELS = {name: dataclasses.replace(MOE_MODELS[kind], n_layers=2) for name, kind in (("moe", "gqa"), ("mla", "mla"))}


def _model(args) -> torch.nn.Module:
    model = Transformer(dataclasses.replace(args, vocab_size=128, max_seq_len=32)).double()
    model.init_weights(SEED)
    return model


def _batches():
    generator = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, 128, (2, 17), generator=generator) for _ in range(STEPS)]


def _loss(model, tokens) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def moonlight_matrices(model) -> set[str]:
    """Which parameters Muon takes, by Moonlight's and Kimi K2's rule, written here apart from the code under test
    (parallel/muon/matrices.py reads the parts' declarations): every weight of two or more dimensions (an expert
    stack's E matrices, the router's gate included) but the embedding table and the output head."""
    head = {"tok_embeddings.weight", "output.weight"}
    return {name for name, p in model.named_parameters() if p.ndim >= 2 and name not in head}


class TorchReference:
    """torch.optim.Muon on the model's hidden matrices (an expert stack as E 2-D proxies), AdamW on the rest."""

    def __init__(self, model, matrices: set[str]):
        params = dict(model.named_parameters())
        self.model, self.stacks = model, {n: params[n] for n in matrices if params[n].ndim == 3}
        self.proxies = {
            n: [torch.nn.Parameter(p.detach()[e].clone()) for e in range(p.shape[0])] for n, p in self.stacks.items()
        }
        flat = [p for n, p in params.items() if n in matrices and n not in self.stacks]
        flat += [q for proxies in self.proxies.values() for q in proxies]
        self.muon = torch.optim.Muon(flat, lr=LR, weight_decay=DECAY, adjust_lr_fn="match_rms_adamw")
        rest = [p for n, p in params.items() if n not in matrices]
        decay = [p for p in rest if p.ndim >= 2 and p is not model.tok_embeddings.weight]
        self.adamw = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": DECAY},
                {"params": [p for p in rest if all(p is not d for d in decay)], "weight_decay": 0.0},
            ],
            lr=LR,
            betas=(0.9, 0.95),
            eps=1e-8,
            foreach=False,
        )

    def step(self, monkeypatch) -> None:
        for name, stack in self.stacks.items():
            for e, proxy in enumerate(self.proxies[name]):
                proxy.grad = stack.grad[e].clone()
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "bfloat16", lambda tensor, *a, **k: tensor.clone())
            self.muon.step()
        self.adamw.step()
        with torch.no_grad():
            for name, stack in self.stacks.items():
                stack.copy_(torch.stack([proxy.detach() for proxy in self.proxies[name]]))


@pytest.mark.parametrize("name", list(MODELS))
def test_muon_equals_torch_muon_in_float64(name, monkeypatch):
    args = MODELS[name]
    ours, theirs = _model(args), _model(args)
    matrices = hidden_matrices(ours.args)
    cfg = Optimizer(name="muon", lr=LR, weight_decay=DECAY, implementation="for-loop", newton_schulz_dtype="float32")
    optimizer = build_optimizer(ours, cfg, "cpu")
    reference = TorchReference(theirs, moonlight_matrices(theirs))
    for tokens in _batches():
        for model in (ours, theirs):
            model.zero_grad(set_to_none=True)
            _loss(model, tokens).backward()
        optimizer.step()
        reference.step(monkeypatch)
    assert {n for n, _ in ours.named_parameters()} & set(matrices) == moonlight_matrices(ours), "other matrices"
    start = dict(_model(args).named_parameters())
    for (n, mine), (_, want) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert not torch.equal(mine, start[n]), f"{n} never moved"
        torch.testing.assert_close(mine, want, rtol=1e-10, atol=1e-10, msg=lambda m, n=n: f"{n}: {m}")
