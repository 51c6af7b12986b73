"""DeepSeek-V3's multi-token prediction modules (models/mtp.py; arXiv 2412.19437 section 2.2), declared: each
normalises the last hidden state and the embedding of the token one further ahead (two RMSNorms), projects their
concatenation (2 dim -> dim; no TP plan names it, so it is whole on every rank), runs one more block (an MoE block
where the trunk's next layer would be one) and its own copy of the final norm, then the shared output head.
They train under every layout: tensor parallelism splits the block as the trunk's and keeps the projection whole,
context parallelism gives them the rank's positions, a pipeline runs them on its last stage
(parallel/pipeline_ahead.py)."""

import dataclasses
from dataclasses import dataclass

from trillion.errors import ConfigError
from trillion.models.args import ModelArgs
from trillion.models.parts.norm import model_norm
from trillion.models.parts.spec import REPLICATED, Linear, Part
from trillion.models.presets import MTP_LOSS_WEIGHT

NORMS = ("hnorm", "enorm", "norm")


def declare(args: ModelArgs) -> Part:
    """One module besides its block (names inside `mtp.<index>`)."""
    return Part(
        module="",
        linears=(Linear("eh_proj", 2 * args.dim, args.dim, REPLICATED),),
        norms=tuple(model_norm(args, name) for name in NORMS),
    )


@dataclass(frozen=True)
class MTPSettings:
    """The user's multi-token prediction: model.mtp_modules (-1 keeps the preset's) and model.mtp_loss_weight (0: the
    preset's, else MTP_LOSS_WEIGHT)."""

    modules: int = -1
    loss_weight: float = 0.0


def apply_settings(args: ModelArgs, settings: MTPSettings, model_name: str) -> ModelArgs:
    """The preset's multi-token prediction with the user's module count and loss weight applied."""
    given, weight = settings.modules, settings.loss_weight
    modules = args.mtp_modules if given < 0 else given
    if modules == 0:
        if weight > 0:
            raise ConfigError(
                f"model.mtp_loss_weight={weight:g} is set, but model {model_name!r} trains no "
                "multi-token prediction modules. Add --model.mtp_modules=1 or drop the setting."
            )
        return dataclasses.replace(args, mtp_modules=0, mtp_loss_weight=0.0)
    weight = weight if weight > 0 else args.mtp_loss_weight or MTP_LOSS_WEIGHT
    return dataclasses.replace(args, mtp_modules=modules, mtp_loss_weight=weight)
