"""Pipeline layouts reproduce the one-process run: losses, gradient norms (clipped across stages),
every parameter's gradient and the initial weights, over several optimizer steps, fp32 on gloo."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from pp_parity import check_pipeline_cases  # noqa: E402
from spawn import run_ranks  # noqa: E402


def test_two_stages_gpipe_and_1f1b():
    cases = [{"name": f"{f}-pp2-{s}", "family": f, "pp": 2, "schedule": s}
             for f in ("llama", "gpt") for s in ("GPipe", "1F1B")]
    run_ranks(check_pipeline_cases, 2, cases)
