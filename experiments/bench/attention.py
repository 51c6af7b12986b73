"""Attention and norm kernels: our Triton kernels next to PyTorch's.

    python experiments/bench/attention.py            # on a GPU: bf16, causal, seq 1k-16k, head dims 64/128
    python experiments/bench/attention.py --smoke    # CPU, tiny sizes, Triton interpreter, seconds

Attention: forward, backward and forward+backward TFLOP/s of trillion.kernels.flash_attention_op, SDPA
restricted to its flash backend, and the eager reference (trillion.kernels.attention_dispatch.eager_attention),
with batch = 16k tokens / seq and heads = 2048 / head_dim so every shape fills the GPU alike.
FLOPs count the causal half: forward 2 matmuls, backward 5 (2.5x forward), as FlashAttention's
benchmarks do. Norms: GB/s (bytes read and written once) of trillion.kernels.norm's RMSNorm and LayerNorm
against torch.nn.functional.

Every case (SDPA's flash backend included) is first checked against an fp32 computation of the
same inputs (SDPA on fp32 tensors, without TF32; torch in fp32 for norms), then timed: median of repeated
synchronized runs after warm-up. A case that fails records its error and the others go on.
`run(smoke)` returns the rows for experiments/bench/run_all.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.bench.timing import median_seconds  # noqa: E402

# norm_calls: norm kernels take tens of microseconds, as long as a launch and a synchronize
# from the host, so each timed run makes that many calls between synchronizations.
FULL = dict(
    seqs=(1024, 2048, 4096, 8192, 16384),
    head_dims=(64, 128),
    tokens=16384,
    hidden=2048,
    norm_shapes=((16384, 2048), (16384, 8192)),
    warmup=3,
    repeats=10,
    norm_calls=50,
)
SMOKE = dict(
    seqs=(96,),
    head_dims=(64,),
    tokens=96,
    hidden=128,
    norm_shapes=((96, 64), (8, 1000)),
    warmup=1,
    repeats=1,
    norm_calls=2,
)
ATTENTION_IMPLS = ("triton", "sdpa_flash", "eager")
# Largest error allowed against the fp32 reference before a case is timed, relative to the largest
# reference value of each output and gradient: bf16 keeps 8 bits (inputs and products rounded to
# 2**-8, summed over thousands of keys); fp32 in smoke mode.
TOLERANCE = {"bfloat16": 3e-2, "float32": 1e-4}
# The eager reference materializes (batch, heads, seq, seq) scores in bf16 and fp32 and their
# gradients, about 16 bytes per score; shapes that would not fit are skipped, not failed.
EAGER_BYTES_PER_SCORE = 16


def _max_rel_err(got, expected) -> float:
    return max(
        ((a.float() - e.float()).abs().max() / e.float().abs().max().clamp_min(1e-30)).item()
        for a, e in zip(got, expected)
        if e is not None
    )


def _check(max_rel_err: float, dtype) -> None:
    if max_rel_err > TOLERANCE[str(dtype).removeprefix("torch.")]:
        raise AssertionError(f"max relative error {max_rel_err:.3g} against the fp32 reference")


def _attention_fn(impl: str):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trillion.kernels import flash_attention
    from trillion.kernels.attention_dispatch import eager_attention

    if impl == "triton":
        return lambda q, k, v: flash_attention(q, k, v, causal=True)
    if impl == "eager":
        return lambda q, k, v: eager_attention(q, k, v, causal=True)

    def sdpa_flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return sdpa_flash


def _attention_inputs(batch, heads, seq, head_dim, dtype, device):
    import torch

    # (batch, seq, heads, dim) memory seen as (batch, heads, seq, dim): the model's layout.
    q, k, v = (
        torch.randn(batch, seq, heads, head_dim, dtype=dtype, device=device).transpose(1, 2).requires_grad_()
        for _ in range(3)
    )
    return q, k, v, torch.randn_like(q)


def _fp32_reference(q, k, v, grad):
    """Output and input gradients in fp32 (SDPA's memory-efficient or math backend; TF32 off), the
    reference every implementation is checked against, SDPA's own flash backend included."""
    import torch

    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
        return (out.detach(), *torch.autograd.grad(out, leaves, grad.float()))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32


def _time_attention_passes(fn, q, k, v, grad, cfg, device) -> Iterator[tuple[str, float, float]]:
    """(pass, FLOPs as a multiple of the forward's, median seconds) of the forward, the backward
    alone (through one saved forward's graph, kept for the repeats) and both, each as it is timed.
    The saved graph lives in this generator only: freed once it is done or has failed."""
    import torch

    saved = fn(q, k, v)
    passes = {
        "fwd": (lambda: fn(q, k, v), 1.0),
        "bwd": (lambda: torch.autograd.grad(saved, (q, k, v), grad, retain_graph=True), 2.5),
        "fwd+bwd": (lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad), 3.5),
    }
    for name, (step, flop_factor) in passes.items():
        yield name, flop_factor, median_seconds(step, device, warmup=cfg["warmup"], repeats=cfg["repeats"])


def _bench_attention_shape(seq, head_dim, cfg, dtype, device) -> list[dict]:
    import torch

    batch, heads = max(1, cfg["tokens"] // seq), max(1, cfg["hidden"] // head_dim)
    flops_fwd = 4 * batch * heads * seq * seq * head_dim / 2  # causal: half the score matrix
    q, k, v, grad = _attention_inputs(batch, heads, seq, head_dim, dtype, device)
    shape = f"b={batch} h={heads} s={seq} d={head_dim}"
    reference = None
    rows = []
    for impl in ATTENTION_IMPLS:
        fn = _attention_fn(impl)
        eager_bytes = batch * heads * seq * seq * EAGER_BYTES_PER_SCORE
        if impl == "eager" and device.type == "cuda" and eager_bytes > 0.6 * torch.cuda.mem_get_info(device)[0]:
            rows.append({"name": f"attention eager {shape}", "skipped": f"needs ~{eager_bytes / 2**30:.0f} GiB"})
            continue
        try:
            if reference is None:
                reference = _fp32_reference(q, k, v, grad)
            out = fn(q, k, v)
            max_err = _max_rel_err((out, *torch.autograd.grad(out, (q, k, v), grad)), reference)
            del out
            _check(max_err, dtype)
            for name, flop_factor, seconds in _time_attention_passes(fn, q, k, v, grad, cfg, device):
                rows.append(
                    {
                        "name": f"attention {name} {impl} {shape}",
                        "ms": seconds * 1e3,
                        "tflops": flops_fwd * flop_factor / seconds / 1e12,
                        "max_err": max_err,
                    }
                )
        except Exception as error:  # one failing case (e.g. eager out of memory) must not hide the rest
            rows.append({"name": f"attention {impl} {shape}", "error": f"{type(error).__name__}: {error}"[:300]})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _bench_norms(cfg, dtype, device) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from trillion.kernels.norm import layer_norm, rms_norm

    cases = {
        "rms_norm": (lambda x, w, b: rms_norm(x, w, 1e-5), lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, 1e-5)),
        "layer_norm": (
            lambda x, w, b: layer_norm(x, w, b, 1e-5),
            lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5),
        ),
    }
    rows = []
    for rows_n, cols_n in cfg["norm_shapes"]:
        x = torch.randn(rows_n, cols_n, dtype=dtype, device=device, requires_grad=True)
        w = torch.randn(cols_n, dtype=dtype, device=device, requires_grad=True)
        b = torch.randn(cols_n, dtype=dtype, device=device, requires_grad=True)
        grad = torch.randn_like(x)
        io = x.numel() * x.element_size()
        for kind, (ours, theirs) in cases.items():
            # The reference is torch in fp32, so that neither side's own rounding is judged.
            x32, w32, b32 = (t.detach().float().requires_grad_() for t in (x, w, b))
            expected_out = theirs(x32, w32, b32)
            expected = (
                expected_out,
                *torch.autograd.grad(expected_out, (x32, w32, b32), grad.float(), allow_unused=True),
            )
            for impl, fn in (("triton", ours), ("torch", theirs)):
                label = f"{kind} {{}} {impl} {rows_n}x{cols_n}"
                try:
                    out = fn(x, w, b)
                    max_err = _max_rel_err(
                        (out, *torch.autograd.grad(out, (x, w, b), grad, allow_unused=True)), expected
                    )
                    _check(max_err, dtype)
                    # Forward reads x, writes y; backward reads x and dy, writes dx.
                    for name, step, bytes_moved in (
                        ("fwd", lambda: fn(x, w, b), 2 * io),
                        ("fwd+bwd", lambda: torch.autograd.grad(fn(x, w, b), (x, w), grad), 5 * io),
                    ):
                        seconds = median_seconds(
                            step, device, warmup=cfg["warmup"], repeats=cfg["repeats"], calls=cfg["norm_calls"]
                        )
                        rows.append(
                            {
                                "name": label.format(name),
                                "ms": seconds * 1e3,
                                "gbps": bytes_moved / seconds / 1e9,
                                "max_err": max_err,
                            }
                        )
                except Exception as error:
                    rows.append({"name": label.format("check"), "error": f"{type(error).__name__}: {error}"[:300]})
    return rows


def run(smoke: bool = False, on_row=None) -> list[dict]:
    """All rows: attention cases, then norms; `on_row(row)` is called as each is measured. Smoke
    mode runs on CPU through Triton's interpreter in fp32 (it has no bf16 dot products)."""
    if smoke:
        # Our kernel modules are defined on first use, so this still takes effect here.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not smoke:
        raise SystemExit("The full benchmark needs a GPU; use --smoke on CPU.")
    cfg = SMOKE if smoke else FULL
    dtype = torch.float32 if smoke else torch.bfloat16
    rows = []

    def add(new):
        rows.extend(new)
        for row in new:
            if on_row:
                on_row(row)

    for head_dim in cfg["head_dims"]:
        for seq in cfg["seqs"]:
            add(_bench_attention_shape(seq, head_dim, cfg, dtype, device))
            print(f"[{time.strftime('%H:%M:%S')}] attention d={head_dim} s={seq} done", file=sys.stderr, flush=True)
    add(_bench_norms(cfg, dtype, device))
    _add_speedups(rows)
    return rows


def _add_speedups(rows: list[dict]) -> None:
    """Our rows get vs_torch: our throughput over PyTorch's best at the same case (SDPA flash for
    attention, torch.nn.functional for norms); above 1 means faster."""
    by_name = {row["name"]: row for row in rows}
    for row in rows:
        if " triton " not in row["name"] or "error" in row:
            continue
        metric = "tflops" if "tflops" in row else "gbps"
        other = by_name.get(row["name"].replace(" triton ", " sdpa_flash " if metric == "tflops" else " torch "))
        if other and metric in other:
            row["vs_torch"] = row[metric] / other[metric]


def format_table(rows: list[dict]) -> str:
    keys = ["name", "ms", "tflops", "gbps", "vs_torch", "max_err", "skipped", "error"]
    keys = [k for k in keys if any(k in row for row in rows)]
    cells = [[f"{row[k]:.4g}" if isinstance(row.get(k), float) else str(row.get(k, "")) for k in keys] for row in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.ljust(w) for k, w in zip(keys, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in cells]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, Triton interpreter (seconds)")
    opts = parser.parse_args(argv)
    rows = run(smoke=opts.smoke)
    print(format_table(rows))
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
