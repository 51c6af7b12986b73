"""`trillion export --checkpoint DIR --format hf OUT`: a training checkpoint as a Hugging Face model folder
(trainer/checkpoint/export.py writes it)."""

from pathlib import Path

from trillion.errors import ConfigError
from trillion.trainer.checkpoint.export import export_hf, resolve_checkpoint

USAGE = "usage: trillion export --checkpoint DIR --format hf [--weights live|ema] OUT"
FORMATS = ("hf",)
WEIGHTS = ("live", "ema")  # the trained parameters, or their moving average (optimizer.ema_decay)


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(
            USAGE + "\n\nWrites OUT/model.safetensors and OUT/config.json from a checkpoint step directory "
            "(or the newest one of a run directory). --weights live (default): the trained parameters; --weights ema: "
            "their moving average, kept by runs with optimizer.ema_decay > 0."
        )
        return 0
    options, positional, args = {}, [], iter(argv)
    for arg in args:
        if arg in ("--checkpoint", "--format", "--weights"):
            options[arg[2:]] = next(args, "")
        elif arg.startswith(("--checkpoint=", "--format=", "--weights=")):
            key, _, value = arg[2:].partition("=")
            options[key] = value
        elif arg.startswith("--"):
            raise ConfigError(f"Unknown option {arg!r}. {USAGE}")
        else:
            positional.append(arg)
    if not options.get("checkpoint") or len(positional) != 1:
        raise ConfigError(f"Give the checkpoint and one output folder. {USAGE}")
    if options.get("format", "hf") not in FORMATS:
        raise ConfigError(f"--format {options['format']!r} is not known. Use {', '.join(FORMATS)}.")
    if options.get("weights", "live") not in WEIGHTS:
        raise ConfigError(f"--weights {options['weights']!r} is not known. Use {' or '.join(WEIGHTS)}.")
    step = resolve_checkpoint(Path(options["checkpoint"]))
    written = export_hf(step, Path(positional[0]), options.get("weights", "live"))
    print(f"exported {step} -> {written} ({written.stat().st_size / 1e6:.1f} MB) and {written.parent / 'config.json'}")
    return 0
