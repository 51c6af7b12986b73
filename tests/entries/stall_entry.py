"""`trillion train` under torchrun, except that rank 1 stalls (as a hung GPU would) before the
forward of step STALL_AT_STEP, for longer than the collective timeout."""

import os
import sys
import time

from trillion.trainer.cli.main import main
from trillion.trainer.step import train_step
from trillion.trainer.train import RunHooks

hooks = None
if os.environ.get("RANK") == "1":
    calls = []

    def stalling_train_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == int(os.environ["STALL_AT_STEP"]):
            time.sleep(120)
        return train_step(*args, **kwargs)

    hooks = RunHooks(step=stalling_train_step)

sys.exit(main(["train", *sys.argv[1:]], hooks=hooks))
