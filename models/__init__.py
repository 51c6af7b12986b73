"""Model definitions: one decoder-only transformer covering the GPT and Llama families,
presets by name, FLOP and parameter accounting, and Hugging Face weight adapters."""

from trillion.models.args import ModelArgs
from trillion.models.presets import PRESETS, get_preset

__all__ = ["PRESETS", "ModelArgs", "Transformer", "get_preset"]


def __getattr__(name: str):
    # The transformer needs torch; shapes, presets and FLOP counts do not, so it loads on first use.
    if name == "Transformer":
        from trillion.models.transformer import Transformer

        return Transformer
    raise AttributeError(f"module 'models' has no attribute {name!r}")
