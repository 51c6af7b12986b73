"""Errors the CLI reports as one paragraph, without a traceback."""


class ConfigError(Exception):
    """Bad user input: the message names the setting and how to fix it (exit status 2)."""


class RunAborted(Exception):
    """The run stopped for a reason outside its settings, such as a collective that never
    completed; the message says where (exit status 1)."""
