"""`trillion plan --calibrate` on this CPU: a profile the planner plans with, one node only."""
import dataclasses

import pytest

from trillion.errors import ConfigError
from trillion.models.presets import get_preset
from trillion.parallel.planner import calibrate as calibration
from trillion.parallel.planner.hardware import load_profile
from trillion.parallel.planner.search import Request, search


def test_calibrated_profile_plans_one_node_and_refuses_more(tmp_path, monkeypatch):
    monkeypatch.setitem(calibration.MIN_TIMING_S, "cpu", 0.001)  # the test checks the plumbing, not the figures
    monkeypatch.setattr(calibration, "SQUARE_GEMMS", {"cpu": ((64, 64, 64),)})
    args = dataclasses.replace(get_preset("debug"), n_layers=2)
    path = calibration.calibrate(tmp_path / "cpu.toml", args, seq_len=64, micro_batch=2, processes=2)
    profile = load_profile(str(path))
    device = profile.device
    assert profile.compute_dtype == "fp32" and profile.gpus_per_node == 2 and profile.node_bandwidth_gbs == 0
    assert device.memory_bandwidth_gbs > 0 and device.kernel_overhead_us > 0 and 0 < device.attention_efficiency <= 1
    shapes = calibration.model_gemm_shapes(args, 128)
    assert len(device.gemm_efficiency) == 1 + len(shapes) and (128, args.dim, args.ffn_hidden // 2) in shapes
    assert profile.intra_node[0].bandwidth_gbs > 0
    assert search(Request("debug", args, profile, 2, 8, 64)).ranked
    with pytest.raises(ConfigError, match="no measured network"):
        search(Request("debug", args, profile, 4, 8, 64))
