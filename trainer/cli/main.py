"""The `trillion` command: `trillion <command> [args]`. User errors print one paragraph (no
traceback) and exit with status 2."""

import importlib
import logging
import os
import sys
from typing import NamedTuple

from trillion.errors import ConfigError, RunAborted


class Command(NamedTuple):
    module: str  # whose `main(argv) -> int` runs the command, imported only when it runs (`plan` needs no model)
    summary: str


COMMANDS = {
    "train": Command(
        "trillion.trainer.cli.train", "train a model: trillion train [--config FILE] [--section.field=value ...]"
    ),
    "torchrun": Command(
        "trillion.trainer.cli.torchrun",
        "torchrun whose preemption (SIGTERM, SIGUSR1) saves and exits 0: trillion torchrun [torchrun's arguments]",
    ),
    "prepare-data": Command(
        "trillion.trainer.cli.prepare_data",
        "tokenize a corpus once into a token store: trillion prepare-data --out DIR [--workers N] [--data.path=...]",
    ),
    "plan": Command(
        "trillion.trainer.tools.plan_cli",
        "choose a parallel layout: trillion plan --model M --hardware H --gpus N --global-batch B",
    ),
    "tune": Command(
        "trillion.trainer.tools.tune",
        "measure the planner's best layouts: trillion tune --config FILE --nproc N --hardware H",
    ),
    "estimate": Command(
        "trillion.trainer.tools.estimate.cli",
        "check a layout's memory per rank at full scale on one CPU: trillion estimate --config FILE --world-size N",
    ),
    "plot": Command(
        "trillion.trainer.tools.plot.cli",
        "draw a run's curves, pipeline schedule and replica groups, or a layout's mesh: trillion plot RUN_DIR",
    ),
    "export": Command(
        "trillion.trainer.cli.export",
        "a checkpoint as a Hugging Face model: trillion export --checkpoint DIR --format hf OUT",
    ),
    "generate": Command(
        "trillion.trainer.cli.generate",
        "continue a prompt: trillion generate --checkpoint RUN_DIR --prompt TEXT [--max-new-tokens N] "
        "[--temperature T] [--top-k K]",
    ),
}


def usage() -> str:
    lines = ["usage: trillion <command> [args]", "", "commands:"]
    lines += [f"  {name:12s} {command.summary}" for name, command in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None, *, hooks=None) -> int:
    """`trillion ARGV`; `hooks` (a trillion.trainer.set_up.RunHooks) reach `trillion train` only."""
    argv = sys.argv[1:] if argv is None else argv
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == "0" else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"trillion: unknown command {argv[0]!r}.\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[argv[0]].module)
        return module.main(argv[1:], hooks) if hooks is not None else module.main(argv[1:])
    except KeyboardInterrupt as error:  # Ctrl-C: one line, no traceback, the shell's status for SIGINT
        print(f"trillion {argv[0]}: {error or 'interrupted (Ctrl-C)'}", file=sys.stderr)
        return 130
    except (ConfigError, RunAborted) as error:
        status = 2 if isinstance(error, ConfigError) else 1
        print(f"trillion {argv[0]}: {error}", file=sys.stderr)
        if argv[0] == "train":  # the other ranks stop too, with this message, instead of waiting for this one
            from trillion.trainer.launch.rendezvous import post_startup_error

            post_startup_error(str(error), status)
        return status
