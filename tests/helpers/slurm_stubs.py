"""A job script run by bash with SLURM's commands replaced by recorders: `stubbed(tmp_path, stubs, **variables)`
writes each stub (name -> bash body) into tmp_path and returns the environment that puts them first on PATH,
with SLURM's variables of a small job, and the file the stubs append their calls to (RECORD)."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def stubbed(tmp_path: Path, stubs: dict[str, str], **variables: str) -> tuple[dict, Path]:
    for name, body in stubs.items():
        (tmp_path / name).write_text(f"#!/bin/bash\n{body}\n")
        (tmp_path / name).chmod(0o755)
    record = tmp_path / "record"
    env = {
        **os.environ,
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "RECORD": str(record),
        "SLURM_JOB_ID": "77",
        "SLURM_SUBMIT_DIR": str(ROOT),
        **variables,
    }
    return env, record
