"""The tables of layout choices (parallel/modes.py): torch-free for the planner, and one refusal
for the trainer and the planner alike."""

import subprocess
import sys

import pytest

from trillion.errors import ConfigError
from trillion.parallel.modes import SCHEDULES, check_schedule, checkpoint_mode, checkpointed_blocks
from trillion.trainer.config.schema import Parallel, help_text


def test_the_tables_import_without_torch():
    code = "import sys, trillion.parallel.modes, trillion.parallel.planner.search; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


@pytest.mark.parametrize(
    "args, words",
    [
        (("DualPipeV", 2, 3), ["DualPipeV", "2 x parallel.pp = 4"]),
        (("1F1B", 4, 3), ["at least as many micro-batches", "GPipe"]),
        (("Interleaved1F1B", 2, 5), ["rounds of pp=2", "4 or 6"]),
        (("ZBVZeroBubble", 2, 4, 0, True), ["compile.enabled=false"]),
        (("ZBVZeroBubble", 2, 4, 3), ["pp_virtual_stages=3", "two stages per rank"]),
        (("Zigzag", 2, 4), ["pp_schedule='Zigzag'", "DualPipeV"]),
    ],
)
def test_refused_schedules(args, words):
    with pytest.raises(ConfigError) as error:
        check_schedule(*args)
    for word in words:
        assert word in str(error.value)


def test_accepted_schedules():
    assert check_schedule("gpipe", 4, 1) == (SCHEDULES["GPipe"], 1)  # GPipe takes any micro-batch count
    assert check_schedule("DualPipeV", 2, 4) == (SCHEDULES["DualPipeV"], 2)
    assert check_schedule("Interleaved1F1B", 2, 4, 3) == (SCHEDULES["Interleaved1F1B"], 3)
    assert check_schedule("DualPipeV", 1, 1, 5, True)[1] == 1  # no pipeline: nothing but the name matters
    with pytest.raises(ConfigError, match="model has only 2 layers"):
        check_schedule("Interleaved1F1B", 2, 4, 3, n_layers=2)


def test_checkpoint_modes():
    assert checkpointed_blocks("selective", 5) == [0, 2, 4]
    assert checkpointed_blocks("selective:3", 7) == [0, 3, 6]
    assert checkpointed_blocks("none", 4) == [] and checkpointed_blocks("full", 3) == [0, 1, 2]
    assert checkpoint_mode("selective:op").op_level
    with pytest.raises(ConfigError, match="selective:N"):
        checkpoint_mode("selective:0")


def test_config_docs_read_the_tables():
    text = help_text()
    assert "refused" not in Parallel.__dataclass_fields__["pp_schedule"].metadata["doc"]
    for name in SCHEDULES:
        assert name in text
    assert "selective:op" in text
