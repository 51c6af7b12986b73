"""experiments/frontier/kimi_k2_report.py, which writes KIMI_K2.md, run on a small setting: it plans every machine,
keeps the Frontier plan inside the MI250X GCD's 64 GB and records that float8 is refused there."""

import pytest

from experiments.frontier.kimi_k2_report import HARDWARE, main
from tests.helpers.documentation import documentation_text


def test_the_report_plans_each_machine_within_its_memory_and_refuses_float8_on_frontier(tmp_path):
    out = tmp_path / "KIMI_K2.md"
    main(["--out", str(out), "--model", "debug-deepseek", "--gpus", "16", "--global-batch", "16", "--seq-len", "1024"]
         + ["--tokens", "1e9", "--no-published", "--no-dry-run"])  # fmt: skip
    text = out.read_text()
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    assert set(HARDWARE) <= set(rows)
    assert float(rows["frontier"][6]) <= 0.9 * 64  # GB per GCD, with the plan's 10% headroom
    assert "`--float8` on Frontier is refused: --float8: hardware profile 'frontier' (mi250x-gcd)" in text
    assert "8 GCDs per node" in text and "100 GB/s per node" in text


def test_the_guides_kimi_k2_on_frontier_is_the_planners_prediction():
    """The planning guide's Kimi K2 section quotes the Frontier plan: its layout, step, MFU, shares, days, GCD-hours and
    energy are what the planner gives now."""
    from experiments.frontier.kimi_k2_report import plan
    from trillion.models.presets import get_preset
    from trillion.parallel.planner.hardware import load_profile
    from trillion.parallel.planner.search import Request

    request = Request("kimi-k2", get_preset("kimi-k2"), load_profile("frontier"), 4096, 4096, 4096, 15.5e12)
    r, _ = plan(request)
    docs = documentation_text()
    shares = r["time_shares"]
    layout = f"tp {r['tp']}, pp {r['pp']}, cp {r['cp']}, ep {r['ep']}, dp_shard {r['dp_shard']} ({r['dp_shard_mode']})"
    quoted = [
        layout,
        f"{r['step_time_s']:.1f} s per step ({r['tokens_per_s'] / 1e3:.0f}k tokens/s, {100 * r['mfu']:.1f}% MFU",
        f"all-to-alls over Slingshot are {100 * shares['ep_exposed']:.0f}%",
        f"context parallelism {100 * shares['cp_exposed']:.0f}% and the pipeline bubble {100 * shares['bubble']:.0f}%",
        f"{r['time_to_train_days']:.0f} days, {r['gpu_hours'] / 1e6:.0f}M GCD-hours and about "
        f"{round(r['energy_mwh'], -2):,.0f} MWh",
    ]
    for text in quoted:
        assert text in docs, text


@pytest.mark.slow  # about 100 s: two 4096-GPU searches (the Frontier plan's quotes stay in the default suite)
def test_the_guides_kimi_k2_days_on_h100_and_mi300x_are_the_planners():
    from experiments.frontier.kimi_k2_report import plan
    from trillion.models.presets import get_preset
    from trillion.parallel.planner.hardware import load_profile
    from trillion.parallel.planner.search import Request

    days = {
        hardware: plan(Request("kimi-k2", get_preset("kimi-k2"), load_profile(hardware), 4096, 4096, 4096, 15.5e12))[0][
            "time_to_train_days"
        ]
        for hardware in ("dgx-h100", "mi300x")
    }
    docs = documentation_text()
    assert f"4096 H100s at {days['dgx-h100']:.0f} days and 4096 MI300X at {days['mi300x']:.0f}." in docs
