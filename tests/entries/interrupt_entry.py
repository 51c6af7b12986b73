"""`trillion train`, except that the process sends itself SIGINT (a user's Ctrl-C) INTERRUPT_TIMES times
(default 1) in the middle of step INTERRUPT_AT_STEP, through the trainer's RunHooks."""

import os
import signal
import sys

from trillion.trainer.cli.main import main
from trillion.trainer.step import train_step
from trillion.trainer.train import RunHooks

at_step, times, calls = int(os.environ["INTERRUPT_AT_STEP"]), int(os.environ.get("INTERRUPT_TIMES", "1")), []


def interrupted_step(*args, **kwargs):
    calls.append(1)
    if len(calls) == at_step:
        for _ in range(times):
            os.kill(os.getpid(), signal.SIGINT)
    return train_step(*args, **kwargs)


sys.exit(main(["train", *sys.argv[1:]], hooks=RunHooks(step=interrupted_step)))
