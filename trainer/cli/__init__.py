"""The command line: `trillion <command>` (main.py) and the entry points of train, generate, prepare-data and
export, all built on one argument parser (args.py) whose mistakes are user errors."""

from trillion.trainer.cli.main import main

__all__ = ["main"]
