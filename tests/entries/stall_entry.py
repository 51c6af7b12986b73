"""`trillion train` under torchrun, except that rank 1 stalls (as a hung GPU would) before the
forward of step STALL_AT_STEP, for longer than the collective timeout."""

import os
import sys
import time

import trillion.trainer.train
from trillion.trainer.cli.main import main

if os.environ.get("RANK") == "1":
    original, calls = trillion.trainer.train.train_step, []

    def stalling_train_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == int(os.environ["STALL_AT_STEP"]):
            time.sleep(120)
        return original(*args, **kwargs)

    trillion.trainer.train.train_step = stalling_train_step

sys.exit(main(["train", *sys.argv[1:]]))
