"""A real torchft Lighthouse for the fault-tolerance tests (the `torchft_lighthouse` server users run), on a
free loopback port, and replica groups started as `trillion train` processes; everything is killed on the
way out, whatever happened (no process outlives the test)."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ENTRY = Path(__file__).resolve().parents[1] / "fault_tolerance" / "ft_entry.py"


@contextlib.contextmanager
def lighthouse(folder: Path, heartbeat_timeout_ms: int = 1500):
    """Yields the Lighthouse's address (http://127.0.0.1:PORT), started with the settings docs/checkpoints.md gives."""
    log = folder / "lighthouse.log"
    server = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("torchft_lighthouse")),
            "--min_replicas=1",
            "--quorum_tick_ms=100",
            "--join_timeout_ms=10000",
            f"--heartbeat_timeout_ms={heartbeat_timeout_ms}",
            "--bind=127.0.0.1:0",
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (found := re.search(r"listening on: http://\S+?:(\d+)", log.read_text())):
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield f"http://127.0.0.1:{found.group(1)}"
    finally:
        server.kill()
        server.wait(timeout=30)


class Groups:
    """Replica-group processes (ft_entry.py), each with its own log; `close` kills what still runs."""

    def __init__(self, folder: Path, address: str):
        self.folder, self.address, self.processes = folder, address, {}

    def start(self, name: str, flags: list[str], launcher: tuple = (sys.executable,), **env) -> subprocess.Popen:
        """`launcher ft_entry.py flags` (torchrun's command for a group of several processes)."""
        environment = {
            **os.environ,
            "TORCHFT_LIGHTHOUSE": self.address,
            "WANDB_MODE": "offline",
            "OMP_NUM_THREADS": "1",
            "RUST_LOG": "warn",
            **{key: str(value) for key, value in env.items()},
        }
        process = subprocess.Popen(
            [*launcher, str(ENTRY), *flags],
            stdout=(self.folder / f"{name}.log").open("w"),
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=True,
        )
        self.processes[name] = process
        return process

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text()

    def wait(self, name: str, timeout: float) -> int:
        return self.processes[name].wait(timeout=timeout)

    def close(self) -> None:
        """Kill every group's whole process group (a torchrun's workers too), then reap them."""
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
