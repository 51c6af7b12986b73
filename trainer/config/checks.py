"""What a config field accepts, declared beside the field (`doc(default, text, check)`, fields.py).

Each check says whether a value is acceptable (`problem(value)`: None, or what is wrong) and gives
values it refuses (`bad_values()`), so tests/test_config_validation.py can walk every field of every
section and prove that each one is refused with the setting named. A section's relations between
its own fields live in its `check_relations` method; those spanning sections in Config's.
"""

import math
import os
import tempfile
from pathlib import Path


class Check:
    def problem(self, value) -> str | None:
        raise NotImplementedError

    def bad_values(self) -> tuple:
        """Values this check refuses, for the test that walks every field."""
        raise NotImplementedError


class Range(Check):
    """low <= value <= high (either bound optional; `open_low` excludes low itself); `also` lists
    sentinel values accepted besides the range (0 = keep the preset's, -1 = automatic), with their meaning."""

    def __init__(
        self, low=None, high=None, *, open_low: bool = False, open_high: bool = False, also: dict | None = None
    ):
        self.low, self.high, self.open_low, self.open_high, self.also = low, high, open_low, open_high, also or {}

    def problem(self, value) -> str | None:
        if value in self.also:
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, {self._range()}"
        below = self.low is not None and (value <= self.low if self.open_low else value < self.low)
        above = self.high is not None and (value >= self.high if self.open_high else value > self.high)
        return f"is out of range: it must be {self._range()}" if below or above else None

    def _range(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'above' if self.open_low else 'at least'} {self.low}")
        if self.high is not None:
            parts.append(f"{'below' if self.open_high else 'at most'} {self.high}")
        text = " and ".join(parts) or "any number"
        return text + "".join(f", or {value} ({meaning})" for value, meaning in self.also.items())

    def bad_values(self) -> tuple:
        bad = []
        if self.low is not None:
            below = self.low if self.open_low else self.low - 1
            bad.append(below if below not in self.also else min(self.also) - 1)  # 0 = keep: -1 is out
        if self.high is not None:
            bad.append(self.high if self.open_high else self.high + 1)
        return tuple(bad)


class OneOf(Check):
    """One of a table of names: a tuple, or a function returning the table from where the choices are
    made (the kernels' implementations, the presets), so it stays the one source and is imported only
    when a value is checked; `extra` adds names this layer resolves (auto). A choice `prefix:N` stands
    for prefix:1, prefix:2, ..."""

    def __init__(self, table, *, extra: tuple = (), case_sensitive: bool = True):
        self.table, self.extra, self.case_sensitive = table, extra, case_sensitive

    def choices(self) -> tuple:
        return (*self.extra, *(self.table() if callable(self.table) else self.table))

    def problem(self, value) -> str | None:
        choices = self.choices()
        fold = (lambda s: s) if self.case_sensitive else str.lower
        if any(_matches(c, value) if c.endswith(":N") else fold(c) == fold(value) for c in choices):
            return None
        return f"is not known. Use one of: {', '.join(choices)}"

    def bad_values(self) -> tuple:
        return ("no-such-choice",)


def _matches(pattern: str, value: str) -> bool:
    """`prefix:N`: the prefix, a colon and a positive integer (selective:3)."""
    prefix = pattern.removesuffix(":N")
    head, colon, tail = value.partition(":")
    return head == prefix and colon == ":" and tail.isdigit() and int(tail) > 0


class Text(Check):
    """A string: any text (names, W&B tags) unless `nonempty`."""

    def __init__(self, *, nonempty: bool = False):
        self.nonempty = nonempty

    def problem(self, value) -> str | None:
        return "must not be empty" if self.nonempty and not value.strip() else None

    def bad_values(self) -> tuple:
        return ("",) if self.nonempty else ()


class Flag(Check):
    """A bool: its type is its whole range (the loader refuses anything but true/false)."""

    def problem(self, value) -> str | None:
        return None

    def bad_values(self) -> tuple:
        return ("maybe",)


class ExistingPath(Check):
    """A file or folder that must exist when given (empty = not used); `hint` says what to give."""

    def __init__(self, hint: str):
        self.hint = hint

    def problem(self, value) -> str | None:
        # the hint is a sentence; validate_config ends the problem with its own period
        return None if not value or Path(value).exists() else f"no such file or folder. {self.hint.rstrip('.')}"

    def bad_values(self) -> tuple:
        return ("/nonexistent/trillion-check",)


class CreatableDir(Check):
    """A folder this process can create or write: the nearest existing ancestor is a writable folder."""

    def problem(self, value) -> str | None:
        if not value.strip():
            return "must name a folder"
        path = Path(value).absolute()
        while not path.exists():
            path = path.parent
        if not path.is_dir():
            return f"cannot be created: {path} is a file, not a folder. Choose another folder"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"cannot be created or written: {path} is not writable by this user. Choose a writable folder"
        return None

    def bad_values(self) -> tuple:
        return ("", "/dev/null/run")


def creatable_problem(path: str | Path) -> str | None:
    """Why `path` (a file or folder not made yet) cannot be made, or None: the nearest existing folder
    above it takes a new folder (tried: one is made and removed; os.access says yes to root on /proc)."""
    existing = Path(path).absolute().parent
    while not existing.exists():  # folders this user makes below the nearest existing one are its own
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".trillion-", suffix=".probe", dir=existing))
    except OSError as error:
        return f"making a folder in {existing} fails ({error.strerror or error})"
    return None
