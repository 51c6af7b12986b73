"""Ahead-of-time gates for sm80, sm90, sm100, gfx90a, gfx942 and gfx950, on a CPU: the committed report
(experiments/kernels/resources.json, written by `python -m trillion.kernels.report`) covers every
launch the shipped kernels and configs make and every row passes the gates; a few rows are
recompiled here to show the report is what this compiler produces; `-m slow` recompiles them all.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from tests.helpers.documentation import documentation_text
from trillion.kernels import aot, report

RECORD = Path(__file__).resolve().parents[2] / "experiments" / "kernels" / "resources.json"


@pytest.fixture(scope="module")
def record():
    data = json.loads(RECORD.read_text())
    return data, {row["key"]: row for row in data["rows"] if "key" in row}


def test_report_covers_every_shipped_config_and_every_row_passes_the_gates(record):
    data, by_key = record
    shipped = aot.cases(list(aot.ARCHS))
    missing = [c for c in shipped if aot.launch_key(c) not in by_key]
    assert not missing, (
        f"{len(missing)} launches are not in {RECORD.name} (kernels or configs changed): regenerate it "
        f"with the command at the top of RESOURCES.md; first: {missing[0]}"
    )
    failing = [
        (c.arch, c.kernel, c.dtype, c.size, c.causal, c.label, by_key[aot.launch_key(c)]["problems"])
        for c in shipped
        if by_key[aot.launch_key(c)]["problems"]
    ]
    assert not failing, failing
    for arch in aot.ARCHS:  # every kernel that multiplies matrices uses the matrix cores, float8 ones float8 cores
        rows = [r for r in data["rows"] if r["arch"] == arch and r["kernel"] in aot.MATMUL_KERNELS]
        float8 = set(aot.FLOAT8_GEMM_KERNELS) if arch in aot.FLOAT8_ARCHS else set()
        assert {r["kernel"] for r in rows} == set(aot.MATMUL_KERNELS) - set(aot.FLOAT8_GEMM_KERNELS) | float8, arch
        assert all(r["matrix_count"] > 0 for r in rows), arch
        for row in (r for r in rows if r["kernel"] in float8):
            assert any(map(aot.FLOAT8_INSTRUCTION.search, row["matrix_instructions"])), (arch, row["kernel"])
        permutation = {
            (r["kernel"], r["dtype"])
            for r in data["rows"]
            if r["arch"] == arch and r["kernel"] in aot.PERMUTATION_KERNELS
        }
        assert permutation == {(k, d) for k in aot.PERMUTATION_KERNELS for d in aot.DTYPES}, arch
    mla = {(r["arch"], r["kernel"]) for r in data["rows"] if (r["size"], r.get("out_size")) == (192, 128)}
    assert mla == {(arch, k) for arch in aot.ARCHS for k in aot.ATTENTION_KERNELS}  # latent attention's dims


def test_document_masked_configs_and_latent_attention_s_unpadded_tiles_are_reported(record):
    """Every target reports its document-masked launches (causal, each head dim) passing the gates, and the
    tiles of latent attention's 192/128 hold no padded work."""
    data, _ = record
    masked = [r for r in data["rows"] if r.get("documents")]
    reported = {(r["arch"], r["kernel"], r["size"], r.get("out_size")) for r in masked}
    heads = [(d, None) if isinstance(d, int) else d for d in aot.HEAD_DIMS]
    assert reported == {(a, k, d, dv) for a in aot.ARCHS for k in ("fwd", "dkdv", "dq") for d, dv in heads}
    assert all(r["causal"] and not r["problems"] and r["spill_bytes"] == 0 for r in masked)
    latent = [r for r in data["rows"] if (r["size"], r.get("out_size")) == (192, 128) and r["kernel"] != "delta"]
    assert latent and all(report.tile_flops(r)[0] == report.tile_flops(r)[1] for r in latent)


def test_blackwell_and_cdna4_launches_use_their_own_matrix_instructions(record):
    """sm100: every forward attention tile and every grouped GEMM (bf16 and float8) on tcgen05.mma, the float8 ones
    kind::f8f6f4 (Hopper's wgmma is gone; the narrow backward tiles may take mma.sync, which the gate accepts as on
    sm90); gfx950: CDNA4's MFMAs, 16x16x32 in bf16 where CDNA3's was 16x16x16, and the float8 products on its
    f8f6f4 ones."""
    data, _ = record
    rows = {arch: [r for r in data["rows"] if r["arch"] == arch] for arch in ("sm100", "gfx950")}
    for row in rows["sm100"]:
        if row["kernel"] == "fwd" or row["kernel"].startswith("gmm"):
            assert any(i.startswith("tcgen05.mma") for i in row["matrix_instructions"]), row
        if row["kernel"].startswith("gmm8"):
            assert any("kind::f8f6f4" in i for i in row["matrix_instructions"]), row
    matmuls = [r for r in rows["sm100"] if r["kernel"] in aot.MATMUL_KERNELS]
    tcgen05 = sum(any(i.startswith("tcgen05.mma") for i in r["matrix_instructions"]) for r in matmuls)
    docs = documentation_text()
    assert f"{tcgen05} of its {len(matmuls)} matmul launches run on tcgen05.mma" in docs
    bf16 = [r for r in rows["gfx950"] if r["kernel"] in ("fwd", "dq", "gmm_fwd") and r["dtype"] == "bf16"]
    assert bf16 and all("v_mfma_f32_16x16x32_bf16" in r["matrix_instructions"] for r in bf16)
    products = [r for r in rows["gfx950"] if r["kernel"] in ("gmm8_fwd", "gmm8_dx")]
    assert products and all(any(i.endswith("f8f6f4") for i in r["matrix_instructions"]) for r in products)


def _compiler_process(code: str, tmp_path) -> dict:
    """Runs `code` (which prints JSON) in a process without TRITON_INTERPRET: the tests' own
    interpreter setting turns every Triton jit function into one the compiler cannot take."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRILLION_AOT_CACHE"] = str(tmp_path / "cache")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.mark.parametrize("arch", list(aot.ARCHS))
def test_the_report_is_what_this_compiler_produces(record, arch, tmp_path):
    """Recompiles (no cache) the quickest forward config of the report on each architecture."""
    data, by_key = record
    quickest = min(
        (
            c
            for c in aot.cases([arch], head_dims=(128,), dtypes=("bf16",), causal_modes=(True,), norms=False)
            if c.kernel == "fwd"
        ),
        key=lambda c: by_key[aot.launch_key(c)]["compile_s"],
    )
    fresh = _compiler_process(
        f"""
import json
from trillion.kernels import aot
case = aot.{quickest!r}
result = aot.compile_case(case, use_cache=False)
print(json.dumps({{**result, "problems": aot.problems(case, result)}}))""",
        tmp_path,
    )
    assert not fresh["problems"], fresh["problems"]
    if data["triton"] == triton.__version__:
        recorded = by_key[aot.launch_key(quickest)]
        for key in ("registers", "spill_bytes", "scratch_bytes", "shared", "matrix_instructions"):
            assert fresh[key] == recorded[key], key


def test_the_norm_rows_reported_reach_the_widest_fused_row():
    from trillion.kernels.norm import MAX_FUSED_DIM

    assert max(aot.NORM_WIDTHS) == MAX_FUSED_DIM < min(aot.WIDE_NORM_WIDTHS)


def test_the_launch_is_specialized_as_the_jit_does():
    case = next(c for c in aot.cases(["sm90"], head_dims=(128,), dtypes=("bf16",), norms=False) if c.kernel == "fwd")
    fn, args, meta, options = aot._launch(case)
    signature, constants, attrs = aot.specialize(fn, args, meta)
    assert signature["Q"] == "*bf16" and signature["LSE"] == "*fp32" and signature["qk_scale"] == "fp32"
    # The model layout (batch, seq, heads, head_dim) has unit head-dim strides: constants, as the JIT makes them.
    assert constants["stride_qd"] == constants["stride_kd"] == constants["stride_od"] == 1
    divisible = {fn.arg_names[i] for (i,) in attrs}
    assert {"Q", "K", "V", "O", "LSE", "stride_qm", "stride_kn", "q_len", "kv_len"} <= divisible
    assert constants["BLOCK_D"] == 128 and constants["IS_CAUSAL"] is True and options["num_warps"] in (4, 8)


def test_the_grouped_gemm_launch_is_specialized_as_the_jit_does():
    by_kernel = {c.kernel: c for c in aot.cases(["sm90"], head_dims=(), dtypes=("bf16",), norms=False)}
    fn, args, meta, _ = aot._launch(by_kernel["gmm_fwd"])
    signature, constants, attrs = aot.specialize(fn, args, meta)
    assert signature["X"] == signature["W"] == "*bf16" and signature["OFFSETS"] == "*i32"
    assert constants["stride_xk"] == constants["stride_wn"] == constants["stride_on"] == 1
    divisible = {fn.arg_names[i] for (i,) in attrs}
    assert {"X", "W", "OUT", "OFFSETS", "K", "N", "stride_xm", "stride_wg"} <= divisible
    # the counts that routing and the expert-parallel degree change are not specialized on (no recompiles)
    assert signature["rows"] == signature["n_groups"] == "i32" and not {"rows", "n_groups"} & divisible
    fn, args, meta, _ = aot._launch(by_kernel["gmm_dx"])  # dy @ w^T: w's unit stride is now along K
    signature, constants, _ = aot.specialize(fn, args, meta)
    assert constants["stride_wk"] == 1 and "stride_wn" not in constants


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_every_preset_s_experts_run_the_reported_grouped_gemm_binaries(preset, monkeypatch):
    """The report compiles DeepSeek-V3's 7168 x 2048 experts; sizes and expert counts are run-time
    arguments, so each preset's w1/w3 (dim x ffn) and w2 (ffn x dim) launch has the same key."""
    from trillion.models import get_preset

    args = get_preset(preset)
    reported = {c: aot.launch_key(c) for c in aot.cases(list(aot.ARCHS), head_dims=(), norms=False)}
    for k, n in ((args.dim, args.moe.expert_ffn_dim), (args.moe.expert_ffn_dim, args.dim)):
        monkeypatch.setattr(aot, "GEMM_K", k)
        monkeypatch.setattr(aot, "GEMM_N", n)
        monkeypatch.setattr(aot, "GEMM_GROUPS", args.moe.n_experts)
        assert all(aot.launch_key(case) == key for case, key in reported.items()), (k, n)


def test_rows_of_an_earlier_report_are_reused_only_for_the_same_key_and_triton(tmp_path, monkeypatch):
    case = aot.cases(["gfx942"], head_dims=(), dtypes=("fp16",), norms=False)[0]
    row = {"key": aot.launch_key(case), "registers": 7, "spill_bytes": 0, "scratch_bytes": 0, "shared": 0}
    row["matrix_instructions"] = ["v_mfma_f32_16x16x16_f16"]
    earlier = tmp_path / "resources.json"
    earlier.write_text(json.dumps({"triton": triton.__version__, "rows": [row], "searches": [], "wide_norms": []}))
    monkeypatch.setattr(aot, "compile_case", lambda *a: pytest.fail("compiled a launch the earlier report holds"))
    (reused,) = aot.run([case], known=report.reusable_rows(str(earlier)))
    assert reused["registers"] == 7 and reused["problems"] == []
    earlier.write_text(json.dumps({"triton": "0.0", "rows": [row], "searches": [], "wide_norms": []}))
    assert report.reusable_rows(str(earlier)) == {}  # another compiler's rows are not this one's


def test_resources_are_read_from_ptxas_and_amdgpu_output():
    log = (
        "ptxas info    : Function properties for attn_fwd\n    112 bytes stack frame, 108 bytes spill stores, "
        "96 bytes spill loads\nptxas info    : Used 255 registers, used 1 barriers, 448 bytes cmem[0]\n"
    )
    assert aot._read_ptxas(log) == {"registers": 255, "spill_bytes": 108, "scratch_bytes": 112}
    asm = (
        "\t.amdhsa_private_segment_fixed_size 292\n; Occupancy: 2\n  - .agpr_count:     4\n    .sgpr_count:     105\n"
        "    .sgpr_spill_count: 0\n    .private_segment_fixed_size: 292\n    .vgpr_count:     256\n"
        "    .vgpr_spill_count: 102\n"
    )
    read = aot._read_amdgcn(asm)
    assert (read["registers"], read["sgprs"], read["vgpr_spills"], read["scratch_bytes"], read["occupancy"]) == (
        256,
        105,
        102,
        292,
        2,
    )


def test_gates_fail_spills_scratch_shared_memory_and_scalar_fallbacks():
    case = aot.Case("fwd", "gfx942", "bf16", 128, True)
    good = {"spill_bytes": 0, "scratch_bytes": 0, "shared": 32768, "matrix_instructions": ["v_mfma_f32_16x16x16_bf16"]}
    assert aot.problems(case, good) == []
    assert aot.problems(case, {**good, "spill_bytes": 4, "scratch_bytes": 8})
    assert aot.problems(case, {**good, "scratch_bytes": 8})
    assert aot.problems(case, {**good, "shared": 65537})
    assert aot.problems(case, {**good, "matrix_instructions": []}) == ["no matrix instructions"]
    assert aot.problems(aot.Case("rms_bwd", "gfx942", "bf16", 2048, None), {**good, "matrix_instructions": []}) == []
    assert aot.problems(case, {"error": "CompilationError: boom"})
    float8 = aot.Case("gmm8_fwd", "sm90", "bf16", 7168, None)  # a float8 kernel on bf16 instructions fails
    assert aot.problems(
        float8, {**good, "matrix_instructions": ["wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"]}
    )
    assert (
        aot.problems(float8, {**good, "matrix_instructions": ["wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"]})
        == []
    )


def test_report_command_prints_json_and_writes_markdown(tmp_path):
    markdown = tmp_path / "RESOURCES.md"
    printed = _compiler_process(
        f"""
from trillion.kernels import aot, report
aot.NORM_WIDTHS, aot.WIDE_NORM_WIDTHS = (2048,), ()
assert report.main(["--arch", "gfx90a", "--kernels", "norm", "--dtype", "fp16", "--format", "json",
                    "--markdown", {str(markdown)!r}]) == 0""",
        tmp_path,
    )
    assert {(r["kernel"], r["arch"], r["dtype"], r["size"]) for r in printed["rows"]} == {
        (k, "gfx90a", "fp16", 2048) for k in aot.NORM_KERNELS
    }
    assert all(r["registers"] > 0 and r["problems"] == [] for r in printed["rows"])
    assert "## gfx90a (0 of 4 failing)" in markdown.read_text()
    assert "| gfx90a | a ROCm build of torch with symmetric memory" in markdown.read_text()  # what async TP needs


def test_report_command_refuses_unknown_architectures():
    with pytest.raises(SystemExit):
        report.main(["--arch", "sm75"])


@pytest.mark.slow
def test_every_shipped_config_compiles_without_spills_on_every_architecture():
    """The whole grid, compiled afresh here (TRILLION_AOT_CACHE, if set, is reused)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "trillion.kernels.report", "--format", "json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=6 * 3600,
    )
    failing = [
        (r["arch"], r["kernel"], r["dtype"], r["size"], r["causal"], r["config"], r["problems"])
        for r in json.loads(result.stdout)["rows"]
        if r["problems"]
    ]
    assert not failing and result.returncode == 0, failing


def test_search_covers_tiles_warps_stages_and_amd_occupancy():
    nvidia, amd = report.search_cases("dkdv:sm90:128"), report.search_cases("fwd:gfx942:128")
    assert len(nvidia) == len(report.SEARCH_BLOCKS) * len(report.SEARCH_WARPS) * 2
    assert len(amd) == len(nvidia) * len(report.SEARCH_WAVES)
    assert {(c.kernel, c.arch, c.dtype, c.size, c.causal) for c in nvidia} == {("dkdv", "sm90", "bf16", 128, True)}
    assert all({"waves_per_eu", "matrix_instr_nonkdim"} <= dict(c.config).keys() for c in amd)
    shipped = {
        c.config for c in aot.cases(["gfx942"], head_dims=(128,), dtypes=("bf16",), norms=False) if c.kernel == "fwd"
    }
    assert shipped <= {c.config for c in amd}  # the search spans the shipped forward configs
