"""Every shell block the docs mark runnable works as written: a block marked `<!-- runnable -->` is run here, in a
fresh folder, as a user would type it (the installed `trillion` and `torchrun` on the PATH, W&B offline); one marked
`<!-- runnable: tests/FILE.py -->` is run by that test, which must quote each of its commands and run by default."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.test_claims import runs_by_default
from tests.helpers.documentation import ROOT, documentation_files, runnable_blocks

BLOCKS = [block for path in documentation_files() for block in runnable_blocks(path)]
RUN_HERE = [block for block in BLOCKS if block.runner is None]
RUN_ELSEWHERE = [block for block in BLOCKS if block.runner is not None]


def user_env() -> dict:
    """This environment as a user's shell would have it: the installed commands first on the PATH, no launcher's
    rank variables, W&B offline, one intra-op thread a process (the suite shares two cores)."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "SLURM_"))
    }
    path = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return {**env, "PATH": path, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("block", RUN_HERE, ids=[f"{b.path.name}:{b.line}" for b in RUN_HERE])
def test_a_runnable_block_runs_as_written(block, tmp_path):
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.source],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{block.path.name}:{block.line}\n{block.source}\n{result.stderr[-3000:]}"


@pytest.mark.parametrize("block", RUN_ELSEWHERE, ids=[f"{b.path.name}:{b.line}" for b in RUN_ELSEWHERE])
def test_a_block_run_by_a_test_is_quoted_by_it(block):
    runner = ROOT / block.runner
    assert runner.is_file() and runs_by_default(runner), f"{block.path.name}:{block.line}: {block.runner}"
    source = " ".join(runner.read_text().split())
    assert [c for c in block.commands if " ".join(c.split()) not in source] == [], block.runner


def test_the_docs_have_runnable_blocks_of_both_kinds():
    assert {b.path.name for b in RUN_HERE} >= {"getting-started.md", "planning.md"}
    assert RUN_ELSEWHERE


def test_the_marker_is_read_with_its_runner_and_its_continued_commands(tmp_path):
    page = tmp_path / "guide.md"
    page.write_text(
        "<!-- runnable -->\n```bash\ntrillion plan --model debug \\\n    --gpus 8   # a comment\n# alone\n```\n\n"
        "```bash\nnot marked\n```\n\n<!-- runnable: tests/test_x.py -->\n```bash\ntrillion train\n```\n"
    )
    first, second = runnable_blocks(page)
    assert (first.runner, first.commands, first.line) == (None, ["trillion plan --model debug --gpus 8"], 1)
    assert (second.runner, second.commands) == ("tests/test_x.py", ["trillion train"])
    page.write_text("<!-- runnable -->\n```python\nprint()\n```\n")
    with pytest.raises(ValueError, match="runnable marker"):
        runnable_blocks(page)
