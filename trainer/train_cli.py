"""`trillion train [--config FILE] [--section.field=value ...]`."""
from trillion.trainer.config import help_text, load_config
from trillion.trainer.train import train

USAGE = "usage: trillion train [--config FILE] [--section.field=value ...]\n\n"


def main(argv: list[str]) -> int:
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
    train(load_config(config_path, overrides))
    return 0
