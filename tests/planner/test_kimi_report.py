"""experiments/frontier/kimi_k2_report.py, which writes KIMI_K2.md, run on a small setting: it plans every machine,
keeps the Frontier plan inside the MI250X GCD's 64 GB and records that float8 is refused there."""

from experiments.frontier.kimi_k2_report import HARDWARE, main


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
