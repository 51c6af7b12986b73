"""The one exception type for user mistakes: the CLI prints its message (no traceback) and exits 2."""


class ConfigError(Exception):
    """Bad user input: the message names the setting and how to fix it."""
