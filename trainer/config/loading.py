"""Reading a Config: the defaults, then a TOML file, then `--section.field=value` overrides, each
value turned into its field's type, then every check (tree.validate_config)."""

import dataclasses
import types
import typing
from pathlib import Path

import tomllib

from trillion.errors import ConfigError
from trillion.trainer.config.tree import Config, validate_config


def _coerce(value, kind, where: "Where"):
    """Turn a TOML value or a CLI string into the field's type, or say what was expected. One rule
    for every type, booleans included: a TOML value must already be of its field's TOML type (`true`,
    not "yes" or 1); only command-line text is parsed (true/false, 1/0, yes/no, on/off; 2e5 steps)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    if where.from_text and kind is not str:
        text = value.strip()
        if kind is bool:
            if text.lower() in ("true", "1", "yes", "on"):
                return True
            if text.lower() in ("false", "0", "no", "off"):
                return False
        else:
            try:
                return kind(text)
            except ValueError:
                if kind is int and _is_integral_float(text):  # 2e5 steps
                    return int(float(text))
        raise where.error(value, kind)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise where.error(value, kind)
    return value


@dataclasses.dataclass(frozen=True)
class Where:
    """Where a value was given: a `--section.field=value` flag, or a line of a TOML file."""

    key: str
    file: str | None = None
    line: int | None = None

    @property
    def from_text(self) -> bool:
        return self.file is None

    def error(self, value, kind) -> ConfigError:
        name = kind.__name__
        if self.from_text:
            return ConfigError(
                f"--{self.key}={value!r} is not a valid {name}. Give e.g. --{self.key}={_example(kind)}."
            )
        section, _, field = self.key.partition(".")
        at = f"{self.file}, line {self.line}" if self.line else self.file
        toml = "true or false (unquoted)" if kind is bool else f"{field} = {_example(kind)}"
        return ConfigError(
            f"{at}: {field} = {_toml_repr(value)} in [{section}] is not a valid {name} ({self.key}). "
            f"Write {toml} there."
        )


def _toml_repr(value) -> str:
    return {True: "true", False: "false"}.get(value, repr(value)) if isinstance(value, bool) else repr(value)


def _line_of(text: str, key: str) -> int | None:
    """The line of `field = ...` under `[section]` in a TOML text (None when written another way)."""
    section, _, field = key.partition(".")
    current = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("[") and stripped.endswith("]"):
            current = stripped.strip("[] ")
        elif current == section and stripped.partition("=")[0].strip().strip("\"'") == field:
            return number
    return None


def _is_integral_float(text: str) -> bool:
    try:
        return float(text).is_integer()
    except ValueError:
        return False


def _example(kind) -> str:
    return {int: "8", float: "0.001", bool: "true", str: '"text"'}[kind]


def _set(config: Config, key: str, value, where: Where | None = None) -> None:
    section_name, _, field_name = key.partition(".")
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section_name not in sections or not field_name:
        raise ConfigError(f"Unknown config key {key!r}. Sections: {', '.join(sections)}; see `trillion train --help`.")
    section = getattr(config, section_name)
    fields = {f.name: f for f in dataclasses.fields(section)}
    if field_name not in fields:
        raise ConfigError(
            f"Unknown config key {key!r}. Fields of [{section_name}]: {', '.join(fields)}; see `trillion train --help`."
        )
    kind = typing.get_type_hints(type(section))[field_name]
    setattr(section, field_name, _coerce(value, kind, where or Where(key)))


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the TOML file, then `--section.field=value` overrides, in that order."""
    config = Config()
    if path:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(
                f"--config {path}: no such file. Give the path of a TOML file, e.g. experiments/configs/debug.toml."
            )
        text = file.read_text()
        try:
            table = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"--config {path} is not valid TOML: {error}.") from None
        for section_name, section in table.items():
            if not isinstance(section, dict):
                raise ConfigError(f"{path}: {section_name!r} must be a [section] table; see `trillion train --help`.")
            for field_name, value in section.items():
                key = f"{section_name}.{field_name}"
                _set(config, key, value, Where(key, path, _line_of(text, key)))
    for item in overrides:
        if not item.startswith("--") or "=" not in item:
            raise ConfigError(
                f"Cannot read the argument {item!r}: write overrides as --section.field=value, e.g. "
                "--training.steps=100."
            )
        key, _, value = item[2:].partition("=")
        _set(config, key, value)
    validate_config(config)
    return config
