"""`trillion train [--config FILE] [--section.field=value ...]`."""

import torch.distributed as dist

from trillion.trainer.config.schema import help_text, load_config
from trillion.trainer.train import RunHooks, train

USAGE = "usage: trillion train [--config FILE] [--section.field=value ...]\n\n"


def main(argv: list[str], hooks: RunHooks | None = None) -> int:
    """`hooks`: see trillion.trainer.set_up.RunHooks (tests inject faults through them)."""
    if "-h" in argv or "--help" in argv:
        print(USAGE + help_text())
        return 0
    config_path, overrides, args = None, [], iter(argv)
    for arg in args:
        if arg == "--config":
            config_path = next(args, None)
        elif arg.startswith("--config="):
            config_path = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    joined_here = not (dist.is_available() and dist.is_initialized())  # a caller's group stays the caller's
    try:
        train(load_config(config_path, overrides), hooks=hooks)
    finally:
        # Leave the process group however the run ends: a rank that exits with gloo's threads still
        # attached to a peer that has gone (an error on one rank, or only a peer finishing first) can
        # abort in C++ at interpreter exit (exit -6, "terminate called") instead of 0, 2 or 1.
        if joined_here and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0
