"""parallel.activation_checkpoint=deepseek (parallel/activation_checkpoint.py): DeepSeek-V3's recompute. It trains as
nothing recomputed does (bitwise, in one process, MTP on), what it recomputes (the normed latents, q, k, v, the
norms' outputs, SwiGLU's) is not held between forward and backward, and a model without latent attention is refused
before any work. Its parity under expert parallelism and DualPipeV: tests/moe/test_ep_parity.py and
tests/pipeline/test_dualpipe_pairing.py."""

import dataclasses

import pytest
import torch

from tests.helpers.parallelized import parallelized_model
from trillion.errors import ConfigError
from trillion.models import PRESETS, Transformer
from trillion.trainer.assemble import check_model_layout, resolve_layout
from trillion.trainer.config.schema import load_config
from trillion.trainer.tools.estimate.activations import measure_micro_batch

ARGS = dataclasses.replace(PRESETS["debug-deepseek"], n_layers=2, dim=64, vocab_size=128, max_seq_len=32)


def _model(mode: str, args=ARGS) -> Transformer:
    return parallelized_model(args, activation_checkpoint=mode)


def _forward(model):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (2, 16), generator=generator)
    outputs = model(tokens, ahead=torch.randint(0, 128, (2, 16, 1), generator=generator))
    return sum(output.float().pow(2).mean() for output in outputs)


def test_it_trains_as_nothing_recomputed():
    results = []
    for mode in ("none", "deepseek"):
        model = _model(mode)
        loss = _forward(model)
        loss.backward()
        results.append((loss.detach(), {name: p.grad for name, p in model.named_parameters()}))
    (loss, grads), (recomputed_loss, recomputed_grads) = results
    assert torch.equal(loss, recomputed_loss)
    for name, grad in grads.items():
        assert torch.equal(recomputed_grads[name], grad), name


def test_it_compiles():
    """Under torch.compile of each block (its op-level policies a partial, not a closure: dynamo takes no other
    context_fn; the routed experts' grouped GEMM in fp32 on this CPU the per-group loop, torch._grouped_mm's meta
    taking bf16 only), the loss and the gradients those of the eager recompute within float32 rounding."""
    results = []
    for compile in (False, True):
        model = parallelized_model(ARGS, activation_checkpoint="deepseek", compile=compile)
        loss = _forward(model)
        loss.backward()
        results.append((loss.detach(), {name: p.grad for name, p in model.named_parameters()}))
    (loss, grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_it_keeps_what_deepseek_keeps():
    """Bytes held from the forward to the backward of one micro-batch (MemTracker, real tensors, fp32) on
    debug-deepseek's shape, 3 layers (1 dense): the recompute drops per token and layer the normed latents (96 + 64),
    q, k (8 heads x 48 each), v and wo's input (8 x 32 each), the attention norm's output (256), SwiGLU's silu and
    product (the dense layer: 2 x 704 with its norm's output; an MoE layer's shared expert 2 x 256), and of an MoE
    layer's two chosen experts w2's input (2 x 256: their SwiGLU keeps only gate and up either way, kernels/swiglu.py):
    8800 elements a token, 9.0 MB; measured 9.8 MB (rotary's pieces besides)."""
    args = dataclasses.replace(PRESETS["debug-deepseek"], n_layers=3, mtp_modules=0)
    tokens = 2 * 128
    generator = torch.Generator().manual_seed(1)
    inputs, target = (torch.randint(0, args.vocab_size, (2, 128), generator=generator) for _ in range(2))
    held = {}
    for mode in ("none", "deepseek"):
        model = _model(mode, args)
        held[mode] = measure_micro_batch(model, inputs, target, tp_enabled=False, last=True).held
    attention = 96 + 64 + 8 * (2 * 48 + 2 * 32) + 256
    dense, moe = 256 + 2 * 704, 2 * 256 + 2 * 256
    expected = tokens * 4 * (3 * attention + dense + 2 * moe)
    dropped = held["none"] - held["deepseek"]
    assert expected <= dropped <= 1.1 * expected, (dropped, expected)


def test_a_model_without_latent_attention_is_refused():
    config = load_config(None, ["--model.name=debug-moe", "--parallel.activation_checkpoint=deepseek"])
    with pytest.raises(ConfigError, match="activation_checkpoint=deepseek recomputes the norms and latent attention"):
        check_model_layout(resolve_layout(config, 1), PRESETS["debug-moe"], config.training.seq_len)
