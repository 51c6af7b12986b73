"""`trillion train`, except that step HOLD_AT_STEP waits, before its forward, until the file RELEASE_FILE
exists (at most 300 s): a test holds a job in the middle of training for as long as it needs. With HELD_FILE
set, each rank creates HELD_FILE.RANK when it starts waiting."""

import os
import sys
import time
from pathlib import Path

from trillion.trainer.cli.main import main
from trillion.trainer.step import train_step
from trillion.trainer.train import RunHooks

hold_at, release, calls = int(os.environ["HOLD_AT_STEP"]), Path(os.environ["RELEASE_FILE"]), []


def held_step(*args, **kwargs):
    calls.append(1)
    if len(calls) == hold_at and os.environ.get("HELD_FILE"):
        Path(f"{os.environ['HELD_FILE']}.{os.environ.get('RANK', '0')}").touch()
    deadline = time.monotonic() + 300
    while len(calls) == hold_at and not release.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return train_step(*args, **kwargs)


sys.exit(main(["train", *sys.argv[1:]], hooks=RunHooks(step=held_step)))
