"""The kernels as the model uses them: `attention(impl="triton")`, triton norms in build_norm, its
fallback where Triton cannot run, and training parity with the PyTorch implementations."""

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F

from trillion.kernels import attention, flash_attention
from trillion.kernels import norm as norm_module
from trillion.models.presets import get_preset
from trillion.models.transformer import Transformer


def test_triton_impl_runs_our_kernel_and_matches_sdpa():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 50, 32, generator=gen)
    k, v = (torch.randn(2, 2, 50, 32, generator=gen) for _ in range(2))
    out = attention(q, k, v, impl="triton")
    assert torch.equal(out, flash_attention(q, k, v))
    torch.testing.assert_close(out, attention(q, k, v, impl="sdpa"), atol=1e-5, rtol=1e-5)


def test_triton_impl_falls_back_to_sdpa_and_says_why(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors without the interpreter
    q = torch.randn(1, 2, 8, 16)
    with caplog.at_level(logging.WARNING, logger="kernels"):
        out = attention(q, q, q, impl="triton")
    assert "kernels.attention=triton falls back to PyTorch: Triton needs a CUDA or ROCm GPU" in caplog.text
    torch.testing.assert_close(out, attention(q, q, q, impl="sdpa"))
    with pytest.raises(RuntimeError, match="flash_attention cannot run: Triton needs a CUDA or ROCm GPU"):
        flash_attention(q, q, q)


def test_triton_norm_modules_subclass_torch_ones():
    args = dataclasses.replace(get_preset("debug"), n_layers=1, dim=32, n_heads=2, n_kv_heads=1, norm_impl="triton")
    for norm, cls in (("rmsnorm", norm_module.RMSNorm), ("layernorm", norm_module.LayerNorm)):
        model = Transformer(dataclasses.replace(args, norm=norm))
        assert type(model.norm) is cls
        assert isinstance(model.norm, torch.nn.RMSNorm if norm == "rmsnorm" else torch.nn.LayerNorm)


def _train_losses(preset: str, attention_impl: str, norm_impl: str, steps: int = 3) -> list[float]:
    args = dataclasses.replace(
        get_preset(preset),
        n_layers=2,
        dim=64,
        n_heads=4,
        n_kv_heads=2 if preset == "debug" else None,
        attention_impl=attention_impl,
        norm_impl=norm_impl,
    )
    model = Transformer(args)
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, args.vocab_size, (1, 49), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):  # the same batch each step, so that the loss must fall
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("preset", ["debug", "debug-gpt"], ids=["llama-rmsnorm-gqa", "gpt-layernorm"])
def test_training_with_triton_kernels_matches_pytorch(preset):
    # Llama-style: RMSNorm, grouped-query attention; GPT-style: LayerNorm with biases, MHA.
    expected = _train_losses(preset, "sdpa", "torch")
    ours = _train_losses(preset, "triton", "triton")
    assert ours == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert ours[-1] < ours[0]


@pytest.mark.parametrize("interpret", ["1", "0"], ids=["triton", "fallback"])
def test_dispatch_compiles_without_graph_break(monkeypatch, interpret):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    torch.compiler.reset()  # the answer is compiled in as a constant, without a guard
    q = torch.randn(1, 2, 20, 16)
    compiled = torch.compile(lambda q: attention(q, q, q, impl="triton"), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q), attention(q, q, q, impl="sdpa"), atol=1e-5, rtol=1e-5)


def test_trainer_with_triton_kernels_matches_sdpa_losses(tmp_path):
    import json

    from trillion.trainer.cli.main import main

    def losses(attention_impl: str, norm_impl: str) -> list[float]:
        out = tmp_path / attention_impl
        status = main(
            [
                "train",
                f"--job.output_dir={out}",
                "--model.n_layers=2",
                "--model.dim=64",
                "--model.n_heads=4",
                "--model.n_kv_heads=2",
                "--training.steps=3",
                "--training.seq_len=32",
                "--training.global_batch_size=2",
                "--training.micro_batch_size=2",
                "--metrics.log_freq=1",
                "--checkpoint.interval=0",
                f"--kernels.attention={attention_impl}",
                f"--kernels.norm={norm_impl}",
            ]
        )
        assert status == 0
        records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        return [r["loss"] for r in records if "loss" in r]  # the step-0 evaluation has none

    expected = losses("sdpa", "torch")
    assert len(expected) == 3  # every step logged
    assert losses("triton", "triton") == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("impl", ["eager", "sdpa", "triton"])
@pytest.mark.parametrize("q_len", [24, 9], ids=["square", "kv-prefix"])
def test_fallbacks_take_a_value_head_dim_of_its_own(impl, q_len):
    """Latent attention (DeepSeek-V3: q/k head dim 192, v 128), at debug sizes 48/32 with GQA."""
    from trillion.kernels.flash_attention_op import reference_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, q_len, 48, generator=gen)
    k, v = torch.randn(2, 2, 24, 48, generator=gen), torch.randn(2, 2, 24, 32, generator=gen)
    out = attention(q, k, v, impl=impl, causal=True, softmax_scale=0.3)
    assert out.shape == (2, 4, q_len, 32)
    exact = reference_attention(q.double(), k.double(), v.double(), causal=True, softmax_scale=0.3)
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
