"""experiments/bench/attention.py in its CPU smoke mode, so the GPU benchmark never rots."""

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "experiments" / "bench" / "attention.py"


def test_attention_benchmark_smoke_mode_checks_and_times_every_case():
    spec = importlib.util.spec_from_file_location("bench_attention", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.run(smoke=True)
    assert not [row for row in rows if "error" in row or "skipped" in row]
    attention = [row for row in rows if row["name"].startswith("attention")]
    for impl in ("triton", "sdpa_flash", "eager"):
        for step in ("fwd", "bwd", "fwd+bwd"):
            assert any(f" {step} {impl} " in row["name"] and row["tflops"] > 0 for row in attention), (step, impl)
    norms = [row for row in rows if "norm" in row["name"]]
    assert {row["name"].split()[0] for row in norms} == {"rms_norm", "layer_norm"}
    assert all(row["gbps"] > 0 for row in norms)
    assert all("vs_torch" in row for row in rows if " triton " in row["name"])
    table = bench.format_table(rows)
    assert table.splitlines()[0].split()[:3] == ["name", "ms", "tflops"] and len(table.splitlines()) == len(rows) + 1
