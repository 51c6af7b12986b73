"""`trillion train` under torchrun, except that on the first attempt rank 1 kills itself with
SIGKILL in the middle of step CRASH_AT_STEP, as a failing node would."""

import os
import signal
import sys
import time

from trillion.trainer.cli.main import main
from trillion.trainer.step import train_step
from trillion.trainer.train import RunHooks

hooks = None
if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("RANK") == "1":
    calls = []

    def dying_train_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == int(os.environ["CRASH_AT_STEP"]):
            if os.environ.get("FAULT_STAMP"):
                with open(os.environ["FAULT_STAMP"], "w") as stamp:
                    stamp.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return train_step(*args, **kwargs)

    hooks = RunHooks(step=dying_train_step)

sys.exit(main(["train", *sys.argv[1:]], hooks=hooks))
