"""Fault tolerance refused with one paragraph before any work (exit 2), or ended within a bounded wait (exit 1):
no dp_replicate room, a replica_id outside group_size, TORCHFT_LIGHTHOUSE unset or unreachable, torchft
missing. And without fault tolerance, a run never imports torchft."""

import socket
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers.fault_record import report
from tests.helpers.flags import TINY
from trillion.trainer.cli.main import main
from trillion.trainer.launch.env import LaunchEnv

FT = ["--fault_tolerance.enabled=true", "--fault_tolerance.group_size=2"]


def refused(tmp_path, capsys, *flags: str) -> tuple[int, str]:
    status = main(["train", *TINY, *FT, "--training.steps=2", f"--job.output_dir={tmp_path / 'run'}", *flags])
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err  # one paragraph
    return status, err


@pytest.mark.parametrize(
    ("flags", "world", "named"),
    [
        (["--parallel.dp_replicate=2"], 2, "no dp_replicate room"),
        (["--fault_tolerance.replica_id=2"], 1, "fault_tolerance.replica_id=2 is outside the 2 replica groups"),
        (["--fault_tolerance.group_size=1"], 1, "fault_tolerance.group_size=1 leaves no room"),
        (["--fault_tolerance.min_replica_size=3"], 1, "fault_tolerance.min_replica_size=3"),
        (["--training.dtype=fp16"], 1, "training.dtype=fp16"),
    ],
)
def test_a_group_layout_that_cannot_work_exits_2_before_any_work(flags, world, named, tmp_path, capsys, monkeypatch):
    """The check reads the resolved layout: dp_replicate=2 needs a world of 2 to resolve (the launch is simulated:
    the refusal comes before any process group)."""
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:9")
    launched = LaunchEnv(0, world, 0, torch.device("cpu"))
    monkeypatch.setattr("trillion.trainer.set_up.init_launch_env", lambda *args, **kwargs: launched)
    status, err = refused(tmp_path, capsys, *flags)
    assert status == 2 and named in err
    assert not (tmp_path / "run").exists()


def test_without_torchft_lighthouse_exits_2_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    status, err = refused(tmp_path, capsys)
    assert status == 2 and "TORCHFT_LIGHTHOUSE is not set" in err and "torchft_lighthouse --min_replicas" in err


def test_without_torchft_installed_exits_2_with_the_install_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:9")
    monkeypatch.setitem(sys.modules, "torchft", None)  # what `import torchft` meets when it is not installed
    status, err = refused(tmp_path, capsys)
    assert status == 2 and "pip install 'trillion[ft]'" in err


def test_an_unreachable_lighthouse_ends_the_group_within_its_timeout(tmp_path, capsys, monkeypatch):
    with socket.socket() as closed:  # a loopback port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://127.0.0.1:{port}")
    start = time.monotonic()
    status, err = refused(tmp_path, capsys, "--fault_tolerance.timeout_s=2")
    assert status == 1 and f"TORCHFT_LIGHTHOUSE=http://127.0.0.1:{port} did not answer within" in err
    assert time.monotonic() - start < 30


def test_a_run_without_fault_tolerance_does_not_import_torchft(tmp_path):
    # in a fresh interpreter: the trainer's modules and a step, with what they import at module level too
    code = (
        "import sys, pathlib; from tests.helpers.runs import run; "
        f"run(pathlib.Path({str(tmp_path / 'run')!r}), steps=1); "
        "print(sorted(name for name in sys.modules if name.split('.')[0] == 'torchft'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1:29510", "no http:// (or https://) scheme"),
        ("lighthouse:29510", "no http:// (or https://) scheme"),
        ("tcp://127.0.0.1:29510", "the scheme 'tcp'"),
        ("http://:29510", "names no host"),
        ("http://127.0.0.1:port", "Port could not be cast"),
    ],
)
def test_a_malformed_lighthouse_address_exits_2_at_once_naming_the_form(address, why, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", address)
    start = time.monotonic()
    status, err = refused(tmp_path, capsys)
    assert status == 2 and f"TORCHFT_LIGHTHOUSE={address!r} is not a Lighthouse address" in err and why in err
    took = time.monotonic() - start
    assert "http://HOST:PORT" in err and took < 10  # no wait on torchft's retries
    assert not (tmp_path / "run").exists()
    if address == "127.0.0.1:29510":
        report(
            "a Lighthouse address without its scheme",
            err.strip() + " (exit 2)",
            None,
            None,
            took,
            "TORCHFT_LIGHTHOUSE=127.0.0.1:29510 with fault tolerance on (recover: the time to the refusal; it waited "
            "out fault_tolerance.timeout_s (72 s in all at the default 60 s) and exited 1 before)",
        )
