"""Semi-synchronous replica groups (torchft's DiLoCo and LocalSGD): the groups train apart on their own shares
and meet every sync_steps steps, where their weights become equal bit for bit; the meetings are counted
(`outer_steps` in metrics.jsonl). The long comparison with synchronous training is `-m slow`."""

import json
from pathlib import Path

import pytest

from tests.fault_tolerance.test_kill_rejoin import FT, QUIET_RUN, digests, records
from tests.helpers.flags import TINY, with_flags
from tests.helpers.launch import TRILLION, train_records
from tests.helpers.lighthouse import Groups, lighthouse


def train_groups(tmp_path: Path, flags: list[str], pace: float) -> Groups:
    """Both groups started together (their first steps at once), run to the end; digests in a.sha and b.sha."""
    with lighthouse(tmp_path) as address:
        groups = Groups(tmp_path, address)
        try:
            for name, replica in (("a", 0), ("b", 1)):
                env = {"FT_STEP_SLEEP": pace, "FT_TOGETHER": f"{tmp_path}:2", "FT_DIGESTS": tmp_path / f"{name}.sha"}
                groups.start(name, [*flags, f"--fault_tolerance.replica_id={replica}"], **env)
            for name in ("a", "b"):
                assert groups.wait(name, 600) == 0, groups.log(name)[-3000:]
        finally:
            groups.close()
    return groups


@pytest.mark.parametrize("method", ["diloco", pytest.param("local_sgd", marks=pytest.mark.slow)])
def test_groups_meet_every_sync_steps_and_then_hold_the_same_weights(method, tmp_path):
    out = tmp_path / "ft"
    semi = [f"--fault_tolerance.semi_sync_method={method}", "--fault_tolerance.sync_steps=5"]
    flags = with_flags([*TINY, *QUIET_RUN, *FT, *semi], "--training.steps=10", f"--job.output_dir={out}")
    train_groups(tmp_path, flags, pace=0.3)
    for replica in (0, 1):
        logged = records(out / f"replica_{replica}" / "metrics.jsonl")
        assert [r["outer_steps"] for r in logged] == [0, 0, 0, 0, 1, 1, 1, 1, 1, 2]
    a, b = digests(tmp_path / "a.sha"), digests(tmp_path / "b.sha")
    assert a[5] == b[5] and a[10] == b[10]  # after each meeting
    assert all(a[step] != b[step] for step in (1, 2, 3, 4, 6, 7, 8, 9))  # apart, on their own shares


@pytest.mark.slow
def test_diloco_trains_the_debug_model_close_to_synchronous_training(tmp_path):
    """DiLoCo, 2 groups, sync_steps 5, 100 steps of the debug model on the default corpus, against one
    process training the same global batches synchronously: the held-out loss after the last step within
    5% (measured +3.0%: docs/checkpoints.md), and 20 meetings. The outer momentum is 0.5: with the DiLoCo
    paper's 0.9, 20 meetings are too few for it to settle (measured +18.7%)."""
    base = ["--training.steps=100", "--eval.interval=100", "--checkpoint.interval=0", "--job.device=cpu"]
    synchronous = train_records(tmp_path / "sync", TRILLION, [*base, "--logging.wandb=false"])
    semi = ["--fault_tolerance.semi_sync_method=diloco", "--fault_tolerance.sync_steps=5"]
    semi.append("--fault_tolerance.outer_momentum=0.5")
    flags = [*base, *FT, *semi, f"--job.output_dir={tmp_path / 'ft'}", "--logging.wandb=false"]
    train_groups(tmp_path, flags, pace=0)
    final = [r for r in synchronous if "eval_loss" in r][-1]["eval_loss"]
    for replica in (0, 1):
        logged = [json.loads(line) for line in (tmp_path / "ft" / f"replica_{replica}" / "metrics.jsonl").open()]
        diloco = [r for r in logged if "eval_loss" in r][-1]["eval_loss"]
        assert abs(diloco - final) <= 0.05 * final, (diloco, final)
        assert [r for r in logged if "outer_steps" in r][-1]["outer_steps"] == 20
        print(f"held-out loss after 100 steps: synchronous {final:.4f}, DiLoCo group {replica} {diloco:.4f}")
