"""The benchmark scripts run in their CPU smoke mode, so they never rot."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_trainer_overhead_smoke():
    result = subprocess.run([sys.executable, str(ROOT / "experiments/bench/trainer_overhead.py"), "--smoke"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].startswith("trainer") and lines[2].startswith("hand loop")
    assert float(lines[1].split()[1]) > 0 and float(lines[2].split()[2]) > 0
    assert "trainer overhead:" in lines[3]
