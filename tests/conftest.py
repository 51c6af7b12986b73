import os
import re

# Triton decides between compiling and interpreting when a kernel is defined, and any test module
# that imports the trainer defines them: so the switch is set here, before the first import. On CPU
# every Triton kernel runs under the interpreter; tests of the fallback set it to 0 themselves.
# `pytest -m gpu` (tests/gpu/) runs the kernels natively instead, so there the switch stays off.
_INTERPRET_SET_HERE = "TRITON_INTERPRET" not in os.environ
os.environ.setdefault("TRITON_INTERPRET", "1")

# No test may reach the network: W&B writes offline runs, the hub is never asked.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def pytest_configure(config):
    # Runs before any test module is imported, hence before any kernel is defined.
    if _INTERPRET_SET_HERE and re.search(r"(?<!not )\bgpu\b", config.getoption("markexpr") or ""):
        del os.environ["TRITON_INTERPRET"]
