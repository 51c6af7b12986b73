"""The centre of fault tolerance: two replica groups train through a real Lighthouse on loopback; one is
SIGKILLed in the middle of a step; the other goes on within seconds and finishes every step without a
restart; the killed group, started again, recovers live from the healthy one and from then on holds its
weights bit for bit; and the survivor's losses equal one process's, trained on the shares of the groups
that were alive at each step (the data rule: a departed group's share is skipped)."""

import contextlib
import json
import re
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.fault_record import report
from tests.helpers.flags import TINY, with_flags
from tests.helpers.lighthouse import Groups, lighthouse
from tests.helpers.runs import run
from trillion.trainer.checkpoint import complete_checkpoints
from trillion.trainer.step import train_step
from trillion.trainer.train import RunHooks

FT = [
    "--fault_tolerance.enabled=true",
    "--fault_tolerance.group_size=2",
    "--fault_tolerance.timeout_s=30",
    "--fault_tolerance.process_group_timeout_ms=15000",
]
QUIET_RUN = ["--eval.interval=0", "--checkpoint.interval=0"]
RECOVERED = r"recovered live from a healthy group: step (\d+) \(was 0\) in ([\d.]+)s"
PYTHON = (sys.executable,)


def records(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r] if path.exists() else []


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def digests(path: Path) -> dict[int, tuple[str, ...]]:
    """step -> the digest of each rank's parameter shards after that step (ft_entry.py's FT_DIGESTS.RANK files)."""
    ranks = [
        dict(line.split() for line in file.read_text().splitlines())
        for file in sorted(path.parent.glob(f"{path.name}.*"))
    ]
    return {int(step): tuple(rank[step] for rank in ranks) for step in ranks[0]}


def reference_losses(root: Path, flags: list[str], members: dict[int, list[int]], groups: int = 2) -> list[float]:
    """One process over the whole global batch; at each step only the micro-batches of the groups that trained
    it (the micro-batches of a step split evenly into the groups' shares, in group order)."""
    at = [0]

    def iteration(step):
        at[0] = step
        return contextlib.nullcontext()

    def step(runner, micro_batches, *args, **kwargs):
        share = len(micro_batches) // groups
        kept = [mb for index, mb in enumerate(micro_batches) if index // share in members[at[0]]]
        return train_step(runner, kept, *args, **kwargs)

    run(root, *flags, steps=max(members), hooks=RunHooks(step=step, iteration=iteration))
    return [r["loss"] for r in records(root / "metrics.jsonl")]


def run_kill_and_rejoin(tmp_path: Path, steps: int, kill_at: int, release_at: int, extra=(), launcher=PYTHON):
    """Groups a and b started together, b SIGKILLed in its step `kill_at`; b started again (warm: imports done)
    once a logged `release_at` steps. Returns (run folder, groups, killed step, kill time, release time)."""
    out = tmp_path / "ft"
    flags = with_flags([*TINY, *QUIET_RUN, *FT, *extra], f"--training.steps={steps}", f"--job.output_dir={out}")
    processes = 2 if launcher != PYTHON else 1  # per group: torchrun's two, or one
    pace = {"FT_STEP_SLEEP": 0.4, "launcher": launcher}
    together = {**pace, "FT_TOGETHER": f"{tmp_path}:{2 * processes}"}
    with lighthouse(tmp_path) as address:
        groups = Groups(tmp_path, address)
        try:
            groups.start("a", [*flags, "--fault_tolerance.replica_id=0"], **together, FT_DIGESTS=tmp_path / "a.sha")
            b = [*flags, "--fault_tolerance.replica_id=1"]
            groups.start("b", b, **together, FT_KILL_AT=kill_at, FT_KILL_STAMP=tmp_path / "killed")
            groups.start("b-again", b, **pace, FT_GO_FILE=tmp_path / "go-again", FT_DIGESTS=tmp_path / "b.sha")
            assert groups.wait("b", 180) != 0, groups.log("b")[-3000:]  # -9, or torchrun's 1 for its killed rank
            wait_for(lambda: len(records(out / "replica_0" / "metrics.jsonl")) >= release_at, 120, "group 0 to go on")
            released = time.time()
            (tmp_path / "go-again").touch()
            assert groups.wait("a", 180) == 0, groups.log("a")[-3000:]
            assert groups.wait("b-again", 180) == 0, groups.log("b-again")[-3000:]
        finally:
            groups.close()
    killed_step, killed_at = (tmp_path / "killed").read_text().split()
    return out, groups, int(killed_step), float(killed_at), released


def check_survival_and_rejoin(tmp_path: Path, steps: int, processes: int, extra=(), launcher=PYTHON):
    """Run the scenario and check it; returns (the survivor's records, the reference's losses at those steps, its
    record of the killed step, the rejoined group's first record, kill time, release time, the rejoined log)."""
    out, groups, killed_step, killed_at, released = run_kill_and_rejoin(tmp_path, steps, 5, 9, extra, launcher)
    survivor = records(out / "replica_0" / "metrics.jsonl")
    rejoined = records(out / "replica_1" / "metrics.jsonl")
    # the survivor trained every step once from its first (step 1, or 2 when it started second and recovered
    # live from the other then), without a restart, and went on within seconds of the kill
    first = survivor[0]["step"]
    assert first <= 2 and [r["step"] for r in survivor] == list(range(first, steps + 1))
    after_kill = next(r for r in survivor if r["step"] == killed_step)
    assert after_kill["replica_groups"] == [0] and after_kill["time"] - killed_at < 15
    assert "retrying it with the groups alive" in groups.log("a")
    # the restarted group recovered live, then trained the steps left with the survivor, bit for bit alike
    assert "recovered live from a healthy group" in groups.log("b-again")
    joined = [r for r in rejoined if r["time"] > released]
    assert joined and joined[-1]["step"] == steps and joined[0]["step"] > killed_step
    assert all(r["replica_groups"] == [0, 1] for r in joined)
    a, b = digests(tmp_path / "a.sha"), digests(tmp_path / "b.sha")
    assert set(b) == {r["step"] for r in joined} and all(a[step] == b[step] for step in b)
    assert [r["loss"] for r in joined] == [r["loss"] for r in survivor if r["step"] >= joined[0]["step"]]
    # one copy of the final checkpoint, by the first group alive, for a cold restart
    assert complete_checkpoints(out / "replica_0" / "checkpoints")[-1].name == f"step-{steps:08d}"
    assert not complete_checkpoints(out / "replica_1" / "checkpoints")
    # the survivor's losses: one process's with the same groups alive at each step (as either group logged them)
    members = {r["step"]: r["replica_groups"] for r in [*rejoined, *survivor]}
    assert sorted(members) == list(range(1, steps + 1)) and {tuple(m) for m in members.values()} >= {(0,), (0, 1)}
    reference = with_flags(
        TINY, f"--training.steps={steps}", *QUIET_RUN, f"--training.micro_batch_size={2 // processes}"
    )
    expected = reference_losses(tmp_path / "reference", reference, members)[first - 1 :]
    return survivor, expected, after_kill, joined[0], killed_at, released, groups.log("b-again")


def test_a_killed_group_leaves_the_other_training_and_rejoins_live_bitwise(tmp_path):
    steps = 20
    survivor, expected, after_kill, joined, killed_at, released, log = check_survival_and_rejoin(tmp_path, steps, 1)
    assert [r["loss"] for r in survivor] == expected  # bitwise: the same sums in the same order
    recovered = re.search(RECOVERED, log)
    report(
        "SIGKILL of one fault-tolerant replica group (torchft)",
        "the other group logs 'the step was not committed by every group alive ... retrying it with the groups "
        f"alive' and goes on alone; the restarted group logs 'recovered live from a healthy group: step "
        f"{recovered.group(1)} (was 0)' and trains on with it",
        0,
        True,
        after_kill["time"] - killed_at,
        f"2 groups of 1 process, {steps} steps; group 1 SIGKILLed inside step {after_kill['step']}; restarted once "
        f"group 0 had logged 9 steps, it rejoined at step {joined['step']}; the survivor's losses equal one "
        "process's with the same groups per step bitwise, the rejoined group's weights the survivor's bitwise at "
        "every step after (recover: the kill to the survivor's next committed step)",
    )
    report(
        "Replica group restarted (live recovery from a peer)",
        f"recovered live from a healthy group: step {recovered.group(1)} (was 0) in {recovered.group(2)}s; every "
        "weight bitwise the healthy group's from then on",
        0,
        None,
        joined["time"] - released,
        "the killed group's command run again while the other trains (recover: from its start, imports done, to "
        "its first committed step: set-up and the live copy of weights, optimizer, data position and RNG)",
    )


@pytest.mark.slow
def test_groups_of_two_processes_under_torchrun_survive_and_rejoin(tmp_path):
    """The same with FSDP inside each group (dp_shard 2, torchrun): rank r of each group sums its gradient
    shards with rank r of the other; one rank SIGKILLed ends its group, which torchrun started again rejoins."""
    launcher = (*PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2")
    survivor, expected, *_ = check_survival_and_rejoin(tmp_path, 20, 2, ["--parallel.dp_shard=2"], launcher)
    assert [r["loss"] for r in survivor] == pytest.approx(expected, rel=1e-5)  # FSDP sums in another order
