"""The kernel resource report: every Triton kernel with every shipped config, compiled ahead of time
for sm80 (A100), sm90 (H100), sm100 (B200, GB200), gfx90a (MI250X), gfx942 (MI300X, MI325X) and gfx950 (MI355X) on a
machine without a GPU.

    python -m trillion.kernels.report --arch gfx90a,gfx942,gfx950,sm80,sm90,sm100 --format json
    python -m trillion.kernels.report --markdown experiments/kernels/RESOURCES.md \
--json experiments/kernels/resources.json
    python -m trillion.kernels.report --search dkdv:sm90:128     # every candidate tile of one kernel
    python -m trillion.kernels.report --reuse experiments/kernels/resources.json ...  # compile only what changed

Attention (forward, delta, dK/dV, dQ) at head dims 64, 128 and latent attention's 192/128 (--all: 32
to 256 too), bf16 and fp16, causal and not, each config its autotuner may pick; RMSNorm and LayerNorm
forward and backward at the presets' hidden sizes; the experts' grouped GEMM (forward, dx, dweight)
with each of its configs, its float8 kernels on sm90, sm100, gfx942 and gfx950 (which must use float8 matrix
instructions), and the fused token permutation.
Registers, spills, scratch, shared memory / LDS, occupancy and the matrix
instructions come from the compiled artifacts (kernels/aot.py). Exit status 1 when a config fails a
gate (does not compile, spills, uses scratch, exceeds shared memory, or a matmul kernel has no
matrix instructions).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import re
import sys
from pathlib import Path

import triton

from trillion.kernels import aot, aot_moe, norm
from trillion.kernels._triton_setup import config_set
from trillion.kernels.head_dims import block_d_for, block_dims_for

# The search grid: tiles, warps and stages (and on CDNA the occupancy target) around the shipped ones.
SEARCH_BLOCKS = ((16, 64), (32, 32), (32, 64), (32, 128), (64, 32), (64, 64), (64, 128), (128, 32), (128, 64))
SEARCH_WARPS = (4, 8)
SEARCH_STAGES = {"cuda": (2, 3), "hip": (1, 2)}
SEARCH_WAVES = (1, 2)


def search_cases(spec: str) -> list[aot.Case]:
    """Candidate configs of `spec` = KERNEL:ARCH:HEAD_DIM[/V_HEAD_DIM][:documents] (bf16, causal; documents:
    with document masking)."""
    kernel, arch, dims, *masked = spec.split(":")
    head_dim, _, v_head_dim = dims.partition("/")
    backend = aot.ARCHS[arch]["target"][0]
    out = []
    for (bm, bn), warps, stages in itertools.product(SEARCH_BLOCKS, SEARCH_WARPS, SEARCH_STAGES[backend]):
        base = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
        extras = [{"waves_per_eu": w, "matrix_instr_nonkdim": 16} for w in SEARCH_WAVES] if backend == "hip" else [{}]
        out += [
            aot.Case(
                kernel,
                arch,
                "bf16",
                int(head_dim),
                True,
                tuple(sorted({**base, **e}.items())),
                int(v_head_dim) if v_head_dim else None,
                masked == ["documents"],
            )
            for e in extras
        ]
    return out


def search(spec: str, use_cache: bool = True, progress=None) -> dict:
    rows = aot.run(search_cases(spec), use_cache, progress)
    return {"spec": spec, "rows": rows, "spill_free": [r["config"] for r in rows if not r["problems"]]}


KINDS = ("attention", "norm", "grouped_gemm", "permutation")


def reusable_rows(path: str) -> dict[str, dict]:
    """The rows of an earlier JSON report by launch key, where it was made with this Triton: a key
    hashes the kernel's source, the launch's specialization and the target, so a row whose key
    matches is what compiling again would give."""
    earlier = json.loads(Path(path).read_text())
    if earlier["triton"] != triton.__version__:
        return {}
    everything = earlier["rows"] + earlier["wide_norms"] + [r for s in earlier["searches"] for r in s["rows"]]
    return {row["key"]: row for row in everything if "key" in row and "error" not in row}


# Per attention tile (BLOCK_M queries x BLOCK_N keys), the matmuls' widths in q/k and v head dims: the forward's
# QK^T and PV; dK/dV's S^T again, dV, dP^T and dK; dQ's S again, dP and dQ.
TILE_MATMULS = {"fwd": (1, 1), "dkdv": (2, 2), "dq": (2, 1)}


def tile_flops(row: dict) -> tuple[int, int] | None:
    """(FLOPs one tile of an attention matmul kernel executes, padding included; those of them that are useful),
    or None for other kernels."""
    if row["kernel"] not in TILE_MATMULS:
        return None
    qk_matmuls, v_matmuls = TILE_MATMULS[row["kernel"]]
    d, dv = row["size"], row.get("out_size") or row["size"]
    pairs = 2 * row["config"]["BLOCK_M"] * row["config"]["BLOCK_N"]
    executed = pairs * (qk_matmuls * sum(block_dims_for(d)) + v_matmuls * block_d_for(dv))
    return executed, pairs * (qk_matmuls * d + v_matmuls * dv)


def _tile_cell(row: dict) -> str:
    flops = tile_flops(row)
    if flops is None:
        return "-"
    executed, useful = flops
    return f"{executed / 1e6:.2f}M ({100 * (executed - useful) / executed:.0f}% padding)"


def _cell(row: dict, key: str) -> str:
    value = row.get(key)
    return "-" if value is None else str(value)


def _short(instruction: str) -> str:
    """mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 -> mma.m16n8k16; AMD names stay whole."""
    parts = instruction.split(".")
    shape = [p for p in parts if re.fullmatch(r"m\d+n\d+k\d+", p)]
    return ".".join(parts[:1] + shape)


def _table(rows: list[dict]) -> list[str]:
    lines = [
        (
            "| kernel | dtype | size | causal | documents | config | regs | spill B | scratch B | shared B | occupancy "
            "| matrix instr. | tile FLOPs | gate |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        config = (
            " ".join(f"{k.replace('matrix_instr_nonkdim', 'nonkdim')}={v}" for k, v in row["config"].items()) or "-"
        )
        regs = _cell(row, "registers") + (f" (+{row['sgprs']} s)" if row.get("sgprs") else "")
        instructions = ", ".join(_short(i) for i in row.get("matrix_instructions", [])) or "none"
        size = f"{row['size']}/{row['out_size']}" if row.get("out_size") else row["size"]
        lines.append(
            f"| {row['kernel']} | {row['dtype']} | {size} | {_cell(row, 'causal')} | "
            f"{'masked' if row.get('documents') else '-'} | {config} | {regs} | "
            f"{_cell(row, 'spill_bytes')} | {_cell(row, 'scratch_bytes')} | {_cell(row, 'shared')} | "
            f"{_cell(row, 'occupancy')} | {instructions} | {_tile_cell(row)} | {'; '.join(row['problems']) or 'ok'} |"
        )
    return lines


def _instruction_summary(arch: str, rows: list[dict]) -> str:
    """Which matrix instructions the arch's matmul launches use (each launch counted under its widest family:
    tcgen05 or wgmma before mma.sync), and whose tuned configs it launches."""
    matmuls = [r for r in rows if r["kernel"] in aot.MATMUL_KERNELS]
    counts: dict[str, int] = {}
    for row in matmuls:
        families = {i.split(".")[0].split("_f32")[0] for i in row.get("matrix_instructions", [])}
        widest = next((f for f in ("tcgen05", "wgmma") if f in families), min(families, default="none"))
        counts[widest] = counts.get(widest, 0) + 1
    used = ", ".join(f"{family} in {count}" for family, count in sorted(counts.items()))
    carried = config_set(arch)
    configs = f"; the {carried} configs (kernels/_triton_setup.py SUCCEEDS)" if carried != arch else ""
    return f"Matrix instructions of its {len(matmuls)} matmul launches: {used}{configs}."


def wide_norm_cases(archs) -> list[aot.Case]:
    """The norm backward at rows wider than norm.MAX_FUSED_DIM: not launched (torch takes them),
    compiled to show why."""
    return [
        aot.Case(k, arch, "bf16", w, None)
        for arch in archs
        for k in ("rms_bwd", "ln_bwd")
        for w in aot.WIDE_NORM_WIDTHS
    ]


# What async TP (parallel.async_tp) needs of a target, by its compiler backend: torch's fused collective-GEMM ops, not a
# kernel of this package, listed beside the kernels so that one report says what a machine must have.
ASYNC_TP_NEEDS = {
    "cuda": "torch's CUDA symmetric memory (the tp group's buffers mapped into each other's address space through the "
    "driver's virtual-memory API, so the GPUs must reach each other's memory: NVLink, or PCIe peer access) and "
    "torch.compile with Inductor (its micro-pipeline TP pass); each per-rank step moves on a copy engine",
    "hip": "a ROCm build of torch with symmetric memory (torch's HIP port, pytorch PR 150580, has no multicast) and "
    "torch.compile with Inductor; where the build has none (torch.distributed._symmetric_memory.get_backend is None) "
    "parallel.async_tp is refused and parallel.tp_overlap runs on RCCL",
}


def async_tp_section(archs) -> list[str]:
    """The report's table of what async TP needs on each of `archs` (ASYNC_TP_NEEDS), float8 where it has the units."""
    lines = [
        "## What async TP (parallel.async_tp) needs on each target (torch's ops: nothing here compiles them)",
        "",
        "| target | needs | float8 |",
        "|---|---|---|",
    ]
    for arch in archs:
        float8 = (
            "the scaled variants (fused_all_gather_scaled_matmul, fused_scaled_matmul_reduce_scatter)"
            if arch in aot_moe.FLOAT8_ARCHS
            else "none: no float8 matrix units, bf16 and fp16 only"
        )
        lines.append(f"| {arch} | {ASYNC_TP_NEEDS[aot.ARCHS[arch]['target'][0]]} | {float8} |")
    return lines + [""]


def markdown(rows: list[dict], searches: list[dict], command: str, wide_norms: list[dict] = ()) -> str:
    failing = [r for r in rows if r["problems"]]
    lines = [
        "# Kernel resources (ahead-of-time compilation, no GPU)",
        "",
        f"Generated by `{command}` on {datetime.date.today()} with Triton {triton.__version__}; do not edit.",
        "Each row is one launch the trainer can make, compiled for the architecture with the JIT's run-time",
        f"specialization (attention: batch {aot.BATCH}, sequence {aot.SEQ}, {aot.Q_HEADS} query and {aot.KV_HEADS} "
        "KV heads in the (batch, seq, heads, head_dim) layout,",
        f"latent attention's 192/128 with {aot.Q_HEADS} KV heads; norms: {aot.NORM_ROWS} rows; grouped GEMM: "
        f"{aot.GEMM_ROWS} rows over {aot.GEMM_GROUPS} experts).",
        "Size is the head dim (attention; q-k/v where they differ), the row width (norms) or K/N (grouped GEMM:",
        "gmm_fwd is x (rows, K) @ w (K, N) per expert, gmm_dx the same kernel on w transposed, gmm_dw x^T dy per",
        "expert; the sizes are run-time arguments, so every preset's expert shapes compile to these binaries;",
        "gmm8_* the same in float8 with DeepSeek-V3's 1 x 128 / 128 x 128 scales, *_rowwise with rowwise ones, on",
        "sm90, sm100 and gfx950 (e4m3fn) and gfx942 (e4m3fnuz) with bf16 out; perm_*/comb_fwd the fused permutation",
        f"and combine of {aot_moe.PERMUTE_TOKENS} tokens,",
        f"top-{aot_moe.PERMUTE_TOP_K}, size the row width).",
        "Documents: masked rows are launches with document masking (causal, as training masks documents). Tile",
        "FLOPs: what one BLOCK_M x BLOCK_N tile's matmuls execute, and the share of it spent on padding the head",
        "dims to the kernels' power-of-two blocks (latent attention's 192 runs as 128 + 64: none).",
        "Registers are per thread (NVIDIA) or VGPRs incl. AGPRs per lane",
        "(AMD, SGPRs in brackets); occupancy is what the AMD compiler reports (waves per SIMD) and, on NVIDIA,",
        "resident warps per SM computed from registers and shared memory.",
        "",
        f"**{len(rows)} configs, {len(failing)} failing a gate.**",
        "",
    ]
    for arch in dict.fromkeys(r["arch"] for r in rows):
        mine = [r for r in rows if r["arch"] == arch]
        lines += [f"## {arch} ({sum(bool(r['problems']) for r in mine)} of {len(mine)} failing)", ""]
        lines += [_instruction_summary(arch, mine), "", *_table(mine), ""]
    if wide_norms:
        lines += [
            f"## Norm backward beyond {norm.MAX_FUSED_DIM} columns (not launched: torch's kernels take these rows)",
            "",
            "Compiled at the tile the trainer would launch (one row per program, 16 warps). The backward",
            "holds a row of x, dy and the dw/db partial sums in registers: where these rows spill, the",
            "fused kernels stop, at `MAX_FUSED_DIM` in kernels/norm.py.",
            "",
            *_table(wide_norms),
            "",
        ]
    for found in searches:
        lines += [
            f"## Search: {found['spec']} (bf16, causal), {len(found['spill_free'])} of {len(found['rows'])} pass",
            "",
            *_table(found["rows"]),
            "",
        ]
    lines += async_tp_section(dict.fromkeys(r["arch"] for r in rows))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trillion.kernels.report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--arch", default=",".join(aot.ARCHS), help="comma-separated: " + ", ".join(aot.ARCHS))
    parser.add_argument("--all", action="store_true", help=f"head dims {aot.ALL_HEAD_DIMS} instead of {aot.HEAD_DIMS}")
    parser.add_argument("--dtype", default=",".join(aot.DTYPES), help="comma-separated: " + ", ".join(aot.DTYPES))
    parser.add_argument("--kernels", default=",".join(KINDS), help="comma-separated: " + ", ".join(KINDS))
    parser.add_argument("--format", choices=("table", "json"), default="table", help="what to print on stdout")
    parser.add_argument("--markdown", metavar="FILE", help="also write the Markdown report here (RESOURCES.md)")
    parser.add_argument("--json", metavar="FILE", help="also write the JSON report here")
    parser.add_argument(
        "--search",
        action="append",
        default=[],
        metavar="KERNEL:ARCH:HEAD_DIM[/V_HEAD_DIM][:documents]",
        help="also compile every candidate tile of a kernel (fwd, dkdv, dq) on an architecture (e.g. dkdv:sm80:192/128,"
        " fwd:gfx942:64:documents)",
    )
    parser.add_argument("--no-cache", action="store_true", help="recompile what the cache already holds")
    parser.add_argument(
        "--reuse", metavar="FILE", help="take the rows of an earlier JSON report whose launch key and Triton match"
    )
    opts = parser.parse_args(argv)
    archs, dtypes, kinds = opts.arch.split(","), opts.dtype.split(","), set(opts.kernels.split(","))
    unknown = sorted(set(archs) - set(aot.ARCHS)) + sorted(set(dtypes) - set(aot.DTYPES)) + sorted(kinds - set(KINDS))
    if unknown:
        parser.error(
            f"unknown {', '.join(unknown)}: --arch takes {', '.join(aot.ARCHS)}; --dtype "
            f"{', '.join(aot.DTYPES)}; --kernels {', '.join(KINDS)}"
        )
    head_dims = aot.ALL_HEAD_DIMS if opts.all else aot.HEAD_DIMS
    selected = [c for c in aot.cases(archs, head_dims, tuple(dtypes)) if aot.kernel_kind(c) in kinds]
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    known = reusable_rows(opts.reuse) if opts.reuse and not opts.no_cache else {}
    rows = aot.run(selected, not opts.no_cache, progress=say, known=known)
    searches = [search(spec, not opts.no_cache, progress=say) for spec in opts.search]
    wide = aot.run(wide_norm_cases(archs), not opts.no_cache, progress=say, known=known) if "norm" in kinds else []
    report = {"triton": triton.__version__, "rows": rows, "searches": searches, "wide_norms": wide}
    command = " ".join(["python -m trillion.kernels.report", *(sys.argv[1:] if argv is None else argv)])
    if opts.markdown:
        Path(opts.markdown).write_text(markdown(rows, searches, command, wide))
    if opts.json:
        Path(opts.json).write_text(json.dumps(report, indent=0) + "\n")
    if opts.format == "json":
        print(json.dumps(report, indent=1))
    else:
        print("\n".join(_table(rows)))
    failing = sum(bool(r["problems"]) for r in rows)
    say(f"{len(rows)} kernel configs compiled, {failing} failing a gate")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
