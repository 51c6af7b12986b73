"""Configuration: the TOML schema of sections (schema.py, by section) and the checks it declares (checks.py).
Every component may import it; it imports no other component."""

from trillion.trainer.config.schema import Config, divisor_near, help_text, load_config, to_toml, validate_config

__all__ = ["Config", "divisor_near", "help_text", "load_config", "to_toml", "validate_config"]
