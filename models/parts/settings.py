"""The user's settings the parts apply (models/parts apply_settings), as typed values: each part's own declared
with the part (moe.py MoESettings, mtp.py MTPSettings), the attention's here, and the whole set a PartSettings.
The trainer fills one from its config in one function (trainer/assemble.py part_settings), `trillion plan` from its
flags; models/ reads no trainer config key (tests/architecture/test_config_keys.py)."""

from dataclasses import dataclass

from trillion.models.parts.moe import MoESettings
from trillion.models.parts.mtp import MTPSettings


@dataclass(frozen=True)
class AttentionSettings:
    """document_mask: attention stays within each packed document (data.document_mask); n_kv_heads: the key/value
    heads the user gave (model.n_kv_heads, 0: the preset's), which latent attention refuses."""

    document_mask: bool = False
    n_kv_heads: int = 0


@dataclass(frozen=True)
class PartSettings:
    """Every part's settings; `model_name` (the preset, model.name) is what their messages call the model."""

    model_name: str
    attention: AttentionSettings = AttentionSettings()
    moe: MoESettings = MoESettings()
    mtp: MTPSettings = MTPSettings()
