"""Everything users compare trainers by, in one GPU call: the machine's ceilings, attention and
norm kernels, and one-GPU training steps (tokens/s, TFLOP/s, MFU, HFU, peak memory); on request
(`--only float8`) a step in bf16 against float8 (tensorwise and rowwise, compiled) and its speed-up.

    python experiments/bench/run_all.py                 # on a GPU: under 8 minutes on an H100/H200
    python experiments/bench/run_all.py --smoke         # CPU, tiny sizes, seconds (tested)
    python experiments/bench/run_all.py --only gemm,step
    python experiments/bench/run_all.py --only float8   # device_check.sh's float8 part

Each figure is the median of repeated timed runs after warm-up, on fresh random inputs, timed
with synchronized wall clocks; each result is checked for correctness before it is timed. A part
that fails is recorded with its error and the rest goes on. Each row is appended to a JSON-lines
file and the Markdown table rewritten as soon as it is measured (--out, default
experiments/bench/results/), so a run cut short keeps what it measured; the table is printed at the end.
"""

import argparse
import contextlib
import datetime
import importlib.util
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from experiments.bench.timing import median_seconds  # noqa: E402


def bench_gemm(device, smoke: bool) -> list[dict]:
    """bf16 GEMM ceiling (8192^3), the whole product checked against an fp32 product (TF32 off) of
    the same operands; the timed runs multiply fresh operands of the same shape and dtype."""
    import torch

    n = 256 if smoke else 8192
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    allow_tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    reference = a.float() @ b.float()
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    error = ((a @ b).float() - reference).abs().max().item() / reference.abs().max().item()
    del reference
    if error > 2e-2:
        raise AssertionError(f"GEMM result is wrong: relative error {error:.3g}")
    seconds = median_seconds(
        lambda x, y: x @ y,
        device,
        warmup=3,
        repeats=10,
        fresh_inputs=lambda: (torch.randn_like(a), torch.randn_like(b)),
    )
    return [
        {
            "part": "ceiling",
            "name": f"gemm {n}^3 {str(dtype).split('.')[-1]}",
            "seconds": seconds,
            "tflops": 2 * n**3 / seconds / 1e12,
        }
    ]


def bench_copy(device, smoke: bool) -> list[dict]:
    """Device-to-device copy bandwidth (bytes read + written)."""
    import torch

    numel = (1 << 20) if smoke else (1 << 30)
    source = torch.randn(numel, device=device, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)
    if not torch.equal(target, source):
        raise AssertionError("copy produced different bytes")
    seconds = median_seconds(lambda: target.copy_(source), device, warmup=3, repeats=10)
    return [
        {
            "part": "ceiling",
            "name": f"copy {4 * numel / 2**20:.0f} MiB",
            "seconds": seconds,
            "gb_per_s": 2 * 4 * numel / seconds / 1e9,
        }
    ]


def bench_kernels(device, smoke: bool, record) -> None:
    """Attention and norm kernels: the rows of experiments/bench/attention.py, recorded as measured."""
    spec = importlib.util.spec_from_file_location("bench_attention", HERE / "attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def kernel_row(row):
        row["part"] = "kernels"
        record(row)

    module.run(smoke=smoke, on_row=kernel_row)


STEP_CASES = [  # (model, attention, compile, activation checkpointing)
    ("llama3-1b", "sdpa", False, "none"),
    ("llama3-1b", "triton", False, "none"),
    ("llama3-1b", "triton", True, "none"),
    ("llama3-1b", "sdpa", True, "none"),
    ("llama3-1b", "triton", True, "full"),
    ("gpt-1.4b", "sdpa", False, "none"),
    ("gpt-1.4b", "triton", True, "none"),
    ("gpt-1.4b", "triton", True, "full"),
]
# Compiling takes about 20 s a block shape on two CPU cores: the smoke mode keeps to eager cases.
SMOKE_STEP_CASES = [
    ("llama3-1b", "sdpa", False, "none"),
    ("llama3-1b", "triton", False, "full"),
    ("gpt-1.4b", "sdpa", False, "full"),
]


def bench_training_steps(device, smoke: bool, gemm_tflops: float | None, record) -> None:
    for model_name, attention, compiled, checkpointing in SMOKE_STEP_CASES if smoke else STEP_CASES:
        try:
            row = bench_one_step(device, smoke, model_name, attention, compiled, checkpointing, gemm_tflops)
        except Exception as error:  # one failing case must not hide the others
            row = {
                "part": "step",
                "name": f"{model_name} {attention} compile={compiled} ac={checkpointing}",
                "error": f"{type(error).__name__}: {error}"[:300],
            }
        finally:
            _release(device)
        record(row)


FLOAT8_CASES = [None, "tensorwise", "rowwise"]  # bf16, then each float8 recipe; all compiled on a GPU


def bench_float8(device, smoke: bool, record) -> None:
    """One training step of llama3-1b (16 layers of 2048, 4 x 2048 tokens) in bf16 and in float8 (torchao,
    tensorwise and rowwise), compiled, each row with its speed-up over the bf16 row (fp32 on a CPU). On a
    GPU without float8 units the float8 rows carry the trainer's refusal. Smoke mode: the same code path on
    CPU, the tiny model, float8 emulated (not faster), eager (inductor takes minutes on two cores)."""
    baseline, plain = None, "bf16" if device.type == "cuda" else "fp32"
    for recipe in FLOAT8_CASES:
        name = f"llama3-1b {plain if recipe is None else 'float8 ' + recipe} compile={not smoke}"
        try:
            row = bench_one_step(device, smoke, "llama3-1b", "sdpa", not smoke, "none", None, float8=recipe)
            row.update(part="float8", name=name)
            if recipe is None:
                baseline = row["seconds"]
            elif baseline:
                row["speedup_vs_bf16"] = baseline / row["seconds"]
            if smoke and recipe is not None:
                row["note"] = "emulated: not a speed figure"
        except Exception as error:
            row = {"part": "float8", "name": name, "error": f"{type(error).__name__}: {error}"[:300]}
        finally:
            _release(device)
        record(row)


def _release(device) -> None:
    """Frees the last case's model, optimizer and compiled graphs (reference cycles through the
    checkpoint closures and compile keep blocks alive), so the next case starts from an empty device."""
    import gc

    import torch

    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_one_step(
    device, smoke, model_name, attention, compiled, checkpointing, gemm_tflops, float8: str | None = None
) -> dict:
    """The trainer's own step (train_step, AdamW, its AC and compile) on fresh random tokens; `float8`: the
    linears in float8 with that torchao recipe (emulated on a CPU), after the trainer's device check."""
    import torch

    seq_len, batch = (32, 2) if smoke else (2048, 4)
    config, args = _step_config(model_name, attention, seq_len, smoke)
    start_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = _trainer_step(config, args, checkpointing, compiled, device, float8=float8)

    def fresh():
        tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1), device=device)
        return ([(tokens[:, :-1], tokens[:, 1:])],)

    # The check: four steps on one batch give finite losses that fall (the model starts to learn it).
    (batch_once,) = fresh()
    losses = [step(batch_once)[0].item() for _ in range(4)]
    if not all(map(math.isfinite, losses)) or not losses[-1] < losses[0]:
        raise AssertionError(f"four training steps on one batch gave losses {losses}, not finite and falling")
    seconds = median_seconds(step, device, warmup=2, repeats=3 if smoke else 10, fresh_inputs=fresh)
    return _step_row(
        device,
        args,
        name=f"{model_name} {attention} compile={compiled} ac={checkpointing}",
        checkpointing=checkpointing,
        seq_len=seq_len,
        tokens=batch * seq_len,
        seconds=seconds,
        losses=losses,
        start_bytes=start_bytes,
        gemm_tflops=gemm_tflops,
    )


def _step_config(model_name: str, attention: str, seq_len: int, smoke: bool) -> tuple:
    """(config, model args) of one case, as the trainer reads and builds them; tiny in smoke mode."""
    from trillion.parallel.layout import Layout
    from trillion.trainer.assemble import build_model_args
    from trillion.trainer.config.schema import load_config

    shrink = [
        "--model.n_layers=2",
        "--model.dim=64",
        "--model.n_heads=4",
        "--model.n_kv_heads=4",
        "--model.ffn_dim=128",
        "--model.vocab_size=512",
    ]
    config = load_config(
        None,
        [
            f"--model.name={model_name}",
            f"--kernels.attention={attention}",
            f"--training.seq_len={seq_len}",
            *(shrink if smoke else []),
        ],
    )
    return config, build_model_args(config, 0, Layout())  # one process


def _trainer_step(config, args, checkpointing: str, compiled: bool, device, float8: str | None = None):
    """The model as the trainer makes it (on meta, float8 swap, AC, compile, then materialized and
    initialized) with its AdamW; returns one optimizer step on a list of micro-batches (train_step)."""
    import torch

    from trillion.models import Transformer
    from trillion.parallel import float8 as float8_training
    from trillion.parallel.activation_checkpoint import apply_activation_checkpointing
    from trillion.parallel.compile import apply_compile
    from trillion.parallel.forward_backward import MicroBatchLoop
    from trillion.parallel.layout import resolve_float8
    from trillion.trainer.optim import build_optimizer
    from trillion.trainer.step import train_step

    with torch.device("meta"):
        model = Transformer(args)
    if float8 is not None:
        emulate = device.type == "cpu"
        float8_training.check_device(device, emulate)  # an A100 or MI250X: the trainer's refusal, as the row's error
        float8_training.convert(model, resolve_float8(float8, fsdp_enabled=False, emulate=emulate))
    apply_activation_checkpointing(model, checkpointing)
    if compiled:
        apply_compile(model)
    model.to_empty(device=device)
    model.init_weights(0)
    optimizer = build_optimizer(model, config.optimizer, device.type)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    runner = MicroBatchLoop(model)

    def step(micro_batches):
        return train_step(runner, micro_batches, optimizer, scaler, autocast, 1.0)

    return step


def _step_row(device, args, *, name, checkpointing, seq_len, tokens, seconds, losses, start_bytes, gemm_tflops) -> dict:
    """The case's row: tokens/s, model TFLOP/s, peak memory above the case's start and, on a GPU
    devices.toml knows, MFU and HFU against its peak; against the measured GEMM ceiling when given."""
    import torch

    from trillion.devices import lookup_device
    from trillion.models.flops import hardware_flops_per_token, model_flops_per_token
    from trillion.parallel.modes import recompute_fraction

    tokens_per_s = tokens / seconds
    tflops = tokens_per_s * model_flops_per_token(args, seq_len) / 1e12
    hardware = (
        tokens_per_s * hardware_flops_per_token(args, seq_len, recompute_fraction(checkpointing, args.n_layers)) / 1e12
    )
    spec = lookup_device(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    peak = (torch.cuda.max_memory_allocated(device) - start_bytes) / 1e9 if device.type == "cuda" else None
    row = {
        "part": "step",
        "name": name,
        "seconds": seconds,
        "tokens_per_s": tokens_per_s,
        "tflops": tflops,
        "peak_memory_gb": peak,
        "losses": ", ".join(f"{x:.3f}" for x in losses),
    }
    if spec is not None:
        row.update(mfu=tflops / spec.peak_tflops_bf16, hfu=hardware / spec.peak_tflops_bf16)
    if gemm_tflops:
        row["mfu_vs_gemm"] = tflops / gemm_tflops
    return row


def markdown(rows: list[dict], header: str) -> str:
    keys = ["part", "name"] + sorted({k for r in rows for k in r} - {"part", "name", "error"}) + ["error"]
    lines = [header, "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [f"{row[k]:.4g}" if isinstance(row.get(k), float) else str(row.get(k, "")) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU-sized inputs (seconds); Triton under its interpreter")
    parser.add_argument("--only", default="gemm,copy,kernels,step", help="comma-separated parts (and float8)")
    parser.add_argument("--out", default=str(HERE / "results"), help="folder for the .md and .jsonl files")
    opts = parser.parse_args(argv)
    if opts.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton module is imported
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not opts.smoke else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    parts = opts.only.split(",")
    stamp = datetime.datetime.now()
    header = f"## {stamp:%Y-%m-%d %H:%M}, {name}, torch {torch.__version__}{' (smoke mode)' if opts.smoke else ''}"
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"run_all-{'smoke-' if opts.smoke else ''}{stamp:%Y%m%d-%H%M%S}"
    rows = []

    def record(row: dict) -> None:
        """Keeps a measured row on disk at once: one JSON line, and the Markdown table so far."""
        rows.append(row)
        with base.with_suffix(".jsonl").open("a") as f:
            f.write(json.dumps({"device": name, "torch": torch.__version__, "smoke": opts.smoke, **row}) + "\n")
        base.with_suffix(".md").write_text(markdown(rows, header))
        print(
            f"[{time.strftime('%H:%M:%S')}] {row['part']} {row['name']}: {row.get('error', 'ok')}",
            file=sys.stderr,
            flush=True,
        )

    for part, fn in (("gemm", bench_gemm), ("copy", bench_copy), ("kernels", None)):
        if part in parts:
            try:
                if fn is None:
                    bench_kernels(device, opts.smoke, record)
                else:
                    for row in fn(device, opts.smoke):
                        record(row)
            except Exception as error:
                traceback.print_exc()
                record({"part": part, "name": part, "error": f"{type(error).__name__}: {error}"[:300]})
    gemm_tflops = next((r["tflops"] for r in rows if r["part"] == "ceiling" and "tflops" in r), None)
    if "step" in parts:
        bench_training_steps(device, opts.smoke, gemm_tflops, record)
    if "float8" in parts:
        bench_float8(device, opts.smoke, record)
    table = markdown(rows, header)  # again: the kernel rows' speed-ups are known only at the end
    base.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
