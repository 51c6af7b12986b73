"""Mixture-of-experts benchmarks: the grouped GEMM (torch._grouped_mm; on a GPU our Triton kernel too)
against the per-expert loop (forward + backward of one projection), one MoE layer's forward + backward
with each backend and how much of it is dispatch (routing, permutation and the return to token order,
timed with the experts replaced by a copy), and training tokens/s of debug-moe against the dense debug
model (model, AdamW, one process).

    python experiments/bench/moe.py [--device cuda] [--out DIR]   # bf16 on a GPU, fp32 on the CPU
    python experiments/bench/moe.py --smoke --out DIR             # tiny sizes: the test of this script

Rows go to DIR/moe-<time>.jsonl and a table to DIR/moe-<time>.md as they are measured."""

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.bench.timing import median_seconds  # noqa: E402
from trillion.kernels.grouped_gemm import grouped_mm  # noqa: E402
from trillion.models import PRESETS, Transformer  # noqa: E402
from trillion.models.moe import MoE  # noqa: E402


def _impls(device) -> tuple:
    """The grouped GEMM backends to time: our Triton kernel too on a GPU (on CPU it would be the loop again)."""
    return ("torch", "triton", "loop") if device.type == "cuda" else ("torch", "loop")


def grouped_gemm_rows(device, dtype, sizes, repeats):
    """(tokens, dim, hidden, experts): one projection's forward + backward, tokens spread evenly."""
    for tokens, dim, hidden, experts in sizes:
        x = torch.randn(tokens, dim, device=device, dtype=dtype, requires_grad=True)
        weight = torch.randn(experts, dim, hidden, device=device, dtype=dtype, requires_grad=True)
        offsets = (torch.arange(1, experts + 1, device=device) * (tokens // experts)).to(torch.int32)
        row = {"part": "grouped_gemm", "tokens": tokens, "dim": dim, "hidden": hidden, "experts": experts}
        for impl in _impls(device):
            row[f"{impl}_ms"] = 1e3 * median_seconds(
                lambda: grouped_mm(x, weight, offsets, impl).sum().backward(), device, warmup=2, repeats=repeats
            )
        row["speedup"] = row["loop_ms"] / row["torch_ms"]
        yield row


class _CopyExperts(torch.nn.Module):
    """Experts that return their rows: what is left of the layer is routing and permutation."""

    def __init__(self, n_experts: int, permute_impl: str):
        super().__init__()
        self.w1 = torch.empty(n_experts, 0, 0)  # run_experts reads the expert count from it
        self.permute_impl = permute_impl  # and the permutation's backend (kernels.permutation)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return rows * weights.unsqueeze(-1).to(rows.dtype)  # the routing weights, as the experts apply them


def layer_rows(device, dtype, tokens, repeats):
    """debug-moe's MoE layer, forward + backward, per backend, and with the experts replaced by a copy."""
    args = PRESETS["debug-moe"]
    x = torch.randn(1, tokens, args.dim, device=device, dtype=dtype, requires_grad=True)
    for impl in _impls(device):
        layer = MoE(args.dim, dataclasses.replace(args.moe, experts_impl=impl)).to(device=device, dtype=dtype)
        for param in layer.parameters():
            torch.nn.init.normal_(param, std=0.02)
        full = median_seconds(lambda: layer(x).sum().backward(), device, warmup=2, repeats=repeats)
        layer.experts = _CopyExperts(args.moe.n_experts, layer.moe.permute_impl)  # routing and permutation only
        dispatch = median_seconds(lambda: layer(x).sum().backward(), device, warmup=2, repeats=repeats)
        yield {
            "part": "moe_layer",
            "impl": impl,
            "tokens": tokens,
            "layer_ms": 1e3 * full,
            "dispatch_ms": 1e3 * dispatch,
            "dispatch_share": dispatch / full,
        }


def training_rows(device, dtype, batch, seq_len, steps):
    """Tokens/s of a model's forward + backward + AdamW step, debug against debug-moe (same attention)."""
    for name in ("debug", "debug-moe"):
        with torch.device("meta"):
            model = Transformer(dataclasses.replace(PRESETS[name], max_seq_len=max(seq_len, 16)))
        model.to_empty(device=device)
        model.init_weights(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, 256, (batch, seq_len + 1), device=device)
        autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

        def step():
            with autocast:
                logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        seconds = median_seconds(step, device, warmup=2, repeats=steps)
        yield {"part": "training", "model": name, "tokens_per_s": batch * seq_len / seconds, "step_ms": 1e3 * seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default="experiments/bench/results")
    options = parser.parse_args()
    device = torch.device(options.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if options.smoke:
        sizes, tokens, batch, seq_len, repeats = [(256, 64, 64, 8)], 256, 2, 32, 2
    elif device.type == "cuda":
        sizes, tokens, batch, seq_len, repeats = [(16384, 2048, 768, 128), (32768, 4096, 1536, 16)], 16384, 8, 1024, 10
    else:
        sizes, tokens, batch, seq_len, repeats = [(4096, 256, 256, 8), (8192, 512, 512, 16)], 4096, 8, 256, 5
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"moe-{time.strftime('%Y%m%d-%H%M%S')}"
    rows = []
    with open(f"{stem}.jsonl", "w") as jsonl:
        parts = (
            grouped_gemm_rows(device, dtype, sizes, repeats),
            layer_rows(device, dtype, tokens, repeats),
            training_rows(device, dtype, batch, seq_len, repeats),
        )
        for part in parts:
            for row in part:
                row |= {"device": str(device), "dtype": str(dtype).removeprefix("torch.")}
                jsonl.write(json.dumps(row) + "\n")
                jsonl.flush()
                rows.append(row)
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    Path(f"{stem}.md").write_text(markdown(rows))
    return 0


def markdown(rows: list[dict]) -> str:
    """One table per part, its columns those of its rows."""
    text = "# MoE benchmarks\n\n"
    for part in dict.fromkeys(row["part"] for row in rows):
        of_part = [row for row in rows if row["part"] == part]
        keys = [k for k in of_part[0] if k != "part"]
        text += f"{part}:\n\n| {' | '.join(keys)} |\n|{'---|' * len(keys)}\n"
        for row in of_part:
            cells = (f"{row[k]:.3g}" if isinstance(row[k], float) else str(row[k]) for k in keys)
            text += f"| {' | '.join(cells)} |\n"
        text += "\n"
    return text


if __name__ == "__main__":
    sys.exit(main())
