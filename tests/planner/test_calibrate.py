"""`trillion plan --calibrate` on this CPU: a profile the planner plans with, one node only."""

import dataclasses

import pytest
import tomllib

from trillion.errors import ConfigError
from trillion.models.presets import get_preset
from trillion.parallel.planner import calibrate as calibration
from trillion.parallel.planner.hardware import PROFILE_DIR, load_profile
from trillion.parallel.planner.search import Request, search


def test_calibrated_profile_plans_one_node_and_refuses_more(tmp_path, monkeypatch):
    monkeypatch.setitem(calibration.MIN_TIMING_S, "cpu", 0.001)  # the test checks the plumbing, not the figures
    monkeypatch.setattr(calibration, "SQUARE_GEMMS", {"cpu": ((64, 64, 64),)})
    args = dataclasses.replace(get_preset("debug"), n_layers=2)
    path = calibration.calibrate(tmp_path / "cpu.toml", args, seq_len=64, micro_batch=2, processes=2)
    profile = load_profile(str(path))
    device = profile.device
    assert profile.compute_dtype == "fp32" and profile.gpus_per_node == 2 and profile.node_bandwidth_gbs == 0
    assert not profile.overlaps_collectives  # gloo moves the bytes on the cores that compute
    assert device.memory_bandwidth_gbs > 0 and device.kernel_overhead_us > 0 and 0 < device.attention_efficiency <= 1
    shapes = calibration.model_gemm_shapes(args, 128)
    assert len(device.gemm_efficiency) == 1 + len(shapes) and (128, args.dim, args.ffn_hidden // 2) in shapes
    assert profile.intra_node[0].bandwidth_gbs > 0
    # TP's collectives as the trainer issues them, each kind with its own measured figures
    assert {kind for kind, bandwidth, latency in profile.intra_node[0].kinds if bandwidth > 0 and latency > 0} == {
        "all_gather",
        "reduce_scatter",
        "all_reduce",
    }
    written = tomllib.loads(path.read_text())["tp_layer_host_us"]  # DTensor's host work per block, as read back
    assert profile.tp_layer_host_s == pytest.approx((written["forward"] * 1e-6, written["backward"] * 1e-6))
    for kind, bandwidth, latency in profile.intra_node[0].kinds:
        assert profile.collective_link(2, False, kind) == pytest.approx((bandwidth * 1e9, latency * 1e-6))
    assert search(Request("debug", args, profile, 2, 8, 64)).ranked
    with pytest.raises(ConfigError, match="no measured network"):
        search(Request("debug", args, profile, 4, 8, 64))


def test_a_link_without_a_kind_follows_the_all_reduce_and_unknown_keys_are_refused(tmp_path):
    text = (PROFILE_DIR / "dgx-h100.toml").read_text()
    line = next(row for row in text.splitlines() if row.startswith("intra_node"))
    kinds = line.replace(
        "bandwidth_gbs = 450 }", "bandwidth_gbs = 450, reduce_scatter = { bandwidth_gbs = 100, latency_us = 50 } }"
    )
    (tmp_path / "kinds.toml").write_text(text.replace(line, kinds))
    profile, stock = load_profile(str(tmp_path / "kinds.toml")), load_profile("dgx-h100")
    assert profile.collective_link(8, False, "reduce_scatter") == pytest.approx(
        (100e9 * profile.collective_efficiency, 50e-6)
    )
    assert profile.collective_link(8, False, "all_gather") == stock.collective_link(8, False, "all_reduce")
    (tmp_path / "typo.toml").write_text(text.replace(line, line.replace("}", ", allgather = 1 }", 1)))
    with pytest.raises(ConfigError, match="allgather"):
        load_profile(str(tmp_path / "typo.toml"))
