"""DeepSeek-V3's multi-token prediction (models/mtp.py, the loss in parallel/forward_backward.py) against
the paper's section 2.2 written out here in float64 from the model's weights: the trunk, the MTP module
(enorm, hnorm, eh_proj, its block, its norm, the shared head) and both losses, values and every gradient
(the shared embedding and head included); evaluation uses the main head only."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.test_evaluate import corpus, evaluator  # noqa: F401 (corpus: the fixture evaluator reads)
from trillion.models import PRESETS, Transformer
from trillion.parallel.dims import ParallelDims
from trillion.parallel.forward_backward import MicroBatchLoop

ARGS = dataclasses.replace(
    PRESETS["debug"], n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=320, max_seq_len=16
)
MTP = dataclasses.replace(ARGS, mtp_modules=1, mtp_loss_weight=0.3)
EPS = ARGS.norm_eps


def build(args, dtype=torch.float64, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model.to(dtype)


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def rotate(x):
    """Rotary positions, half-split pairs (dimension j with j + head_dim / 2), position p at angle p / theta^(2j/d)."""
    seq, dim = x.shape[-2], x.shape[-1]
    angle = torch.arange(seq, dtype=torch.float64)[:, None] / ARGS.rope_theta ** (
        torch.arange(0, dim, 2, dtype=torch.float64) / dim
    )
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def block(x, w: dict, prefix: str):
    """A pre-norm block: causal grouped-query attention with rotary positions, then a SwiGLU feed-forward."""
    batch, seq, _ = x.shape
    heads, kv_heads, head_dim = ARGS.n_heads, ARGS.kv_heads, ARGS.dim // ARGS.n_heads

    def split(t, n):
        return t.view(batch, seq, n, head_dim).transpose(1, 2)

    a = rms_norm(x, w[prefix + "attention_norm.weight"])
    q = rotate(split(a @ w[prefix + "attention.wq.weight"].T, heads))
    k = rotate(split(a @ w[prefix + "attention.wk.weight"].T, kv_heads)).repeat_interleave(heads // kv_heads, dim=1)
    v = split(a @ w[prefix + "attention.wv.weight"].T, kv_heads).repeat_interleave(heads // kv_heads, dim=1)
    scores = (q @ k.transpose(-1, -2)) / head_dim**0.5
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, -1)
    x = x + attended @ w[prefix + "attention.wo.weight"].T
    f = rms_norm(x, w[prefix + "ffn_norm.weight"])
    hidden = F.silu(f @ w[prefix + "feed_forward.w1.weight"].T) * (f @ w[prefix + "feed_forward.w3.weight"].T)
    return x + hidden @ w[prefix + "feed_forward.w2.weight"].T


def reference_losses(w: dict, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(main loss, MTP loss), each the summed cross-entropy over the trunk's target count T (the paper's eq. 25)."""
    inputs, labels = window[:, :-1], window[:, 1:]
    embed, head = w["tok_embeddings.weight"], w["output.weight"]
    h = block(embed[inputs], w, "layers.0.")
    count = labels.numel()
    main = F.cross_entropy((rms_norm(h, w["norm.weight"]) @ head.T).flatten(0, 1), labels.flatten(), reduction="sum")
    # depth 1: position i sees the trunk's h_i and token i+1's embedding, and predicts token i+2
    joined = torch.cat(
        [rms_norm(embed[inputs[:, 1:]], w["mtp.1.enorm.weight"]), rms_norm(h[:, :-1], w["mtp.1.hnorm.weight"])], -1
    )
    h1 = block(joined @ w["mtp.1.eh_proj.weight"].T, w, "mtp.1.block.")
    logits = rms_norm(h1, w["mtp.1.norm.weight"]) @ head.T
    ahead = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
    return main / count, ahead / count


def test_mtp_loss_and_every_gradient_equal_a_float64_reference():
    model = build(MTP)
    window = torch.randint(0, ARGS.vocab_size, (3, 13), generator=torch.Generator().manual_seed(1))
    runner = MicroBatchLoop(model, mtp_weight=MTP.mtp_loss_weight)
    tokens = torch.tensor(3 * 12)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss = runner.forward_backward(
        [(window[:, :-1], window[:, 1:])], tokens, torch.autocast("cpu", enabled=False), scaler
    )
    weights = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    main, ahead = reference_losses(weights, window)
    (main + MTP.mtp_loss_weight * ahead).backward()
    # the logged losses (the runner sums them in float32): the trunk's, and the MTP modules' apart
    torch.testing.assert_close(loss.double(), main.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(runner.mtp_loss.double(), ahead.detach(), rtol=1e-6, atol=0)
    for name, param in model.named_parameters():  # token_loss takes the cross-entropy in float32: 1e-7 relative
        torch.testing.assert_close(param.grad, weights[name].grad, rtol=1e-5, atol=1e-8, msg=name)
    # the shared embedding and head take the MTP loss's gradient too: without it theirs differ
    model.zero_grad()
    MicroBatchLoop(model).forward_backward(
        [(window[:, :-1], window[:, 1:])], tokens, torch.autocast("cpu", enabled=False), scaler
    )
    for shared in ("tok_embeddings.weight", "output.weight"):
        difference = (model.get_parameter(shared).grad - weights[shared].grad).abs().max()
        assert difference > 1e-4 * weights[shared].grad.abs().max(), shared


def test_evaluation_and_generation_use_the_main_head_only(corpus):  # noqa: F811 (the fixture)
    found = evaluator(corpus, "--eval.held_out=0.3", "--eval.steps=2")
    with_mtp, without = build(MTP, torch.float32), build(ARGS, torch.float32)
    without.load_state_dict({k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")})
    dims, autocast = ParallelDims(world_size=1), torch.autocast("cpu", enabled=False)
    result = found.evaluate(with_mtp, dims, autocast)
    assert result == found.evaluate(without, dims, autocast)
    with torch.no_grad():
        for param in with_mtp.mtp.parameters():
            param.normal_()
    assert found.evaluate(with_mtp, dims, autocast) == result
    tokens = torch.randint(0, ARGS.vocab_size, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(with_mtp(tokens), without(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("modules", [1, 2])
def test_each_depth_predicts_one_token_further(modules):
    model = build(dataclasses.replace(ARGS, mtp_modules=modules, mtp_loss_weight=0.3), torch.float32)
    logits, ahead = model(torch.randint(0, ARGS.vocab_size, (2, 10)), with_mtp=True)
    assert logits.shape == (2, 10, ARGS.vocab_size)
    assert [a.shape for a in ahead] == [(2, 10 - depth, ARGS.vocab_size) for depth in range(1, modules + 1)]
