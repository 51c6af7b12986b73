"""`trillion train`, except that the process kills itself with SIGKILL (a node lost, an OOM kill) while
writing the KILL_ON_SAVE-th checkpoint, from whichever thread writes it (the async writer's too);
the time of the kill goes to FAULT_STAMP."""

import os
import signal
import sys
import time

from torch.distributed.checkpoint import FileSystemWriter

from trillion.trainer.cli.main import main

original, calls = FileSystemWriter.write_data, []


def dying_write_data(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == int(os.environ["KILL_ON_SAVE"]):
        with open(os.environ["FAULT_STAMP"], "w") as stamp:
            stamp.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, *args, **kwargs)


FileSystemWriter.write_data = dying_write_data
sys.exit(main(["train", *sys.argv[1:]]))
