"""A small subset of the default corpus (20 short standard-library sources as a jsonl file) and its
token store, written once per session by the `trillion prepare-data` command itself."""

import json
import os
import subprocess
import sys

import pytest

from trillion.trainer.data.loader import default_corpus_files

SUBSET_FILES = 20


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    small = [p for p in default_corpus_files(0) if 2_000 < p.stat().st_size < 8_000][:SUBSET_FILES]
    path = tmp_path_factory.mktemp("corpus") / "stdlib.jsonl"
    path.write_text(
        "".join(json.dumps({"text": p.read_text(encoding="utf-8", errors="replace")}) + "\n" for p in small)
    )
    return path


@pytest.fixture(scope="session")
def store(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("stores") / "stdlib.tokens"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trillion",
            "prepare-data",
            f"--data.path={corpus}",
            "--out",
            str(out),
            "--workers",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tokens/s" in result.stderr
    store_summaries.append(result.stderr)
    return out


store_summaries = []  # what prepare-data printed writing the session's store
