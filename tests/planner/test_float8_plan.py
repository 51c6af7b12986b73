"""`trillion plan --float8`: the blocks' linears on the fp8 tensor cores, their casts, FSDP's float8
all-gather; refused where the device has no float8; the float8 rows of the validation.

The expected change of the step is computed here from the model's shapes and the sourced figures
(H100 SXM datasheet peaks, the [mamf] bf16 and fp8 plateaus, the profile's bandwidths), written out
as numbers, not by calling the planner's cost functions."""

import json

import pytest

from experiments.validation.predictions import RUNS_FILE, evaluate_all
from trillion.devices import fitted_constants
from trillion.errors import ConfigError
from trillion.models.presets import get_preset
from trillion.parallel.planner.hardware import load_profile
from trillion.parallel.planner.memory import float8_numel, tp_local_linears
from trillion.parallel.planner.search import Request, search
from trillion.trainer.cli.main import main as trillion
from trillion.trainer.config.schema import load_config

# llama3-8b: dim 4096, 32 query heads and 8 key/value heads of 128, SwiGLU 14336, 32 layers
LAYERS, H, KV, F = 32, 4096, 1024, 14336
LINEARS = [(H, H), (H, KV), (H, KV), (H, H), (H, F), (F, H), (H, F)]  # (k, n): wq wk wv wo w1 w2 w3
# dgx-h100: H100 SXM [nv-h100] bf16 989.4 and fp8 1979 TFLOP/s dense, [mamf] plateaus 0.803 and 0.709,
# HBM 3350 GB/s at 0.8, 5 us per launch, NVLink 450 GB/s per direction at 0.8 collective efficiency; compute-bound
# kernels keep the Hopper family's fitted share of those rates through a step (trillion/fitted.toml `sustained`)
SUSTAINED = next(e["value"] for e in fitted_constants() if e["field"] == "sustained" and "h100" in e["devices"])
BF16_RATE = 989.4e12 * 0.803 * SUSTAINED
FP8_RATE = 1979.0e12 * 0.709 * SUSTAINED
MEMORY = 3350e9 * 0.8
LAUNCH = 5e-6
NVLINK = 450e9 * 0.8

PLAN = [
    "plan",
    "--model",
    "llama3-8b",
    "--hardware",
    "dgx-h100",
    "--gpus",
    "8",
    "--global-batch",
    "16",
    "--seq-len",
    "8192",
    "--compile",
    "--format",
    "json",
    "--config-out",
    "",
]
# one layout, so that both plans time the same one: FSDP over the 8 GPUs, micro-batch 1 (two per step)
MICRO_BATCH, MICROBATCHES = 1, 2
LAYOUT = [
    "--tp",
    "1",
    "--pp",
    "1",
    "--cp",
    "1",
    "--dp-shard",
    "8",
    "--dp-shard-mode",
    "zero3",
    "--micro-batch-size",
    str(MICRO_BATCH),
    "--activation-checkpoint",
    "selective",
]


def expected_float8_change() -> float:
    """Seconds float8 adds to (negative: takes off) the step of PLAN + LAYOUT."""
    tokens = MICRO_BATCH * 8192
    recomputed = LAYERS // 2  # selective: every second block's forward runs again in backward
    saved = casts_forward = casts_backward = 0.0
    for k, n in LINEARS:
        flops = 2.0 * tokens * k * n
        # every GEMM here is compute-bound at both rates (the roofline does not decide)
        assert flops / FP8_RATE > (tokens * k + k * n + 2 * tokens * n) / MEMORY
        saved += flops / BF16_RATE - flops / FP8_RATE  # one pass; the launch overhead is the same
        casts_forward += 3 * (tokens * k + k * n) / MEMORY + 2 * LAUNCH  # input, weight: read 2, write 1 byte
        casts_backward += 3 * (tokens * n + k * n) / MEMORY + 2 * LAUNCH  # output's gradient, weight again
        casts_backward += 3 * tokens * k / MEMORY + LAUNCH  # the saved input again
    per_microbatch = LAYERS * (casts_forward + casts_backward - 3 * saved) + recomputed * (casts_forward - saved)
    # FSDP (zero3, 8 GPUs in a node): the converted weights gather at 1 byte instead of 2; per
    # micro-batch the first block's all-gathers (forward, backward) and the copies out of the gather
    # buffer (forward and backward, every block) are exposed, the rest hides behind compute
    converted = LAYERS * sum(k * n for k, n in LINEARS)
    gather = 7 / 8 * converted / NVLINK  # ring all-gather of `converted` bytes fewer
    exposed_gathers = 2 * gather / LAYERS
    copies = 2 * (4 - 2) * converted / MEMORY  # read + write of 1 byte instead of 2
    return MICROBATCHES * (per_microbatch - exposed_gathers - copies)


def plan(capsys, *extra: str) -> dict:
    assert trillion([*PLAN, *LAYOUT, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_figures_written_here_are_the_shipped_ones():
    args, hw = get_preset("llama3-8b"), load_profile("dgx-h100")
    assert [(k, n) for k, n, _ in tp_local_linears(args, 1)] == LINEARS and args.n_layers == LAYERS
    device = hw.device
    assert device.peak_tflops["bf16"] * 1e12 * device.gemm_share_of_peak(1e12) * device.sustained == pytest.approx(
        BF16_RATE
    )
    assert device.peak_tflops["fp8"] * 1e12 * device.gemm_share_of_peak(1e12, "fp8") * device.sustained == (
        pytest.approx(FP8_RATE)
    )
    assert device.memory_bandwidth_gbs * 1e9 * device.memory_efficiency == pytest.approx(MEMORY)
    assert device.kernel_overhead_us * 1e-6 == pytest.approx(LAUNCH)
    assert hw.collective_link(8, False, "all_gather")[0] == pytest.approx(NVLINK)


def test_float8_changes_the_predicted_step_by_the_modelled_amount(capsys):
    bf16, fp8 = plan(capsys), plan(capsys, "--float8")
    assert len(bf16["candidates"]) == len(fp8["candidates"]) == 1
    before, after = bf16["candidates"][0], fp8["candidates"][0]
    change = expected_float8_change()
    assert before["microbatches"] == MICROBATCHES and before["memory_gb"] < 72  # it fits: one candidate
    assert -0.3 < change / before["step_time_s"] < -0.1  # about a fifth of the step
    assert after["step_time_s"] - before["step_time_s"] == pytest.approx(change, rel=1e-6)
    # the output says float8: the request and the row
    assert fp8["request"]["float8"] is True and after["float8"] is True
    assert bf16["request"]["float8"] is False and before["float8"] is False


def test_the_table_says_float8_and_the_written_config_trains_in_float8(tmp_path, capsys):
    out = tmp_path / "best.toml"
    assert trillion([*PLAN[: PLAN.index("--format")], *LAYOUT, "--float8", "--config-out", str(out)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "float8 linears" in first
    config = load_config(str(out))
    assert config.float8.enabled and config.float8.recipe == "tensorwise" and config.compile.enabled


def test_output_projection_and_unaligned_linears_stay_bf16():
    import dataclasses

    args = get_preset("llama3-8b")
    assert float8_numel(args, LAYERS, 1) == LAYERS * sum(k * n for k, n in LINEARS)  # no output, no embedding
    assert float8_numel(args, LAYERS, 2) == float8_numel(args, LAYERS, 1) // 2  # TP splits each weight
    odd = dataclasses.replace(args, ffn_dim=14344 + 1)  # the feed-forward's features not multiples of 16
    assert [c for _, _, c in tp_local_linears(odd, 1)] == [True, True, True, True, False, False, False]
    assert float8_numel(odd, 1, 1) == H * H * 2 + H * KV * 2
    # the features as each TP rank holds them decide (parallel/float8.py): 4096 / 1024 = 4, 14336 / 1024 = 14
    assert [c for _, _, c in tp_local_linears(args, 1024)] == [False] * 7


@pytest.mark.parametrize("hardware,device", [("dgx-a100", "a100"), ("frontier", "mi250x-gcd")])
def test_float8_is_refused_without_float8_tensor_cores(hardware, device, capsys):
    request = Request("llama3-8b", get_preset("llama3-8b"), load_profile(hardware), 8, 16, 8192, fixed={"float8": True})
    with pytest.raises(ConfigError, match=f"--float8: hardware profile '{hardware}' \\({device}\\) has no float8"):
        search(request)
    argv = ["plan", "--model", "llama3-8b", "--hardware", hardware, "--gpus", "8", "--global-batch", "16"]
    assert trillion([*argv, "--float8", "--config-out", ""]) == 2
    err = capsys.readouterr().err
    assert hardware in err and "float8" in err and "Traceback" not in err


def test_float8_plans_on_mi300x_with_its_declared_plateau():
    devices = (RUNS_FILE.parents[2] / "trillion" / "devices.toml").read_text()
    assert "# assumed: the bf16 plateau (as a share of the fp8 peak); [mamf]'s fp8 table lists MI300X" in devices
    hw = load_profile("mi300x")
    assert hw.device.peak_tflops["fp8"] == 2614.9 and hw.device.gemm_share_of_peak(1e12, "fp8") == 0.514
    request = Request("llama3-8b", get_preset("llama3-8b"), hw, 8, 16, 8192, fixed={"float8": True, "compile": True})
    bf16 = Request("llama3-8b", get_preset("llama3-8b"), hw, 8, 16, 8192, fixed={"compile": True})
    assert search(request).ranked[0].step.total < search(bf16).ranked[0].step.total


def test_the_float8_rows_are_reported_with_their_familys_fit():
    """One scalar per device family: the float8 rows are in the fit of their family's `sustained` (fitted.toml) with
    the bf16 ones, Hopper's and CDNA3's, each reported with its leave-one-out error."""
    float8 = [r for r in evaluate_all() if r["run"]["layout"].get("float8") and r["run"]["model"] == "llama3-8b"]
    records = [r for r in float8 if r["run"]["layout"].get("float8_recipe", "tensorwise") == "tensorwise"]
    assert {r["run"]["id"]: r["fitted"]["family"].split()[0] for r in records} == {
        "torchtitan-8b-8gpu-compile-float8": "Hopper",
        "torchtitan-8b-128gpu-compile-float8": "Hopper",
        "trainy-h200-8b-32gpu-compile-float8": "Hopper",
        "trainy-h200-8b-64gpu-compile-float8": "Hopper",
        "te79-mi300x-8b-fp8-bsz2": "CDNA3",
        "te79-mi300x-8b-fp8-bsz4": "CDNA3",
    }
    written = (RUNS_FILE.parent / "VALIDATION.md").read_text()
    for r in records:
        assert r["fitted"]["field"] == "sustained" and r["run"]["metric"] == "tokens_per_s_per_gpu"
        source = r["run"]["source"]
        assert any(
            (
                "llama3_h100_202412" in source and "Float8" in source,
                "llama3-8b_h200_202506_trainy" in source,
                "ROCm/TransformerEngine issue 79" in source and "FP8" in source,
            )
        ), r["run"]["id"]
        row = f"| {r['run']['id']} |"
        line = next(line for line in written.splitlines() if line.startswith(row))
        assert f"| {100 * r['error']:+.1f}% | yes (sustained {r['loo_value']:.3f} without it): " in line
        assert f"{100 * r['loo_error']:+.1f}%" in line and "float8" in line


def test_float8_tp_gathers_activations_in_float8_and_reduce_scatters_in_bf16():
    """torchao's float8 TP styles (the trainer's under tensorwise float8: parallel/float8.py tp_styles) cast a
    sublayer's input to float8 before TP's all-gather, and the gradient of its rowwise output before the all-gather
    that is the reduce-scatter's backward; the reduce-scatters stay bf16. Per layer and pass, two all-gathers of a
    micro-batch's tokens x dim move 1 byte per element instead of 2: on 8 GPUs of a node, a ring all-gather sends
    7/8 of the payload over NVLink at the rate written above."""
    from trillion.parallel.planner.block_cost import layer_passes, tp_gather_bytes

    args, hw = get_preset("llama3-8b"), load_profile("dgx-h100")
    tokens = 8192  # micro-batch 1 at seq 8192
    assert all(converted for _, _, converted in tp_local_linears(args, 8))  # every linear's shard is 16-aligned
    bf16 = layer_passes(args, hw, 1, 8192, 8, True)
    fp8 = layer_passes(args, hw, 1, 8192, 8, True, float8="tensorwise")
    saved = 2 * 7 / 8 * tokens * H * (2 - 1) / NVLINK
    assert bf16.tp_forward - fp8.tp_forward == pytest.approx(saved)
    assert bf16.tp_backward - fp8.tp_backward == pytest.approx(saved)
    assert tp_gather_bytes(args, 8, "", None, 2) == ((2, 2), (2, 2))
    # MLA gathers its input for replicated down projections, which no float8 style prepares
    assert tp_gather_bytes(get_preset("debug-deepseek"), 2, "tensorwise", None, 2)[0] == (2, 2)
