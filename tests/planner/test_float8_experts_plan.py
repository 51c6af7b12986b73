"""`trillion plan --float8` with the routed experts: their grouped GEMMs at the recipe's float8 rate (sourced in
parallel/planner/moe.py) plus their casts, float8 dispatch's smaller forward all-to-all, the fused permutation's
rows; and the flags as the config they write.

The expected figures are computed here from DeepSeek-V3's shapes and the sourced rates, not by calling the
planner's MoE costs: H800 (dgx-h800's device, the H100 SXM's compute) fp8 peak 1979 TFLOP/s at the [mamf] plateau
0.709, times the recipe's share (torchao's rowwise 0.838, DeepGEMM's blockwise 0.851)."""

import dataclasses
import json
import math

import pytest

from trillion.devices import fitted_constants
from trillion.models.presets import get_preset
from trillion.parallel.layout import Float8Training, Layout
from trillion.parallel.planner import moe
from trillion.parallel.planner.float8_experts import dispatch_row_bytes
from trillion.parallel.planner.hardware import load_profile
from trillion.trainer.cli.main import main as trillion
from trillion.trainer.config.schema import load_config

DEEPSEEK = get_preset("deepseek-v3-671b")  # 256 experts of 7168 x 2048, top-8
HW = load_profile("dgx-h800")
SUSTAINED = next(e["value"] for e in fitted_constants() if e["field"] == "sustained" and "h100" in e["devices"])
FP8_RATE = 1979.0e12 * 0.709 * SUSTAINED


@pytest.mark.parametrize("recipe, share", [("rowwise", 0.838), ("blockwise", 0.851)])
def test_the_experts_gemms_run_at_the_recipe_s_float8_rate(recipe, share):
    tokens, ep = 16384, 8  # compute-bound: 4096 rows of 7168 x 2048 per expert
    rows = math.ceil(tokens * 8 * ep / 256 * 1.0)
    bf16 = moe.expert_gemm_seconds(DEEPSEEK, HW, tokens, 1, ep, 1.0)
    fp8 = moe.expert_gemm_seconds(DEEPSEEK, HW, tokens, 1, ep, 1.0, recipe)
    flops = 32 * 3 * 2 * rows * 7168 * 2048  # 32 local experts, three GEMMs each
    launches = 3 * HW.device.kernel_overhead_us * 1e-6
    assert fp8 - launches == pytest.approx(flops / (FP8_RATE * share), rel=1e-6)
    assert fp8 < bf16
    casts = moe.expert_float8_casts(DEEPSEEK, HW, tokens, ep, 1.0)
    weights = 32 * 3 * 7168 * 2048  # each GEMM casts its local experts' weights, 3 bytes an element
    forward_elements = rows * 32 * (7168 + 7168 + 2048) + weights
    memory = HW.device.memory_bandwidth_gbs * 1e9 * HW.device.memory_efficiency
    assert casts[0] == pytest.approx(3 * forward_elements / memory + 6 * HW.device.kernel_overhead_us * 1e-6)


def test_float8_dispatch_shrinks_the_forward_dispatch_only():
    """Per expert, no overlap: the forward dispatch's rows (top-8 a token, 63/64 to peers over the network) carry
    the float8 wire row instead of bf16's, their routing (a float32 weight and expert id) beside them either way."""
    tokens, ep = 4096, 64
    blockwise = Float8Training(experts="blockwise")
    layout = Layout(ep=ep, dp_shard=ep, float8=blockwise, ep_dispatch="expert", ranks_per_node=8)
    plain = moe.moe_passes(DEEPSEEK, HW, tokens, layout, 1.0)
    with_dispatch = dataclasses.replace(layout, float8=dataclasses.replace(blockwise, dispatch=True))
    dispatched = moe.moe_passes(DEEPSEEK, HW, tokens, with_dispatch, 1.0)
    network = tokens * 8 * 56 / 64  # rows to the 56 ranks on other nodes
    bandwidth, _ = HW.collective_link(ep, True, "all_to_all")
    saved = network * (2 * 7168 - (7168 + 4 * 56)) / bandwidth
    assert plain.ep_forward - dispatched.ep_forward == pytest.approx(saved)
    assert plain.ep_backward == dispatched.ep_backward  # the combine and the backward stay bf16
    assert dispatch_row_bytes(7168, "blockwise") == 7392 and dispatch_row_bytes(7168, "rowwise") == 7172


def test_the_fused_permutation_moves_18_rows_a_token_forward_and_26_backward_at_top_8():
    forward, backward = (choice * 8 + token for choice, token in moe.PERMUTATION_ROWS.values())
    assert (forward, backward) == (18, 26)  # torch's indexing: 7 x 8 + 1 = 57 and twice that


def test_the_flags_plan_deepseek_s_recipe_and_write_it(tmp_path, capsys):
    base = [
        "plan", "--model", "deepseek-v3-671b", "--hardware", "dgx-h800", "--gpus", "2048", "--global-batch",
        "15360", "--seq-len", "4096", "--tp", "1", "--pp", "16", "--ep", "64", "--dp-shard", "128",
        "--dp-shard-mode", "zero1", "--pp-schedule", "1F1B", "--micro-batch-size", "1", "--activation-checkpoint",
        "full", "--mtp-modules", "0", "--format", "json", "--float8",
    ]  # fmt: skip
    steps = {}
    for name, flags in (
        ("linears", ["--float8-experts", "off"]),
        ("experts", []),
        ("deepseek", ["--float8-experts", "blockwise", "--float8-dispatch"]),
    ):
        out = tmp_path / f"{name}.toml"
        assert trillion([*base, *flags, "--config-out", str(out)]) == 0
        steps[name] = json.loads(capsys.readouterr().out)["candidates"][0]["step_time_s"]
        config = load_config(str(out), [])
        assert config.float8.enabled and config.float8.experts == (flags[1] if flags else "auto")
        assert config.float8.dispatch == ("--float8-dispatch" in flags)
    assert steps["deepseek"] < steps["experts"] < steps["linears"], steps
