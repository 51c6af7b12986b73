import os

# Triton decides between compiling and interpreting when a kernel is defined, and any test module
# that imports the trainer defines them: so the switch is set here, before the first import. On CPU
# every Triton kernel runs under the interpreter; tests of the fallback set it to 0 themselves.
os.environ.setdefault("TRITON_INTERPRET", "1")

# No test may reach the network: W&B writes offline runs, the hub is never asked.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
