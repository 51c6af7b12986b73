"""The GPU tier (`pytest -m gpu`, skipped without a GPU): the kernels natively in bf16 and fp16 with
autotuning on (attention and the norms under torch.compile; latent attention's 192/128; document masking; the grouped
GEMM without a host sync), against a float64 reference; and a short training run with
Triton attention against SDPA. Under 5 minutes on one H100/H200; run by experiments/bench/device_check.sh.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from trillion.kernels._triton_setup import interpreting

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or interpreting(),
        reason="needs a GPU and the native Triton compiler: run `pytest -m gpu` on a GPU machine",
    ),
]

DTYPES = (torch.bfloat16, torch.float16)
# (batch, q_heads, kv_heads, q_len, kv_len): grouped queries with sequence tails off every block
# size, and a query block shorter than the keys (a KV prefix, lower-right causal alignment). Each
# new shape and dtype autotunes (compiles and times every config), so the grid stays small: the
# interpreter tests (tests/kernels) cover the shapes, this tier the native code.
SHAPES = ((2, 8, 2, 1000, 1000), (1, 4, 4, 128, 640))
# (dtype, head_dim, causal): both dtypes, both head dims, both masks; latent attention's q/k 192, v 128.
ATTENTION_CASES = (
    (torch.bfloat16, (192, 128), True),
    (torch.bfloat16, 128, True),
    (torch.bfloat16, 64, True),
    (torch.bfloat16, 128, False),
    (torch.float16, 128, True),
    (torch.float16, 64, False),
)


def _attention_grads(fn, q, k, v, grad, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad.to(dtype))
    return [out.detach().double()] + [t.grad.double() for t in leaves]


def _err(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("dtype, head_dim, causal", ATTENTION_CASES, ids=lambda c: str(c).removeprefix("torch."))
def test_flash_attention_under_compile_matches_float64(dtype, head_dim, causal):
    from trillion.kernels.flash_attention_op import flash_attention, reference_attention

    compiled = torch.compile(lambda q, k, v: flash_attention(q, k, v, causal=causal), fullgraph=True)
    for batch, hq, hkv, lq, lk in SHAPES:
        gen = torch.Generator("cuda").manual_seed(lq + hkv)
        d, dv = (head_dim, head_dim) if isinstance(head_dim, int) else head_dim
        q = torch.randn(batch, hq, lq, d, device="cuda", generator=gen)
        k, v = (torch.randn(batch, hkv, lk, dim, device="cuda", generator=gen) for dim in (d, dv))
        grad = torch.randn(batch, hq, lq, dv, device="cuda", generator=gen)
        exact = _attention_grads(lambda *t: reference_attention(*t, causal=causal), q, k, v, grad, torch.float64)
        ours = _attention_grads(compiled, q, k, v, grad, dtype)
        torch_same = _attention_grads(lambda *t: reference_attention(*t, causal=causal), q, k, v, grad, dtype)
        for name, mine, truth, theirs in zip(("out", "dq", "dk", "dv"), ours, exact, torch_same):
            assert torch.isfinite(mine).all(), name
            # PyTorch's own error in this dtype, twice, plus a floor of a few units in the last place.
            bound = 2 * _err(theirs, truth) + 4 * torch.finfo(dtype).eps * truth.abs().max().item()
            assert _err(mine, truth) <= bound, (name, (batch, hq, hkv, lq, lk), _err(mine, truth), bound)


@pytest.mark.parametrize("head_dim", (128, (192, 128)), ids=("d128", "d192-v128"))
def test_document_masked_flash_attention_under_compile_matches_float64(head_dim):
    """bf16, documents of 1 to 700 tokens in 2048-token windows (one window a single document)."""
    from trillion.kernels.flash_attention_op import flash_attention, reference_attention

    gen = torch.Generator("cuda").manual_seed(7)
    d, dv = (head_dim, head_dim) if isinstance(head_dim, int) else head_dim
    q, k = (torch.randn(2, 8, 2048, d, device="cuda", generator=gen) for _ in range(2))
    v, grad = (torch.randn(2, 8, 2048, dv, device="cuda", generator=gen) for _ in range(2))
    starts = torch.rand(2, 2048, device="cuda", generator=gen) < 1 / 300
    starts[1] = False
    ids = starts.cumsum(dim=1)
    compiled = torch.compile(lambda *t: flash_attention(*t, document_ids=ids), fullgraph=True)
    exact = _attention_grads(lambda *t: reference_attention(*t, document_ids=ids), q, k, v, grad, torch.float64)
    ours = _attention_grads(compiled, q, k, v, grad, torch.bfloat16)
    torch_same = _attention_grads(lambda *t: reference_attention(*t, document_ids=ids), q, k, v, grad, torch.bfloat16)
    for name, mine, truth, theirs in zip(("out", "dq", "dk", "dv"), ours, exact, torch_same):
        bound = 2 * _err(theirs, truth) + 4 * torch.finfo(torch.bfloat16).eps * truth.abs().max().item()
        assert torch.isfinite(mine).all() and _err(mine, truth) <= bound, (name, _err(mine, truth), bound)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ("rms", "layer"))
def test_norms_under_compile_match_float32(dtype, kind):
    import torch.nn.functional as F

    from trillion.kernels.norm import layer_norm, rms_norm

    ours = torch.compile(lambda x, w, b: rms_norm(x, w, 1e-5) if kind == "rms" else layer_norm(x, w, b, 1e-5))
    for rows, cols in ((4096, 2048), (1000, 4096), (64, 8192)):
        x, dy = torch.randn(2, rows, cols, device="cuda"), torch.randn(2, rows, cols, device="cuda")
        w, b = torch.randn(cols, device="cuda"), torch.randn(cols, device="cuda")

        def run(fn, dt):
            leaves = [t.detach().to(dt).requires_grad_() for t in (x, w, b)]
            out = fn(*leaves)
            out.backward(dy.to(dt))
            return [out.detach().float()] + [t.grad.float() if t.grad is not None else None for t in leaves]

        def theirs(x, w, b):
            return F.rms_norm(x, x.shape[-1:], w, 1e-5) if kind == "rms" else F.layer_norm(x, x.shape[-1:], w, b, 1e-5)

        exact, mine, same = run(theirs, torch.float32), run(ours, dtype), run(theirs, dtype)
        for name, m, e, s in zip(("y", "dx", "dw", "db"), mine, exact, same):
            if e is None:
                continue
            bound = 2 * _err(s, e) + 4 * torch.finfo(dtype).eps * e.abs().max().item()
            assert _err(m, e) <= bound, (name, rows, cols, _err(m, e), bound)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_grouped_gemm_matches_float64_without_a_host_sync(dtype):
    """Uneven and empty experts and rows past the last one, at a DeepSeek-V3-like width; the second call
    (the first autotunes) runs under sync_debug_mode="error": no read of the group sizes on the host."""
    from trillion.kernels.grouped_gemm import loop_grouped_mm
    from trillion.kernels.grouped_gemm_op import triton_grouped_mm

    gen = torch.Generator("cuda").manual_seed(0)
    sizes = torch.tensor([700, 0, 1, 1500, 0, 333, 900, 0], device="cuda")
    offsets, rows = sizes.cumsum(0).to(torch.int32), int(sizes.sum()) + 100
    x, w = (
        torch.randn(rows, 2048, device="cuda", generator=gen),
        torch.randn(8, 2048, 1536, device="cuda", generator=gen),
    )
    dy = torch.randn(rows, 1536, device="cuda", generator=gen)

    def run(fn, dt):
        leaves = [t.detach().to(dt).requires_grad_() for t in (x, w)]
        out = fn(*leaves, offsets)
        out.backward(dy.to(dt))
        return [out.detach().double(), *(t.grad.double() for t in leaves)]

    run(triton_grouped_mm, dtype)
    torch.cuda.set_sync_debug_mode("error")
    try:
        mine = run(triton_grouped_mm, dtype)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    exact, same = run(loop_grouped_mm, torch.float64), run(loop_grouped_mm, dtype)
    for name, m, e, s in zip(("out", "dx", "dw"), mine, exact, same):
        bound = 2 * _err(s, e) + 4 * torch.finfo(dtype).eps * e.abs().max().item()
        assert _err(m, e) <= bound, (name, _err(m, e), bound)
    assert not mine[0][int(offsets[-1]) :].any() and not mine[2][1].any()


def _train(tmp_path, attention: str) -> list[float]:
    out = tmp_path / attention
    args = [
        sys.executable,
        "-m",
        "trillion",
        "train",
        f"--job.output_dir={out}",
        "--model.name=debug",
        f"--kernels.attention={attention}",
        "--training.steps=30",
        "--training.seq_len=256",
        "--metrics.log_freq=1",
        "--checkpoint.interval=0",
        "--logging.wandb=false",
        "--job.seed=7",
    ]
    result = subprocess.run(
        args, capture_output=True, text=True, timeout=240, env={**os.environ, "TRITON_INTERPRET": "0"}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["mfu"] is None or records[-1]["mfu"] > 0
    return [r["loss"] for r in records if "loss" in r and "eval_loss" not in r]


def test_training_with_triton_attention_matches_sdpa_in_bf16(tmp_path):
    triton_losses, sdpa_losses = _train(tmp_path, "triton"), _train(tmp_path, "sdpa")
    assert len(triton_losses) == len(sdpa_losses) == 30
    assert triton_losses[-1] < triton_losses[0] - 1.0, triton_losses  # it learns
    # bf16 autocast: both runs round the same products; their curves stay within a few bf16 steps.
    for step, (a, b) in enumerate(zip(triton_losses, sdpa_losses), 1):
        assert abs(a - b) <= 0.02 * abs(b) + 0.02, (step, a, b)
