"""`trillion prepare-data --out DIR [--workers N] [--config FILE] [--data.* ...] [--tokenizer.* ...]`
(`--verify DIR` checks a store's every chunk). What it writes and how: trainer/data/prepare.py."""

import argparse
import os
from pathlib import Path

from trillion.errors import ConfigError
from trillion.trainer.cli.args import CommandParser
from trillion.trainer.config.schema import load_config
from trillion.trainer.data import prepare as store_writer


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        "prepare-data",
        description=store_writer.__doc__,
        epilog="Other arguments are config overrides, as for `trillion train` (--data.path=..., "
        "--tokenizer.kind=..., ...).",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", help="the token store to write (a folder that must not exist yet)")
    what.add_argument(
        "--verify",
        metavar="DIR",
        help="check every chunk of the store DIR (and DIR/held_out) "
        "against its hash instead; exit 1 naming the damaged ones",
    )
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes (default: the CPUs)")
    p.add_argument("--config", help="a `trillion train` config; its [data], [tokenizer] and job.seed are used")
    return p


def main(argv: list[str]) -> int:
    args, overrides = build_parser().parse_known_args(argv)
    if args.verify:
        store_writer.verify(Path(args.verify))
        return 0
    if args.workers < 1:
        raise ConfigError(f"--workers={args.workers} must be at least 1.")
    config = load_config(args.config, overrides)
    store_writer.prepare(config, Path(args.out), args.workers)
    return 0
