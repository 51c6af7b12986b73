"""experiments/bench/muon.py in its CPU smoke mode (the step timing in the default suite, the loss curves under
-m slow), and its reading of a curve."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments/bench/muon.py"


def _run(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--smoke"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_step_smoke():
    lines = [line for line in _run("step").splitlines() if line.startswith("rank 0:")]
    adamw, muon = float(lines[0].split()[3]), float(lines[0].split()[5])
    assert adamw > 0 and muon > 0


@pytest.mark.slow
def test_curves_smoke(tmp_path):
    out = _run("curves", "--out", str(tmp_path))
    assert "| debug |" in out and (tmp_path / "muon_curves.json").is_file()


def test_tokens_to_reach_interpolates_between_evaluations():
    spec = importlib.util.spec_from_file_location("muon_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    curve = [(0, 5.0), (100, 4.0), (200, 3.0), (300, 3.5)]
    assert bench.tokens_to_reach(curve, 3.5) == 150
    assert bench.tokens_to_reach(curve, 3.0) == 200
    assert bench.tokens_to_reach(curve, 2.0) is None
