"""The planner's latent attention (models/parts/mla.py) against the real block on CPU: its element-wise
traffic per token (every aten op, as tests/planner/test_work.py counts a Llama block) and the bytes autograd keeps
for backward (as tests/planner/test_activations.py measures). Attention runs as flash attention keeps it (q, k, v,
the output and a log-sum-exp; recomputed in backward): CPU's SDPA takes its math path when the query/key and value
head dims differ, whose s x s probabilities the planner rightly does not count (GPU runs use the flash kernel)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from tests.planner.test_activations import saved_activation_bytes
from tests.planner.test_work import _ElementCount
from trillion.models.presets import get_preset
from trillion.models.rope import model_rope_cache
from trillion.models.transformer import Transformer, TransformerBlock
from trillion.parallel.planner.activations import layer_activation_bytes, output_activation_bytes
from trillion.parallel.planner.work import elementwise_per_token


class _FlashLike(torch.autograd.Function):
    """Causal attention keeping what flash attention keeps; its own ops stay out of the element count."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        with _disable_current_modes():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        ctx.save_for_backward(q, k, v, out, torch.empty(q.shape[:-1], dtype=torch.float32))
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        with _disable_current_modes(), torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=ctx.scale)
            return (*torch.autograd.grad(out, (q, k, v), grad), None)


def _flash(q, k, v, impl=None, causal=True, softmax_scale=None):
    return _FlashLike.apply(q, k, v, softmax_scale)


def _mla_args(q_lora: bool):
    args = dataclasses.replace(get_preset("debug-deepseek"), attention_impl="sdpa", moe=None, mtp_modules=0)
    return args if q_lora else dataclasses.replace(args, mla=dataclasses.replace(args.mla, q_lora_rank=0))


@pytest.mark.parametrize("q_lora", [True, False])
def test_mla_elementwise_count_matches_the_block(q_lora):
    args = _mla_args(q_lora)
    torch.manual_seed(0)
    block = TransformerBlock(args, 0)
    block.attention.attend = _flash
    batch, seq = 2, 128
    x = torch.randn(batch, seq, args.dim)
    rope = model_rope_cache(args)
    with _ElementCount() as forward:
        block(x, rope)
    assert forward.elements / (batch * seq) == pytest.approx(elementwise_per_token(args, tp=1, compiled=False), rel=0.1)


@pytest.mark.parametrize("q_lora", [True, False])
def test_mla_activation_bytes_within_25_percent(q_lora):
    args = dataclasses.replace(_mla_args(q_lora), n_layers=2)
    torch.manual_seed(0)
    model = Transformer(args)
    for block in model.layers.values():
        block.attention.attend = _flash
    tokens = torch.randint(0, args.vocab_size, (1, 256))
    measured = saved_activation_bytes(model, tokens)
    n = tokens.numel()
    predicted = args.n_layers * layer_activation_bytes(
        args, n, tp=1, sequence_parallel=False, checkpointed=False, dtype_bytes=4
    ) + output_activation_bytes(args, n, tp=1, sequence_parallel=False, dtype_bytes=4)
    assert abs(predicted / measured - 1) < 0.25, (predicted, measured)
