"""What `trillion plan` says instead of refusing or over-promising: a layout that fits the device but not the
plan's headroom is evaluated with a memory warning, and a predicted utilisation above the best published on
the hardware class is flagged next to the figure (ceilings.toml)."""

import dataclasses
import json

from trillion.devices import DEVICES
from trillion.models.presets import get_preset
from trillion.parallel.planner.caveats import ceilings, utilisation_warning
from trillion.parallel.planner.hardware import load_profile
from trillion.parallel.planner.memory import MEMORY_HEADROOM
from trillion.parallel.planner.search import Request, search
from trillion.trainer.cli.main import main as trillion

# torchtitan's published Llama 3.1 8B layout on 8 Grand Teton H100s (experiments/validation/runs.toml)
TITAN_8B = ["--model", "llama3-8b", "--hardware", "grand-teton-h100", "--gpus", "8", "--global-batch", "16"]
TITAN_8B += ["--seq-len", "8192", "--tp", "1", "--pp", "1", "--dp-shard", "8", "--micro-batch-size", "2"]
TITAN_8B += ["--activation-checkpoint", "selective", "--config-out", ""]


def test_a_fixed_layout_past_the_headroom_is_evaluated_with_a_memory_warning(capsys):
    hw = load_profile("grand-teton-h100")
    request = Request("llama3-8b", get_preset("llama3-8b"), hw, 8, 16, 8192, fixed={"tp": 1, "pp": 1, "dp_shard": 8})
    fixed = {**request.fixed, "micro_batch_size": 2, "activation_checkpoint": "selective"}
    (only,) = search(dataclasses.replace(request, fixed=fixed)).ranked
    # the premise: past the plan's 90% but inside the device (else this would not exercise the fallback)
    assert MEMORY_HEADROOM * request.capacity_bytes < only.memory.total <= request.capacity_bytes
    assert trillion(["plan", *TITAN_8B, "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["candidates"]
    assert report["fitting"] == 0 and row["fits"] is False and row["step_time_s"] > 0
    assert f"{row['memory_gb']:.1f} of 96 GB" in row["memory_warning"]
    assert trillion(["plan", *TITAN_8B]) == 0
    table = capsys.readouterr().out
    assert f"{row['memory_gb']:.1f}!" in table and "! row 1: memory:" in table


def test_a_layout_past_the_device_is_still_refused(capsys):
    argv = ["plan", "--model", "gpt-1t", "--hardware", "frontier", "--gpus", "8", "--global-batch", "8"]
    assert trillion([*argv, "--config-out", ""]) == 2
    assert "more than the device's 64 GB" in capsys.readouterr().err


def test_utilisation_above_the_best_published_is_flagged():
    for entry in ceilings():
        assert entry["source"].strip() and set(entry["devices"]) <= set(DEVICES), entry["class"]
        device, metric, best = entry["devices"][0], entry["metric"], entry["value"]
        row = {"mfu": 0.0, "hfu": 0.0, "float8": False}
        assert utilisation_warning(device, {**row, metric: best}) == ""  # reaching it is not a warning
        assert f"{metric.upper()} {best + 0.01:.1%}" in utilisation_warning(device, {**row, metric: best + 0.01})
        assert utilisation_warning(device, {**row, metric: best + 0.01, "float8": True}) == ""
    assert utilisation_warning("b200", {"mfu": 0.99, "hfu": 0.99, "float8": False}) == ""  # no published figure


def test_the_table_marks_the_flagged_figure(capsys, tmp_path):
    """A measured profile carries an A100's microbenchmark rates and no fitted sustained share (what `trillion plan
    --calibrate` writes on a machine without its whole curve): on it a 22B plan predicts past the best published MFU,
    the optimism the ceilings are for, and the table marks the figure."""
    shipped = load_profile("dgx-a100")
    a100 = DEVICES["a100"]
    profile = tmp_path / "measured-a100.toml"
    profile.write_text(
        f"gpus_per_node = {shipped.gpus_per_node}\nnode_bandwidth_gbs = {shipped.node_bandwidth_gbs}\n"
        f"intra_node = [{{ group = 8, bandwidth_gbs = {shipped.intra_node[0].bandwidth_gbs} }}]\n"
        f'[device]\nname = "a100"\npeak_tflops = {{ bf16 = {a100.peak_tflops["bf16"]} }}\n'
        f"memory_gb = {a100.memory_gb}\nmemory_bandwidth_gbs = {a100.memory_bandwidth_gbs}\n"
        f"gemm_efficiency = [[1e12, {a100.gemm_efficiency[0][1]}]]\n"
        f"attention_efficiency = {a100.attention_efficiency}\nmemory_efficiency = {a100.memory_efficiency}\n"
    )
    argv = ["plan", "--model", "gpt-22b", "--hardware", str(profile), "--gpus", "64", "--global-batch", "64"]
    argv += ["--tp", "8", "--pp", "1", "--micro-batch-size", "8", "--dp-shard-mode", "zero1", "--top", "1"]
    assert trillion([*argv, "--activation-checkpoint", "none", "--format", "json", "--config-out", ""]) == 0
    (row,) = json.loads(capsys.readouterr().out)["candidates"]
    best = next(c["value"] for c in ceilings() if "a100" in c["devices"] and c["metric"] == "mfu")
    assert row["mfu"] > best and f"MFU {row['mfu']:.1%}" in row["utilisation_warning"]  # the premise, and its flag
    assert trillion([*argv, "--activation-checkpoint", "none", "--config-out", ""]) == 0
    table = capsys.readouterr().out
    assert f"{100 * row['mfu']:.1f}!" in table and "above the best published on Ampere (A100)" in table
