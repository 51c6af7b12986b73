"""One job per run directory. Rank 0 holds an exclusive OS lock (flock) on RUN/.trillion.lock for the
whole job, so a second job started on the same job.output_dir (a requeued SLURM job while the first
still runs, two people sharing a folder) exits 2 before touching anything, naming the holder. The OS
drops the lock when the holding process dies, however it dies, so a SLURM requeue or a torchrun
restart gets it as soon as the old job is gone; the file then still names the dead holder, and taking
it over says so. A clean exit empties the file. flock works on local disks and on Lustre and GPFS
mounted with flock support; on a file system without it the lock fails and says so."""

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from trillion.errors import ConfigError

log = logging.getLogger("trillion")
LOCK_FILE = ".trillion.lock"


class RunDirectoryLock:
    """Held from `acquire` to `release` (or the process's end)."""

    def __init__(self, output_dir: Path):
        self.path = Path(output_dir) / LOCK_FILE
        self.fd: int | None = None
        self.made_folder = False

    def acquire(self) -> None:
        output_dir = self.path.parent
        self.made_folder = not output_dir.exists()
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise ConfigError(
                f"job.output_dir={output_dir} cannot be used as a run directory ({error.strerror or error}). "
                "Give a --job.output_dir in a folder this job can create and write."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(
                    f"job.output_dir={output_dir}: the run-directory lock {self.path} cannot be taken on this file "
                    f"system ({error.strerror}). Use a --job.output_dir on a file system with flock support."
                ) from None
            raise ConfigError(
                f"job.output_dir={output_dir} is in use by another job ({describe(read_holder(self.path))}), which "
                "holds its lock. Two jobs writing one run directory corrupt each other's checkpoints and metrics: "
                "wait for that job to end (or stop it), or give this one another --job.output_dir."
            ) from None
        previous = read_holder(self.path)
        if previous:
            log.warning("took over the run-directory lock of a job that is gone (%s)", describe(previous))
        os.ftruncate(fd, 0)
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        os.ftruncate(self.fd, 0)  # a clean exit leaves no holder to take over from
        os.close(self.fd)  # closing drops the lock
        self.fd = None
        if self.made_folder and [p.name for p in self.path.parent.iterdir()] == [LOCK_FILE]:
            self.path.unlink()  # a run refused before it wrote anything leaves no folder behind
            self.path.parent.rmdir()


def read_holder(path: Path) -> dict:
    """The holder a lock file names ({} for an empty or unreadable one)."""
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def describe(holder: dict) -> str:
    if not holder:
        return "its host and PID not recorded"
    return f"host {holder.get('host')}, PID {holder.get('pid')}, started {holder.get('started')}"
