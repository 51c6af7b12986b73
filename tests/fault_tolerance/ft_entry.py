"""`trillion train` as one replica group, with what the fault-tolerance tests need around it:
FT_GO_FILE: wait (imports done) until this file exists, so a standby group starts at once when released;
FT_STEP_SLEEP: seconds each iteration takes at least (a real step's compute, so the groups overlap);
FT_KILL_AT: SIGKILL this process inside its first step at or after this step (a node lost mid-step);
FT_DIGESTS: append "step sha256-of-this-rank's-parameter-shards" to FT_DIGESTS.RANK after each step, to
compare groups bitwise;
FT_TOGETHER=DIR:N: before the first quorum, wait until N processes have their Manager (the groups of a job
started together: each Lighthouse heartbeat exists before either asks for a quorum, so the first quorum holds
both however slowly each process set up; the go file serves a process started early and released later)."""

import contextlib
import hashlib
import os
import signal
import sys
import time
from pathlib import Path

from trillion.trainer.cli.main import main
from trillion.trainer.fault_tolerance.replicas import ReplicaGroups
from trillion.trainer.step import train_step
from trillion.trainer.train import RunHooks

model = []


def step(runner, *args, **kwargs):
    model[:] = [runner.model]
    kill_at = int(os.environ.get("FT_KILL_AT", "0"))
    if kill_at and _step[0] >= kill_at:
        with open(os.environ["FT_KILL_STAMP"], "w") as stamp:
            stamp.write(f"{_step[0]} {time.time()!r}")
        os.kill(os.getpid(), signal.SIGKILL)
    return train_step(runner, *args, **kwargs)


_step = [0]


def start_together() -> None:
    folder, count = os.environ["FT_TOGETHER"].rsplit(":", 1)
    Path(folder, f"ready-{os.getpid()}").touch()
    deadline = time.monotonic() + 120
    while len(list(Path(folder).glob("ready-*"))) < int(count) and time.monotonic() < deadline:
        time.sleep(0.05)


@contextlib.contextmanager
def iteration(at: int):
    _step[0] = at
    start = time.perf_counter()
    yield
    time.sleep(max(0.0, float(os.environ.get("FT_STEP_SLEEP", "0")) - (time.perf_counter() - start)))
    if os.environ.get("FT_DIGESTS") and model:
        digest = hashlib.sha256()
        for value in model[0].state_dict().values():
            shard = value.to_local() if hasattr(value, "to_local") else value
            digest.update(shard.detach().cpu().contiguous().numpy().tobytes())
        with open(f"{os.environ['FT_DIGESTS']}.{os.environ.get('RANK', '0')}", "a") as out:
            out.write(f"{at} {digest.hexdigest()}\n")


def join_together(join):
    def joined(self, step: int) -> None:
        start_together()
        return join(self, step)

    return joined


if __name__ == "__main__":
    if os.environ.get("FT_TOGETHER"):
        ReplicaGroups.join = join_together(ReplicaGroups.join)
    if os.environ.get("FT_GO_FILE"):
        while not Path(os.environ["FT_GO_FILE"]).exists():
            time.sleep(0.05)
    sys.exit(main(["train", *sys.argv[1:]], hooks=RunHooks(step=step, iteration=iteration)))
