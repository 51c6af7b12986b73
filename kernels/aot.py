"""Ahead-of-time compilation of the Triton kernels for GPUs this machine does not have: each launch
the trainer makes, specialized as Triton's JIT specializes it at run time (unit strides as
constants, pointers and strides divisible by 16 marked so), compiled for sm80 (A100), sm90 (H100),
sm100 (B200, GB200), gfx90a (MI250X), gfx942 (MI300X, MI325X) and gfx950 (MI355X), with the resources read
from the compiled artifacts: registers, spills and scratch from ptxas (NVIDIA) or the AMDGPU assembly, shared
memory / LDS from Triton, the matrix instructions from the PTX (mma, wgmma, tcgen05) or the GCN assembly
(v_mfma*). sm100 and gfx950 launch the tuned configs of the part they succeed (_triton_setup.SUCCEEDS).

Results are cached on disk (TRILLION_AOT_CACHE, default ~/.cache/trillion/aot), keyed by the
kernel's source, the launch, the target and Triton's version. The command line is
kernels/report.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import itertools
import json
import os
import re
import sys
import time
from pathlib import Path

import torch
import triton

from trillion.kernels import aot_moe, norm
from trillion.kernels._triton_setup import DELTA_WARPS, config_set
from trillion.kernels.aot_moe import FLOAT8_ARCHS, FLOAT8_GEMM_KERNELS, GEMM_KERNELS, PERMUTATION_KERNELS
from trillion.kernels.aot_targets import ARCHS
from trillion.kernels.flash_attention_configs import configs
from trillion.kernels.flash_attention_launch import DELTA_BLOCK_M, kernel_args, kernel_fn
from trillion.kernels.head_dims import block_d_for, block_dims_for

# Attention head dims: one number, or (q/k, v) for latent attention (DeepSeek-V3, Kimi K2), whose
# launch has as many KV heads as query heads.
HEAD_DIMS = (64, 128, (192, 128))
ALL_HEAD_DIMS = (32, 64, 96, 128, 256, (192, 128))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The launch the report specializes for: a Llama-style layout, (batch, seq, heads, head_dim) in
# memory, 32 query heads sharing 8 KV heads; norms over 16k tokens of the presets' hidden sizes up
# to norm.MAX_FUSED_DIM (6144 compiles as 8192: the width is a run-time argument), and the wider
# rows that fall back to torch, whose report says why they do.
BATCH, SEQ, Q_HEADS, KV_HEADS = 2, 4096, 32, 8
NORM_ROWS, NORM_WIDTHS, WIDE_NORM_WIDTHS = 16384, (2048, 4096, 8192), (12288, 25600)
ATTENTION_KERNELS = ("fwd", "delta", "dkdv", "dq")
NORM_KERNELS = ("rms_fwd", "rms_bwd", "ln_fwd", "ln_bwd")
# The experts' grouped GEMM: forward, dx (the same kernel on weight transposed) and dweight, for 8192 tokens
# top-8 over 256 DeepSeek-V3/Kimi K2 experts of 7168 x 2048; every preset's shapes compile to this binary. Its
# float8 kernels (kernels/aot_moe.py) on the float8 targets only, bf16 out; the permutation on every target.
GEMM_ROWS, GEMM_GROUPS, GEMM_K, GEMM_N = 8192 * 8, 256, 7168, 2048
MATMUL_KERNELS = ("fwd", "dkdv", "dq", *GEMM_KERNELS, *FLOAT8_GEMM_KERNELS)  # must use matrix instructions
# wgmma ... .e4m3.e4m3 (sm90), v_mfma_*_fp8_fp8 (gfx942), tcgen05.mma ... kind::f8f6f4 (sm100), v_mfma_*_f8f6f4 (gfx950)
FLOAT8_INSTRUCTION = re.compile(r"e4m3|fp8|f8f6f4")


@dataclasses.dataclass(frozen=True)
class Case:
    kernel: str  # one of ATTENTION_KERNELS or NORM_KERNELS
    arch: str
    dtype: str
    size: int  # head dim (attention: of q and k) or row width (norms)
    causal: bool | None  # None for kernels without a causal variant
    config: tuple = ()  # sorted (name, value) pairs: BLOCK_M, BLOCK_N, num_warps, num_stages, AMD options
    out_size: int | None = None  # attention: v's head dim where it is not `size`; grouped GEMM: N
    documents: bool = False  # attention: with document masking (HAS_DOCS)

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.config) or "fixed"


def _config_tuple(config: triton.Config) -> tuple:
    return tuple(sorted({**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}.items()))


def cases(
    archs, head_dims=HEAD_DIMS, dtypes=tuple(DTYPES), causal_modes=(True, False), norms=True, gemms=True
) -> list[Case]:
    """Every launch the trainer can make on `archs`: each attention kernel with each config its
    autotuner may pick for the head dim (causal or not, and causal with document masking, the way training
    masks documents), the norm kernels at the presets' widths, the grouped GEMM's kernels with each of
    their configs (`gemms`: the float8 ones where float8 runs, in bf16, and the token permutation's too)."""
    out = []
    for arch, dtype in itertools.product(archs, dtypes):
        for dims in head_dims:
            d, dv = (dims, None) if isinstance(dims, int) else dims
            delta = (("BLOCK_M", DELTA_BLOCK_M),) + ((("num_warps", DELTA_WARPS[arch]),) if arch in DELTA_WARPS else ())
            out.append(Case("delta", arch, dtype, d, None, delta, dv))
            block_dims = sum(block_dims_for(d)), block_d_for(dv or d)
            masks = [(causal, False) for causal in causal_modes] + [(True, True)] * (True in causal_modes)
            for kernel, (causal, documents) in itertools.product(("fwd", "dkdv", "dq"), masks):
                out += [
                    Case(kernel, arch, dtype, d, causal, _config_tuple(c), dv, documents)
                    for c in configs(kernel, config_set(arch), *block_dims, documents)
                ]
        if norms:
            out += [Case(k, arch, dtype, w, None) for k in NORM_KERNELS for w in NORM_WIDTHS]
        if gemms:
            float8 = FLOAT8_GEMM_KERNELS if arch in FLOAT8_ARCHS and dtype == "bf16" else ()
            out += [
                Case(k, arch, dtype, GEMM_K, None, _config_tuple(c), GEMM_N)
                for k in (*GEMM_KERNELS, *float8)
                for c in aot_moe.gemm_configs(k, arch)
            ]
            warps = (("num_warps", aot_moe.permute.NUM_WARPS),)
            out += [Case(k, arch, dtype, aot_moe.PERMUTE_DIM, None, warps) for k in PERMUTATION_KERNELS]
    return out


def kernel_kind(case: Case) -> str:
    """What --kernels selects it by."""
    gemm, permutation = (*GEMM_KERNELS, *FLOAT8_GEMM_KERNELS), PERMUTATION_KERNELS
    kinds = {"attention": ATTENTION_KERNELS, "norm": NORM_KERNELS, "grouped_gemm": gemm, "permutation": permutation}
    return next(kind for kind, kernels in kinds.items() if case.kernel in kernels)


# ----------------------------------------------------------------------------- one launch
def _launch(case: Case):
    """(jit function, positional args, constexprs, compile options) of the trainer's launch, on meta
    tensors: their data pointers are 0, so they specialize as 16-byte aligned, as allocations are."""
    dtype = DTYPES[case.dtype]
    config = dict(case.config)
    options = {
        k: config.pop(k) for k in ("num_warps", "num_stages", "waves_per_eu", "matrix_instr_nonkdim") if k in config
    }
    if case.kernel in ATTENTION_KERNELS:

        def layout(heads, head_dim=case.size):
            return torch.empty(BATCH, SEQ, heads, head_dim, device="meta", dtype=dtype).transpose(1, 2)

        v_size, kv_heads = (case.size, KV_HEADS) if case.out_size is None else (case.out_size, Q_HEADS)
        q, k, dq = layout(Q_HEADS), layout(kv_heads), layout(Q_HEADS)
        v, out, grad_out = layout(kv_heads, v_size), layout(Q_HEADS, v_size), layout(Q_HEADS, v_size)
        lse, delta = (torch.empty(BATCH, Q_HEADS, SEQ, device="meta") for _ in range(2))
        grads = (layout(kv_heads), layout(kv_heads, v_size)) if case.kernel == "dkdv" else (dq,)
        bounds = tuple(torch.empty(BATCH, SEQ, device="meta", dtype=torch.int32) for _ in range(2))
        extra = dict(grad_out=grad_out, delta=delta, grads=grads, documents=bounds if case.documents else None)
        args, meta = kernel_args(case.kernel, q, k, v, out, lse, bool(case.causal), case.size**-0.5, **extra)
        return kernel_fn(case.kernel), args, {**meta, **config}, options
    if case.kernel in (*GEMM_KERNELS, *FLOAT8_GEMM_KERNELS):
        fn, args, meta = aot_moe.gemm_launch(case.kernel, dtype, case.arch, GEMM_ROWS, GEMM_GROUPS, GEMM_K, GEMM_N)
        return fn, args, {**meta, **config}, options
    if case.kernel in PERMUTATION_KERNELS:
        fn, args, meta = aot_moe.permutation_launch(case.kernel, dtype)
        return fn, args, {**meta, **config}, options
    kind, direction = case.kernel.split("_")
    x = torch.empty(NORM_ROWS, case.size, device="meta", dtype=dtype)
    w, b = torch.empty(case.size, device="meta", dtype=dtype), torch.empty(case.size, device="meta", dtype=dtype)
    stats = torch.empty(NORM_ROWS, device="meta")
    bias = b if kind == "ln" else None
    part = torch.empty(64, case.size, device="meta")
    args, meta = norm.kernel_args(
        direction,
        x,
        w,
        bias,
        torch.empty_like(x),
        stats,
        stats,
        1e-5,
        kind == "rms",
        grad=torch.empty_like(x),
        dw_part=part,
        db_part=part if bias is not None else None,
        rows_per_program=NORM_ROWS // 64,
        interpreter=False,
    )
    options["num_warps"] = meta.pop("num_warps")
    return getattr(norm.kernel_module(), f"norm_{direction}"), args, meta, options


def specialize(fn, args, constexprs) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as Triton's JIT specializes `args` at launch: integers equal
    to 1 become constants, pointers and integers divisible by 16 get the divisibility hint (except
    the kernel's do_not_specialize arguments)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    signature, constants, attrs = {}, {}, {}
    # The decorator's do_not_specialize: a JIT function keeps it, an interpreted one (in tests) in kwargs.
    kept = getattr(fn, "do_not_specialize", None) or getattr(fn, "kwargs", {}).get("do_not_specialize") or ()
    unspecialized = {fn.arg_names[n] if isinstance(n, int) else n for n in kept}
    for index, (name, arg) in enumerate(zip(fn.arg_names, args)):
        kind, spec = native_specialize_impl(BaseBackend, arg, False, name not in unspecialized, True)
        signature[name] = kind
        if kind == "constexpr":
            constants[name] = spec
        elif spec == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
    for name in fn.arg_names[len(args) :]:
        signature[name], constants[name] = "constexpr", constexprs[name]
    return signature, constants, attrs


# ----------------------------------------------------------------------------- compile and read
def _cache_dir() -> Path:
    return Path(os.environ.get("TRILLION_AOT_CACHE") or Path.home() / ".cache" / "trillion" / "aot")


def launch_key(case: Case) -> str:
    """What decides `case`'s binary, Triton's version aside: the kernel module's source, the
    specialization of the launch and the compile options. The committed report stores it, so a test
    can tell whether the report still describes the shipped kernels and configs."""
    fn, args, meta, options = _launch(case)
    signature, constants, attrs = specialize(fn, args, meta)
    source = Path(sys.modules[fn.fn.__module__].__file__).read_bytes()  # fn.fn: the Python function
    return hashlib.sha256(
        json.dumps(
            [
                hashlib.sha256(source).hexdigest(),
                fn.fn.__name__,
                signature,
                sorted(constants.items(), key=str),
                sorted(attrs.items()),
                sorted(options.items()),
                ARCHS[case.arch]["target"],
            ],
            default=str,
        ).encode()
    ).hexdigest()[:24]


def compile_case(case: Case, use_cache: bool = True) -> dict:
    """The resources of `case` compiled for its architecture (cached), or {"error": ...}."""
    key = launch_key(case)
    path = _cache_dir() / f"{key}-triton{triton.__version__}.json"
    if use_cache and path.is_file():
        return json.loads(path.read_text())
    fn, args, meta, options = _launch(case)
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        # TRITON_INTERPRET=1 at start-up makes every jit function, triton.language's own included,
        # an interpreter function, which the compiler cannot take.
        raise RuntimeError("ahead-of-time compilation needs a process started without TRITON_INTERPRET=1")
    start = time.perf_counter()
    try:
        result = _compile(case.arch, fn, *specialize(fn, args, meta), options)
    except Exception as error:  # a config that does not compile is a finding, not a crash
        message = str(error).strip().splitlines()
        result = {"error": f"{type(error).__name__}: {message[0][:300] if message else ''}"}
    result.update(key=key, compile_s=round(time.perf_counter() - start, 2))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    return result


def _compile(arch: str, fn, signature, constants, attrs, options) -> dict:
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = ARCHS[arch]
    target = GPUTarget(*spec["target"])
    log = io.StringIO()
    # ptxas prints its resource log only when asked, and only when it runs: bypass Triton's cache.
    saved = knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log
    knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = True, True
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(fn, signature, constants, attrs), target=target, options=options)
    finally:
        knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = saved
    shared = compiled.metadata.shared
    if target.backend == "cuda":
        result = _read_ptxas(log.getvalue())
        instructions = re.findall(spec["mma"], compiled.asm["ptx"])
        result["occupancy"] = _nvidia_warps_per_sm(spec, result["registers"], shared, options.get("num_warps", 4))
    else:
        result = _read_amdgcn(compiled.asm["amdgcn"])
        instructions = re.findall(spec["mma"], compiled.asm["amdgcn"])
    result.update(shared=shared, matrix_instructions=sorted(set(instructions)), matrix_count=len(instructions))
    return result


def _read_ptxas(log: str) -> dict:
    def number(pattern):
        found = re.search(pattern, log)
        return int(found.group(1)) if found else 0

    return {
        "registers": number(r"Used (\d+) registers"),
        "spill_bytes": number(r"(\d+) bytes spill stores"),
        "scratch_bytes": number(r"(\d+) bytes stack frame"),
    }


def _read_amdgcn(asm: str) -> dict:
    def number(name):
        found = re.search(rf"^\s*(?:-\s+)?\.{name}:\s+(\d+)", asm, re.M)
        return int(found.group(1)) if found else 0

    occupancy = re.search(r"; Occupancy: (\d+)", asm)
    # On CDNA .vgpr_count counts the accumulation registers (AGPRs) too: one file of 512 per lane.
    return {
        "registers": number("vgpr_count"),
        "sgprs": number("sgpr_count"),
        "spill_bytes": 4 * (number("vgpr_spill_count") + number("sgpr_spill_count")),
        "vgpr_spills": number("vgpr_spill_count"),
        "scratch_bytes": number("private_segment_fixed_size"),
        "occupancy": int(occupancy.group(1)) if occupancy else None,
    }


def _nvidia_warps_per_sm(spec: dict, registers: int, shared: int, warps: int) -> int:
    """Resident warps per SM (the compiler does not say on NVIDIA): blocks limited by the register
    file (allocated per warp in units of 256), shared memory and the warp slots."""
    per_warp = -(-registers * 32 // 256) * 256
    blocks = min(
        spec["sm_regs"] // max(per_warp * warps, 1),
        spec["sm_warps"] // warps,
        spec["sm_shared"] // shared if shared else 32,
    )
    return blocks * warps


def problems(case: Case, result: dict) -> list[str]:
    """The gates: compiles, no spills, no scratch, shared memory within the chip, matrix
    instructions in every kernel that multiplies matrices (attention's and the grouped GEMM's)."""
    if "error" in result:
        return [f"does not compile ({result['error']})"]
    found = []
    if result["spill_bytes"] or result["scratch_bytes"]:
        found.append(f"spills {result['spill_bytes']} B, scratch {result['scratch_bytes']} B")
    if result["shared"] > ARCHS[case.arch]["shared"]:
        found.append(f"shared memory {result['shared']} B over the chip's {ARCHS[case.arch]['shared']} B")
    if case.kernel in MATMUL_KERNELS and not result["matrix_instructions"]:
        found.append("no matrix instructions")
    elif case.kernel in FLOAT8_GEMM_KERNELS and not any(map(FLOAT8_INSTRUCTION.search, result["matrix_instructions"])):
        found.append("no float8 matrix instructions")
    return found


# What a report row holds besides the case and its problems.
REPORTED = (
    "registers",
    "sgprs",
    "spill_bytes",
    "vgpr_spills",
    "scratch_bytes",
    "shared",
    "occupancy",
    "matrix_instructions",
    "matrix_count",
    "error",
    "key",
    "compile_s",
)


def run(selected: list[Case], use_cache: bool = True, progress=None, known: dict | None = None) -> list[dict]:
    """Each case's report row; `known` (launch key -> an earlier report's row) spares compiling again."""
    rows = []
    for number, case in enumerate(selected, 1):
        result = (known or {}).get(launch_key(case)) or compile_case(case, use_cache)
        rows.append(
            {
                **dataclasses.asdict(case),
                "config": dict(case.config),
                **{k: result[k] for k in REPORTED if k in result},
                "problems": problems(case, result),
            }
        )
        if progress:
            progress(
                f"[{number}/{len(selected)}] {case.arch} {case.kernel} {case.dtype} {case.size}"
                f"{'' if case.out_size is None else f'/{case.out_size}'} "
                f"causal={case.causal}{' documents' if case.documents else ''} {case.label}: "
                f"{'; '.join(rows[-1]['problems']) or 'ok'}"
            )
    return rows
