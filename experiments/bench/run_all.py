"""Everything users compare trainers by, in one GPU call: the machine's ceilings, attention and
norm kernels, and one-GPU training steps (tokens/s, TFLOP/s, MFU, HFU, peak memory).

    python experiments/bench/run_all.py                 # on a GPU: under 8 minutes on an H100/H200
    python experiments/bench/run_all.py --smoke         # CPU, tiny sizes, seconds (tested)
    python experiments/bench/run_all.py --only gemm,step

Each figure is the median of repeated timed runs after warm-up, on fresh random inputs, timed
with synchronized wall clocks; each result is checked for correctness before it is timed. A part
that fails is recorded with its error and the rest goes on. The table is printed and written as
Markdown and JSON (--out, default experiments/bench/results/).
"""
import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from experiments.bench.timing import median_seconds  # noqa: E402


def bench_gemm(device, smoke: bool) -> list[dict]:
    """bf16 GEMM ceiling (8192^3), checked against an fp32 product of the same operands."""
    import torch

    n = 256 if smoke else 8192
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    reference = a[:64].float() @ b.float()
    error = ((a[:64] @ b).float() - reference).abs().max().item() / reference.abs().max().item()
    if error > 2e-2:
        raise AssertionError(f"GEMM result is wrong: relative error {error:.3g}")
    seconds = median_seconds(lambda x, y: x @ y, device, warmup=3, repeats=10,
                             fresh_inputs=lambda: (torch.randn_like(a), torch.randn_like(b)))
    return [{"part": "ceiling", "name": f"gemm {n}^3 {str(dtype).split('.')[-1]}", "seconds": seconds,
             "tflops": 2 * n**3 / seconds / 1e12}]


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
    return [{"part": "ceiling", "name": f"copy {4 * numel / 2**20:.0f} MiB", "seconds": seconds,
             "gb_per_s": 2 * 4 * numel / seconds / 1e9}]


def bench_kernels(device, smoke: bool) -> list[dict]:
    """Attention and norm kernels: the rows of experiments/bench/attention.py."""
    spec = importlib.util.spec_from_file_location("bench_attention", HERE / "attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [{"part": "kernels", **row} for row in module.run(smoke=smoke)]


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
SMOKE_STEP_CASES = [("llama3-1b", "sdpa", False, "none"), ("llama3-1b", "triton", False, "full"),
                    ("gpt-1.4b", "sdpa", False, "full")]


def bench_training_steps(device, smoke: bool, gemm_tflops: float | None) -> list[dict]:
    rows = []
    for model_name, attention, compiled, checkpointing in (SMOKE_STEP_CASES if smoke else STEP_CASES):
        try:
            rows.append(bench_one_step(device, smoke, model_name, attention, compiled, checkpointing, gemm_tflops))
        except Exception as error:  # one failing case must not hide the others
            rows.append({"part": "step", "name": f"{model_name} {attention} compile={compiled} ac={checkpointing}",
                         "error": f"{type(error).__name__}: {error}"})
    return rows


def bench_one_step(device, smoke, model_name, attention, compiled, checkpointing, gemm_tflops) -> dict:
    """The trainer's own step (train_step, AdamW, its AC and compile) on fresh random tokens."""
    import torch

    from trillion.models import Transformer
    from trillion.models.flops import hardware_flops_per_token, model_flops_per_token
    from trillion.parallel.activation_checkpoint import apply_activation_checkpointing
    from trillion.parallel.modes import recompute_fraction
    from trillion.parallel.compile import apply_compile
    from trillion.devices import lookup_device
    from trillion.trainer.config import load_config
    from trillion.trainer.optim import build_optimizer
    from trillion.parallel.forward_backward import MicroBatchLoop
    from trillion.trainer.assemble import build_model_args
    from trillion.trainer.train import train_step

    shrink = ["--model.n_layers=2", "--model.dim=64", "--model.n_heads=4", "--model.n_kv_heads=4", "--model.ffn_dim=128",
              "--model.vocab_size=512"]
    seq_len, batch = (32, 2) if smoke else (2048, 4)
    config = load_config(None, [f"--model.name={model_name}", f"--kernels.attention={attention}",
                                f"--training.seq_len={seq_len}", *(shrink if smoke else [])])
    args = build_model_args(config, tokenizer_vocab=0)
    with torch.device("meta"):
        model = Transformer(args)
    apply_activation_checkpointing(model, checkpointing)
    if compiled:
        apply_compile(model)
    model.to_empty(device=device)
    model.init_weights(0)
    optimizer = build_optimizer(model, config.optimizer, device.type)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    scaler = torch.amp.GradScaler(device.type, enabled=False)

    def fresh():
        tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1), device=device)
        return ([(tokens[:, :-1], tokens[:, 1:])],)

    runner = MicroBatchLoop(model)
    losses = [train_step(runner, *fresh(), optimizer, scaler, autocast, 1.0)[0].item() for _ in range(3)]
    if not all(map(lambda x: x == x and x < 20, losses)):  # finite and sane (ln(vocab) is about 11.8)
        raise AssertionError(f"training step produced losses {losses}")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = median_seconds(lambda mb: train_step(runner, mb, optimizer, scaler, autocast, 1.0), device,
                             warmup=2, repeats=3 if smoke else 10, fresh_inputs=fresh)
    tokens_per_s = batch * seq_len / seconds
    tflops = tokens_per_s * model_flops_per_token(args, seq_len) / 1e12
    hardware = tokens_per_s * hardware_flops_per_token(args, seq_len, recompute_fraction(checkpointing, args.n_layers)) / 1e12
    spec = lookup_device(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    row = {"part": "step", "name": f"{model_name} {attention} compile={compiled} ac={checkpointing}",
           "seconds": seconds, "tokens_per_s": tokens_per_s, "tflops": tflops,
           "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None}
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
    parser.add_argument("--only", default="gemm,copy,kernels,step", help="comma-separated parts")
    parser.add_argument("--out", default=str(HERE / "results"), help="folder for the .md and .json files")
    opts = parser.parse_args(argv)
    if opts.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton module is imported
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not opts.smoke else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    parts = opts.only.split(",")
    rows, gemm_tflops = [], None
    for part, fn in (("gemm", bench_gemm), ("copy", bench_copy), ("kernels", bench_kernels)):
        if part in parts:
            try:
                new = fn(device, opts.smoke)
            except Exception as error:
                traceback.print_exc()
                new = [{"part": part, "name": part, "error": f"{type(error).__name__}: {error}"}]
            rows += new
            gemm_tflops = gemm_tflops or next((r["tflops"] for r in new if r["part"] == "ceiling" and "tflops" in r), None)
            print(f"[{time.strftime('%H:%M:%S')}] {part} done", file=sys.stderr, flush=True)
    if "step" in parts:
        rows += bench_training_steps(device, opts.smoke, gemm_tflops)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    header = f"## {stamp}, {name}, torch {torch.__version__}{' (smoke mode)' if opts.smoke else ''}"
    table = markdown(rows, header)
    print(table)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"run_all-{'smoke-' if opts.smoke else ''}{datetime.datetime.now():%Y%m%d-%H%M%S}"
    base.with_suffix(".md").write_text(table)
    base.with_suffix(".json").write_text(json.dumps({"device": name, "torch": torch.__version__, "smoke": opts.smoke,
                                                     "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
