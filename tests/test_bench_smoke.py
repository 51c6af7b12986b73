"""The benchmark scripts run in their CPU smoke mode, so they never rot."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_trainer_overhead_smoke():
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments/bench/trainer_overhead.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].startswith("trainer") and lines[2].startswith("hand loop")
    assert float(lines[1].split()[1]) > 0 and float(lines[2].split()[2]) > 0
    assert "trainer overhead:" in lines[3]


def test_trainer_overhead_two_ranks_smoke():
    """--ranks 2: the trainer at dp_shard=2 and a hand-written FSDP2 loop on 2 gloo processes, from the
    same weights and batches (the script fails if their first losses differ)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments/bench/trainer_overhead.py"), "--smoke", "--ranks", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[1].startswith("trainer") and lines[2].startswith("hand loop")
    assert float(lines[1].split()[1]) > 0 and float(lines[2].split()[2]) > 0
    assert "trainer overhead:" in lines[3] and "2 ranks" in lines[3] and "--parallel.dp_shard=2" in lines[3]
    assert lines[4].startswith("first-step loss:")


def test_host_syncs_smoke(tmp_path):
    """Both models at log_freq 1, 10 and 100: a read at every logged step, none at the others."""
    import json

    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments/bench/host_syncs.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in next(tmp_path.glob("host_syncs-*.jsonl")).read_text().splitlines()]
    assert [row["log_freq"] for row in rows] == [1, 10, 100, 1, 10, 100]
    assert all(row["wall_ms"] > 0 and row["cpu_ms"] > 0 and row["reads_logged"] > 0 for row in rows)
    assert all(row["reads_unlogged"] is None for row in rows if row["log_freq"] == 1)  # every step logged
    assert all(row["reads_unlogged"] == 0 for row in rows if row["log_freq"] > 1), rows
    assert next(tmp_path.glob("host_syncs-*.md")).read_text().count("\n| ") == len(rows) + 1


def test_run_all_smoke(tmp_path):
    """Every part runs and passes its correctness check on CPU (the step's: four steps on one batch
    give a finite, falling loss); each row is on disk as a JSON line, and the table as .md."""
    import json

    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments/bench/run_all.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in next(tmp_path.glob("*.jsonl")).read_text().splitlines()]
    parts = {row["part"] for row in rows}
    assert parts == {"ceiling", "kernels", "step"}
    errors = [row for row in rows if "error" in row]
    assert not errors, errors
    steps = [row for row in rows if row["part"] == "step"]
    assert steps and all(row["tokens_per_s"] > 0 for row in steps)
    for row in steps:
        losses = [float(x) for x in row["losses"].split(", ")]
        assert losses[-1] < losses[0], row
    assert next(tmp_path.glob("*.md")).read_text().count("\n| ") >= len(rows)


def test_data_loader_smoke():
    """prepare-data with 1 and 2 workers for both tokenizers, and the loaders at dp 1, 8, 64, on a corpus subset."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments/bench/data_loader.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    prepare = [r for r in rows if r[0].strip() in ("byte", "bpe")]
    loaders = [r for r in rows if r[0].strip() in ("prepared", "on-the-fly")]
    assert [(r[0].strip(), r[1].strip()) for r in prepare] == [("byte", "1"), ("byte", "2"), ("bpe", "1"), ("bpe", "2")]
    assert prepare[0][2] == prepare[1][2] and prepare[2][2] == prepare[3][2]  # same tokens whatever the workers
    assert [(r[0].strip(), r[1].strip()) for r in loaders] == [
        (k, d) for k in ("prepared", "on-the-fly") for d in ("1", "8", "64")
    ]
    assert all(float(r[-1].replace(",", "")) > 0 for r in prepare + loaders)
    assert "one H100 consumes" in result.stdout


def test_device_check_smoke_runs_each_part_and_keeps_its_results(tmp_path):
    """The GPU device check's CPU mode: installs the package into a virtual environment from the
    checkout alone (no registry), runs the GPU tier (which skips itself without a GPU) and the
    ceiling benchmark as separate processes, and writes the parts, rows and RESULTS section."""
    import json

    result = subprocess.run(
        ["bash", str(ROOT / "experiments/bench/device_check.sh"), "--smoke", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},  # this interpreter, whether or not its venv is on PATH
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    parts = dict(line.split("\t")[:2] for line in (tmp_path / "summary.tsv").read_text().splitlines())
    assert parts == {
        "install": "ok",
        "gpu_tests": "ok",
        "bench_ceiling": "ok",
        "bench_float8": "ok",
        "host_syncs": "ok",
        "bench_moe": "ok",
        "tp_overlap": "ok",
    }
    assert "skipped" in (tmp_path / "gpu_tests.log").read_text()
    rows = [json.loads(line) for line in next((tmp_path / "bench").glob("*.jsonl")).read_text().splitlines()]
    assert {row["name"].split()[0] for row in rows} == {"gemm", "copy"} and not any("error" in r for r in rows)
    section = (tmp_path / "RESULTS-section.md").read_text()
    assert "| install | ok |" in section and "| ceiling | gemm" in section
    syncs = [json.loads(line) for line in next((tmp_path / "syncs").glob("*.jsonl")).read_text().splitlines()]
    assert syncs and all(row["reads_unlogged"] in (None, 0) for row in syncs)
    assert "| debug, 1 layer | 100 |" in section  # the host-syncs table is in the section
    moe = [json.loads(line) for line in next((tmp_path / "moe").glob("*.jsonl")).read_text().splitlines()]
    assert [row["part"] for row in moe] == ["grouped_gemm", "moe_layer", "moe_layer", "training", "training"]
    assert all(row.get("torch_ms", 1) > 0 and 0 < row.get("dispatch_share", 0.5) < 1.5 for row in moe)
    assert "grouped_gemm:" in section and "| debug-moe |" in section
    assert "| tp 2 | needs two GPUs; this machine has 0 |" in section  # the tp 2 part says why it measured nothing
    assert len(result.stdout.splitlines()) < 40  # the summary stays short: only the output's tail comes back


def _smoke(script: str, *args: str):
    """A benchmark script of experiments/bench in its smoke mode, run to completion."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments/bench" / script), "--smoke", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow  # about 20 s each on two cores
@pytest.mark.parametrize(
    "script",
    [
        "ep_overlap.py",
        "ep_overlap.py --pp 2",
        "ep_overlap.py --pp 2 --schedule Interleaved1F1B",
        "ep_dispatch.py",
        "tp_overlap.py",
    ],
)
def test_parallel_benchmarks_smoke(script, tmp_path):
    """The latency-injection benchmarks (2 gloo ranks: the expert all-to-alls', with --pp 2 DualPipeV's on 4, TP's
    collectives') and the dispatch-bytes benchmark (threads) at tiny sizes."""
    name, *flags = script.split()
    result = _smoke(name, *flags, "--out", str(tmp_path))
    assert any(head in result.stdout for head in ("| dispatch |", "| routing | dispatch |", "| tp | chunks |"))


def test_tp_latency_injection_delays_each_collective_by_the_gemm_beside_it(tmp_path):
    """The TP benchmark's `--delays gemm` (2 gloo ranks, 2 layers, 2 micro-batches): with the overlap off every
    collective is held its own GEMM's time, so a step's injected delay is, per micro-batch, each block's four GEMMs
    twice (forward and backward), the head's column GEMM twice and the embedding's stand-in twice."""
    import json

    _smoke("tp_overlap.py", "--out", str(tmp_path))
    (row,) = [json.loads(line) for line in (tmp_path / "tp_overlap.jsonl").read_text().splitlines()]
    gemm, layers, micro_batches = row["gemm_ms"], 2, 2
    block = sum(gemm["attention"]) + sum(gemm["mlp"])
    expected = micro_batches * (2 * layers * block + 2 * gemm["head"][0] + 2 * gemm["embedding"][0]) / 1e3
    assert row["collectives_per_step"] == micro_batches * (8 * layers + 4)
    assert row["late_off_s"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.slow  # four gloo processes: about a minute on two cores
def test_folding_bytes_benchmark_smoke():
    """The folded and the tensor-parallel layouts' dispatch rows, counted on 4 gloo ranks, at a tiny size."""
    result = _smoke("ep_folding.py")
    assert "| all |" in result.stdout and "rows posted" in result.stdout


def test_memory_recipe_drift_benchmark_smoke(tmp_path):
    """The loss-drift benchmark of bf16 AdamW moments and the float8 activation cache: its five runs, 3 steps each
    on a small debug-deepseek, each compared with the run it changes."""
    import json

    result = _smoke("memory_recipe.py", "--out", str(tmp_path))
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and not line.startswith("| run |")]
    assert [row.split(" | ")[0] for row in rows] == [
        "| fp32 moments, no float8",
        "| bf16 moments",
        "| float8 experts",
        "| float8 experts + float8 cache",
        "| float8 cache + deepseek recompute",
    ]
    assert rows[3].split(" | ")[1] == rows[4].split(" | ")[1] == "float8 experts"
    runs = json.loads((tmp_path / "memory_recipe.json").read_text())
    assert all(len(run["losses"]) == 3 for run in runs.values())
