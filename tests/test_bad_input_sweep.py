"""A sweep of bad files and environments, beyond the per-field checks of test_config_validation.py:
each case runs the real command in a subprocess and must exit with its status (2: a user error, 1: a
runtime failure) and one paragraph on stderr that names the setting or the file (and, for a file, its
cause: file:line of a bad JSON line, the byte offset of undecodable text), never a traceback.

The cases are independent subprocesses that mostly wait on imports, so the module starts all the
selected ones at once (a few at a time) and each test collects its own; a case that gets past the
data would train a 1-layer model for one step. Each kind of input keeps a case in the default run;
the other cases of a kind run with -m slow (SLOW). The kill test stops a running `trillion prepare-data`
and checks that its workers end quietly and that the rerun finishes the store.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

TINY = (
    "--training.steps=1",
    "--training.seq_len=16",
    "--training.global_batch_size=2",
    "--training.micro_batch_size=1",
    "--eval.interval=0",
    "--model.n_layers=1",
    "--model.dim=32",
    "--model.n_heads=2",
    "--model.n_kv_heads=2",
    "--logging.wandb=false",
)
AT_ONCE = 3  # subprocesses running together: they spend most of their time importing
TIMEOUT_S = 240


@dataclasses.dataclass(frozen=True)
class Case:
    """`trillion ARGV` ({files} is the folder of the bad files below) must exit `status` with every
    fragment of `names` on stderr and none of `absent`."""

    argv: tuple[str, ...]
    names: tuple[str, ...]
    status: int = 2
    env: tuple[tuple[str, str], ...] = ()
    absent: tuple[str, ...] = ()


def train(*args: str) -> tuple[str, ...]:
    """`trillion train` of a tiny model into ./run, with `args`."""
    return ("train", *TINY, "--job.output_dir=run", *args)


def write_files(folder: Path) -> None:
    """The bad inputs, one file (or folder) each."""
    (folder / "empty.txt").write_bytes(b"")
    (folder / "empty.jsonl").write_bytes(b"")
    (folder / "blank.jsonl").write_text("\n\n   \n")
    (folder / "bad.jsonl").write_text('{"text": "one"}\n{"text": oops}\n{"text": "three"}\n')
    (folder / "list.jsonl").write_text('{"text": "one"}\n["not", "a", "record"]\n')
    (folder / "latin1.txt").write_bytes(b"x" * 2044 + "café au lait".encode("latin-1"))
    (folder / "fake.parquet").write_text("not parquet at all\n")
    (folder / "body.jsonl").write_text('{"body": "the text is here"}\n')
    (folder / "numbers.json").write_text(json.dumps([{"text": "fine"}, {"text": 5}]))
    (folder / "table.csv").write_text("text\nhello\n")
    (folder / "no_data").mkdir()
    (folder / "no_data" / "README.md").write_text("no data file here\n")
    (folder / "mixed").mkdir()
    (folder / "mixed" / "good.jsonl").write_text('{"text": "fine"}\n')
    (folder / "mixed" / "broken.jsonl").write_text('{"text": "fine"}\n{"text": "cut short"\n')
    (folder / "passwd.json").write_text("root:x:0:0:root:/root:/bin/bash\n")  # not a tokenizer.json
    (folder / "ranks.tiktoken").write_text("IQ== 0\nnot-a-rank\n")
    (folder / "bad.toml").write_text("[model\nname = 'debug'\n")
    (folder / "hardware.toml").write_text('device = "h100"\ngpus_per_node = [\n')
    (folder / "a_file").write_text("a file, not a folder\n")
    (folder / "store").mkdir()
    (folder / "store" / "tokens.bin").write_bytes(b"\0" * 16)  # no manifest.json


F = "{files}"
CASES = {
    # data files
    "empty txt": Case(train(f"--data.path={F}/empty.txt"), ("data.path=", "empty.txt is empty", "holds no text")),
    "empty jsonl": Case(train(f"--data.path={F}/empty.jsonl"), ("data.path=", "empty.jsonl is empty")),
    "jsonl of blank lines": Case(train(f"--data.path={F}/blank.jsonl"), ("blank.jsonl holds no records",)),
    "malformed jsonl line": Case(
        train(f"--data.path={F}/bad.jsonl"),
        ("data.path=", "bad.jsonl:2 is not valid JSON", "column 10"),
        absent=("Failed to load JSON", "data.split", "one set of columns"),  # the library's line, unfitting advice
    ),
    "jsonl line not a record": Case(train(f"--data.path={F}/list.jsonl"), ("list.jsonl:2 is a JSON array",)),
    "malformed line in a folder": Case(
        train(f"--data.path={F}/mixed"), ("data.path=", "broken.jsonl:2 is not valid JSON"), absent=("good.jsonl",)
    ),
    "latin-1 txt": Case(
        train(f"--data.path={F}/latin1.txt"),
        ("data.path=", "latin1.txt is not UTF-8 text", "byte offset 2047", "0xE9", "UTF-8 encoding"),
    ),
    "parquet that is not parquet": Case(
        train(f"--data.path={F}/fake.parquet"), ("fake.parquet is not a readable Parquet file",)
    ),
    "folder without data files": Case(train(f"--data.path={F}/no_data"), ("no_data", "no data file")),
    "file of an unknown kind": Case(train(f"--data.path={F}/table.csv"), ("table.csv", ".jsonl")),
    "missing data path": Case(train(f"--data.path={F}/nothing.jsonl"), ("data.path=", "nothing.jsonl", "no such")),
    "text field missing": Case(
        train(f"--data.path={F}/body.jsonl"), ("data.text_field='text'", "body.jsonl", "its columns: body")
    ),
    "text field not text": Case(
        train(f"--data.path={F}/numbers.json"), ("data.text_field='text'", "numbers.json", "row 1", "(int)")
    ),
    "malformed eval set": Case(
        train("--eval.interval=1", "--eval.steps=1", f"--eval.path={F}/bad.jsonl"),
        ("eval.path=", "bad.jsonl:2 is not valid JSON"),
    ),
    "prepared store without manifest": Case(
        train(f"--data.prepared={F}/store"), ("data.prepared=", "store", "manifest.json")
    ),
    "hub unreachable": Case(
        train("--data.name=nobody/no-such-dataset"),
        ("data.name='nobody/no-such-dataset'", "HF_HUB_OFFLINE"),
        status=1,
        env=(("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1")),
    ),
    # tokenizer files
    "hf tokenizer that is not one": Case(
        train("--tokenizer.kind=hf", f"--tokenizer.path={F}/passwd.json"),
        ("tokenizer.path=", "passwd.json", "does not load as a Hugging Face tokenizer", "expected value"),
    ),
    "tiktoken ranks malformed": Case(
        train("--tokenizer.kind=tiktoken", f"--tokenizer.path={F}/ranks.tiktoken"),
        ("tokenizer.path=", "ranks.tiktoken", "line 2", "not-a-rank"),
    ),
    "tokenizer path a folder": Case(
        train("--tokenizer.kind=hf", f"--tokenizer.path={F}/no_data"), ("tokenizer.path=", "is a folder")
    ),
    # config files and output folders
    "config that does not parse": Case(("train", "--config", f"{F}/bad.toml"), ("bad.toml", "TOML")),
    "output dir uncreatable": Case(
        ("train", *TINY, "--job.output_dir=/proc/forbidden/run"), ("job.output_dir=", "/proc/forbidden/run")
    ),
    "output dir under a file": Case(
        ("train", *TINY, f"--job.output_dir={F}/a_file/run"), ("job.output_dir=", "a_file")
    ),
    # environments
    "WORLD_SIZE not a number": Case(train(), ("WORLD_SIZE='abc'",), env=(("WORLD_SIZE", "abc"),)),
    "RANK not a number": Case(train(), ("RANK='x1'",), env=(("RANK", "x1"),)),
    # prepare-data
    "prepare-data out uncreatable": Case(
        ("prepare-data", "--out", "/proc/forbidden", "--workers", "1"), ("--out /proc/forbidden cannot be created",)
    ),
    "prepare-data out under a file": Case(
        ("prepare-data", "--out", f"{F}/a_file/store", "--workers", "1"), ("--out", "a_file is a file")
    ),
    "prepare-data out exists": Case(("prepare-data", "--out", f"{F}/store"), ("--out", "already exists")),
    "prepare-data malformed jsonl": Case(
        ("prepare-data", "--out", "store", "--workers", "2", f"--data.path={F}/bad.jsonl"),
        ("data.path=", "bad.jsonl:2 is not valid JSON"),
    ),
    "prepare-data empty txt": Case(
        ("prepare-data", "--out", "store", f"--data.path={F}/empty.txt"), ("empty.txt is empty",)
    ),
    "prepare-data verify not a store": Case(
        ("prepare-data", "--verify", f"{F}/no_data"), ("--verify=", "no_data", "not a token store")
    ),
    "prepare-data workers 0": Case(("prepare-data", "--out", "store", "--workers", "0"), ("--workers=0",)),
    # plan
    "plan with several errors": Case(
        ("plan", "--model", "gpt-9000", "--hardware", "no-such-machine", "--gpus", "8"),
        ("3 problems", "--global-batch", "--model 'gpt-9000'", "--hardware 'no-such-machine'"),
    ),
    "plan bad numbers": Case(
        ("plan", "--model", "debug", "--hardware", "frontier", "--gpus", "0", "--global-batch", "8", "--tp", "0"),
        ("2 problems", "--gpus 0", "--tp 0"),
    ),
    "plan config-out uncreatable": Case(
        ("plan", "--model", "debug", "--hardware", "frontier", "--gpus", "8", "--global-batch", "8")
        + ("--config-out", "/proc/forbidden/plan.toml"),
        ("--config-out /proc/forbidden/plan.toml cannot be written",),
    ),
    "plan hardware file not TOML": Case(
        ("plan", "--model", "debug", "--hardware", f"{F}/hardware.toml", "--gpus", "8", "--global-batch", "8"),
        ("hardware.toml",),
    ),
}
# The rest of each kind, with -m slow: every kind above keeps a representative in the default run.
SLOW = {
    "jsonl of blank lines",
    "jsonl line not a record",
    "malformed line in a folder",
    "file of an unknown kind",
    "text field not text",
    "malformed eval set",
    "prepared store without manifest",
    "hub unreachable",
    "tiktoken ranks malformed",
    "tokenizer path a folder",
    "config that does not parse",
    "output dir under a file",
    "RANK not a number",
    "prepare-data out under a file",
    "prepare-data out exists",
    "prepare-data malformed jsonl",
    "prepare-data empty txt",
    "prepare-data verify not a store",
    "prepare-data workers 0",
}
NEEDS_PROC = {name for name, case in CASES.items() if any("/proc/" in arg for arg in case.argv)}


def run_case(case: Case, files: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "HF_DATASETS_CACHE": str(cwd / "hf-cache"),
        "PYTHONUNBUFFERED": "1",
        **dict(case.env),
    }
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_")
    for key in [key for key in env if key.startswith(launcher) and key not in dict(case.env)]:
        del env[key]  # a test run inside a launched job is still one process
    argv = [arg.replace(F, str(files)) for arg in case.argv]
    return subprocess.run(
        [sys.executable, "-m", "trillion", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def sweep(request, tmp_path_factory):
    """The selected cases, started together: {case name: future of its CompletedProcess}."""
    files = tmp_path_factory.mktemp("bad-inputs")
    write_files(files)
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if item.module is request.module and item.originalname == "test_bad_input"
    ]
    pool = ThreadPoolExecutor(max_workers=AT_ONCE)
    futures = {
        name: pool.submit(run_case, CASES[name], files, tmp_path_factory.mktemp(name.replace(" ", "-")))
        for name in selected
        if not (name in NEEDS_PROC and not Path("/proc/self").exists())
    }
    yield futures
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize(
    "name", [pytest.param(name, id=name, marks=[pytest.mark.slow] if name in SLOW else []) for name in CASES]
)
def test_bad_input(name, sweep):
    if name not in sweep:
        pytest.skip("needs /proc (Linux) for a folder that cannot be created")
    case = CASES[name]
    result = sweep[name].result()
    err = result.stderr
    command = case.argv[0]
    assert result.returncode == case.status, (result.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    paragraphs = [line for line in err.splitlines() if line.startswith(f"trillion {command}: ")]
    assert len(paragraphs) == 1, err[-3000:]  # one paragraph, said once
    for fragment in case.names:
        assert fragment in paragraphs[0], (fragment, paragraphs[0])
    for fragment in case.absent:
        assert fragment not in err, (fragment, err[-3000:])


def test_killed_prepare_data_workers_end_quietly_and_the_rerun_finishes(tmp_path):
    """SIGKILL of `trillion prepare-data` (the default corpus, 2 workers) once a shard is published:
    its workers end at once without a traceback (they used to print a BrokenPipeError each), and the
    same command then resumes from the kept shards and publishes the store."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "trillion", "prepare-data", "--out", str(tmp_path / "store"), "--workers", "2"]
    staging = tmp_path / "store.staging"
    first = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not list(staging.glob("shard-*[0-9].npz")) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, "prepare-data ended before it could be killed: " + first.stderr.read()[-2000:]
    os.kill(first.pid, signal.SIGKILL)
    _, err = first.communicate(timeout=60)  # stderr closes when the workers, which share it, have ended too
    assert first.returncode == -signal.SIGKILL
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-3000:]
    kept = len(list(staging.glob("shard-*[0-9].npz")))
    assert kept >= 1

    rerun = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "Traceback" not in rerun.stderr
    assert f"resuming {staging}" in rerun.stderr
    assert (tmp_path / "store" / "manifest.json").is_file() and not staging.exists()


@pytest.mark.slow
def test_ctrl_c_of_prepare_data_says_what_is_kept(tmp_path):
    """Ctrl-C (SIGINT to the whole process group): the workers leave it to the parent, which stops
    them and says in one line how many shards are kept for the rerun (exit 130)."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "trillion", "prepare-data", "--out", str(tmp_path / "store"), "--workers", "2"]
    staging = tmp_path / "store.staging"
    run = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not list(staging.glob("shard-*[0-9].npz")) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run.poll() is None
    os.killpg(run.pid, signal.SIGINT)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "trillion prepare-data: interrupted (Ctrl-C) with" in err and str(staging) in err
