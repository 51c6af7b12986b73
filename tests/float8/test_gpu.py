"""The GPU tier of float8 (`pytest -m gpu`, skipped without a GPU; experiments/bench/device_check.sh runs it):
a llama3-1b-sized model (16 layers of 2048, the preset's shape) trains 30 steps in bf16 and with float8
(torchao, tensorwise, on the hardware's float8 GEMMs), from the same seed and data, and the two loss curves
stay within a stated band. On a GPU without float8 units (A100, MI250X) the float8 run must be refused.

The band: at every step |float8 - bf16| <= 4% of the bf16 loss + 0.05, and over the last 10 steps the mean
within 2%. Float8 rounds each GEMM operand to 3 mantissa bits (e4m3) where bf16 keeps 8, a relative error
of up to 2^-4 per element that averages out over the K-long dot products; the CPU emulation of the debug
model (docs/low-precision.md) ends 200 steps within 0.9% of the fp32 run's held-out loss, and
torchtitan's published Llama 3 8B float8 curves lie on the bf16 ones. Early steps, where the loss falls
fastest, get the wider per-step allowance.
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

STEPS = 30


def _has_float8_units() -> bool:
    from trillion.errors import ConfigError
    from trillion.parallel.float8 import check_device

    try:
        check_device(torch.device("cuda", 0), emulate=False)
    except ConfigError:
        return False
    return True


def _train(tmp_path, name: str, *flags: str) -> subprocess.CompletedProcess:
    out = tmp_path / name
    command = [
        *(sys.executable, "-m", "trillion", "train", f"--job.output_dir={out}"),
        *("--model.name=llama3-1b", f"--training.steps={STEPS}", "--training.seq_len=512"),
        *("--training.global_batch_size=8", "--training.micro_batch_size=8", "--metrics.log_freq=1"),
        *("--eval.interval=0", "--checkpoint.interval=0", "--checkpoint.save_final=false"),
        *("--logging.wandb=false", "--job.seed=7", "--lr_schedule.warmup_steps=5", *flags),
    ]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "0"}
    )


def _losses(result, out) -> list[float]:
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def test_llama3_1b_float8_trains_within_the_band_of_bf16(tmp_path):
    if not _has_float8_units():
        result = _train(tmp_path, "float8", "--float8.enabled=true")
        assert result.returncode == 2 and "float8 (e4m3/e5m2) matrix units" in result.stderr
        pytest.skip(f"{torch.cuda.get_device_name()} has no float8 units: refused, as it must be")
    plain = _losses(_train(tmp_path, "bf16"), tmp_path / "bf16")
    run = _train(tmp_path, "float8", "--float8.enabled=true")
    low = _losses(run, tmp_path / "float8")
    assert "linears converted" in run.stderr and "emulated" not in run.stderr
    assert len(plain) == len(low) == STEPS
    assert plain[-1] < plain[0] - 1.0, plain  # it learns
    for step, (a, b) in enumerate(zip(low, plain), 1):
        assert abs(a - b) <= 0.04 * abs(b) + 0.05, (step, a, b)
    tail_float8, tail_bf16 = sum(low[-10:]) / 10, sum(plain[-10:]) / 10
    assert abs(tail_float8 - tail_bf16) <= 0.02 * tail_bf16, (tail_float8, tail_bf16)


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
def test_the_float8_experts_on_the_gpu_match_their_emulation(recipe):
    """The routed experts' float8 grouped GEMM natively (blockwise: the Triton kernel; rowwise: torchao's grouped
    GEMM where it runs, else the Triton kernel) against the same quantisation emulated in fp32, DeepSeek-V3's expert
    width, uneven and empty groups, forward and both gradients: within fp32 accumulation of exact float8 products
    (the bf16 output's rounding, 2^-8 of the largest value)."""
    if not _has_float8_units():
        pytest.skip(f"{torch.cuda.get_device_name()} has no float8 units")
    from trillion.kernels.float8_grouped_gemm import Float8GroupedMM, resolved

    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = [300, 0, 1024, 17, 0, 700]
    x = torch.randn(sum(sizes) + 9, 7168, device="cuda", generator=gen)
    weight = torch.randn(len(sizes), 7168, 2048, device="cuda", generator=gen) * 0.02
    dy = torch.randn(x.shape[0], 2048, device="cuda", generator=gen)
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    results = []
    for emulate, dtype in ((False, torch.bfloat16), (True, torch.float32)):
        leaves = [t.to(dtype).requires_grad_() for t in (x, weight)]
        out = Float8GroupedMM(recipe, emulate)(*leaves, offsets)
        out.backward(dy.to(dtype))
        results.append([out.float(), leaves[0].grad.float(), leaves[1].grad.float()])
    assert resolved(recipe, False, x.device)[1] in ("torchao", "triton")
    for name, native, emulated in zip(("out", "dx", "dweight"), *results):
        bound = 2**-7 * emulated.abs().max().item()
        assert (native - emulated).abs().max().item() <= bound, name
