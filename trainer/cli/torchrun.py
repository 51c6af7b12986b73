"""`trillion torchrun [torchrun's arguments]`: torchrun, run in this process, whose preemption ends in exit 0.

torchrun itself cannot exit 0 after SIGTERM: its agent turns the signal into a SignalException, stops the
workers and exits 1 with a traceback (and SIGUSR1, which it does not handle, kills it and orphans them), so a
job script cannot tell a clean preemption from a crash. Here the agent handles only SIGINT, SIGHUP and SIGQUIT
(its --signals-to-handle); SIGTERM and SIGUSR1 are this process's, sent on to the ranks (the agent's children,
each in a session of its own). The ranks save after the step they are in and exit 0 (resilience.StopPolicy),
each appending one line to a file named in STOP_REPORT_ENV; the agent sees every worker succeed, and this
command prints the line, `preempted, saved: SIGTERM at step N of M, checkpoint DIR`, and exits 0. A rank
restarted by --max-restarts after the signal is sent it too. Whatever else torchrun ends with is this
command's exit status, as torchrun's would be.
"""

import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

from trillion.trainer.launch.env import STOP_REPORT_ENV

PREEMPTION = (signal.SIGTERM, signal.SIGUSR1)  # a scheduler's preemption or kill; SLURM's warning
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"  # what torchrun's agent still handles (and forwards) itself
RESEND_S = 1.0  # how often ranks that appeared since the signal (a restart) are sent it


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (the agent's workers), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # the field after the state: the parent's pid
                found.append(int(entry.name))
    return found


class Forwarder:
    """Sends a preemption signal on to every rank, once each, now and to ranks started later."""

    def __init__(self):
        self.signum, self.sent, self.done = None, set(), threading.Event()

    def on_signal(self, signum, frame) -> None:
        self.signum = self.signum or signum
        self.send()

    def send(self) -> None:
        for pid in set(children(os.getpid())) - self.sent:
            try:
                os.kill(pid, self.signum)
                self.sent.add(pid)
            except ProcessLookupError:
                pass

    def watch(self) -> None:
        while not self.done.wait(RESEND_S):
            if self.signum is not None:
                self.send()


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    forwarder = Forwarder()
    previous = {sig: signal.signal(sig, forwarder.on_signal) for sig in PREEMPTION}
    watcher = threading.Thread(target=forwarder.watch, daemon=True)
    watcher.start()
    with tempfile.TemporaryDirectory(prefix="trillion-torchrun-") as folder:
        report = Path(folder) / "stopped"
        os.environ[STOP_REPORT_ENV] = str(report)
        os.environ.setdefault("PET_SIGNALS_TO_HANDLE", AGENT_SIGNALS)  # torchrun's --signals-to-handle default
        try:
            torchrun(argv)
            status = 0
        except ChildFailedError:  # torchrun has printed which rank failed and why
            status = 1
        except SignalException as error:  # SIGINT, SIGHUP, SIGQUIT: the agent stopped the workers
            print(f"trillion torchrun: stopped by {error.sigval.name}", file=sys.stderr)
            status = 130 if error.sigval == signal.SIGINT else 1
        finally:
            forwarder.done.set()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        lines = report.read_text().splitlines() if report.exists() else []
    if status == 0 and lines:
        named = [line for line in lines if "another rank" not in line] or lines
        print(f"{named[0]}; the same command continues the run.", flush=True)
    elif forwarder.signum is not None and status == 0:
        print(f"trillion torchrun: {signal.Signals(forwarder.signum).name} arrived as the run ended", flush=True)
    return status
