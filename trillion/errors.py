"""Errors the CLI reports as one paragraph, without a traceback."""


class ConfigError(Exception):
    """Bad user input: the message names the setting and how to fix it (exit status 2)."""


class Interrupted(KeyboardInterrupt):
    """The user stopped the run (Ctrl-C); the message says what was kept (exit status 130)."""


class RunAborted(Exception):
    """A runtime failure, not a mistake in the settings: checkpoint I/O, divergence, a collective
    that never completed, a lost rank. The message says where and what to do (exit status 1)."""
