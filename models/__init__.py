"""Model definitions: one decoder-only transformer covering the GPT and Llama families,
presets by name, FLOP and parameter accounting, and Hugging Face weight adapters."""
from models.presets import PRESETS, get_preset
from models.transformer import ModelArgs, Transformer

__all__ = ["PRESETS", "ModelArgs", "Transformer", "get_preset"]
