"""The one argument parser of every `trillion` command: a usage mistake is a user error (one paragraph
naming the command's --help, exit 2), never argparse's own exit."""

import argparse

from trillion.errors import ConfigError


class CommandParser(argparse.ArgumentParser):
    """`trillion <command>`'s parser; the description keeps its line breaks."""

    def __init__(self, command: str, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(prog=f"trillion {command}", **kwargs)

    def error(self, message: str):
        raise ConfigError(f"{message}. See `{self.prog} --help`.")
