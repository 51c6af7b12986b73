"""`trillion export --checkpoint DIR --format hf OUT`: a training checkpoint as a Hugging Face
model folder (model.safetensors + config.json) that `transformers` loads as the class of its family
(models/hf.py's registry of adapters; experts one matrix per expert, the layout of Hub checkpoints and of
save_pretrained; multi-token prediction modules are training-only and left out).
`--checkpoint.initial_load=OUT` starts a new run from such a folder (its modules from their initial values)."""

import dataclasses
import logging
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from trillion.errors import ConfigError
from trillion.models import Transformer
from trillion.trainer.checkpoint.manager import CONFIG_FILE, complete_checkpoints, is_complete
from trillion.trainer.checkpoint.state import ModelParts
from trillion.trainer.config.schema import load_config

log = logging.getLogger("trillion")

RUN_CONFIG = "trillion_config.toml"  # the run's config beside the weights: `trillion generate` reads its tokenizer


def resolve_checkpoint(path: Path) -> Path:
    """A step directory, or the newest complete one of a run directory or its checkpoints/ folder."""
    if is_complete(path):
        return path
    if path.name.startswith("step-") and path.is_dir():
        raise ConfigError(
            f"--checkpoint {path} is not a complete checkpoint (no COMPLETE marker: its save was "
            f"interrupted). Use an earlier step directory."
        )
    for root in (path / "checkpoints", path):
        if found := complete_checkpoints(root):
            return found[-1]
    raise ConfigError(
        f"--checkpoint {path}: no complete checkpoint there. Give a step directory "
        f"(<output_dir>/checkpoints/step-NNNNNNNN) or a run's output_dir."
    )


def load_checkpoint_model(step: Path) -> Transformer:
    """The checkpoint's model, whole, on the CPU, built from the config it was saved with."""
    from trillion.trainer.assemble import build_model_args

    config = load_config(str(step / CONFIG_FILE))
    args = dataclasses.replace(build_model_args(config, 0), attention_impl="sdpa", norm_impl="torch")
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(config.job.seed)  # fills the non-persistent rope table; the weights come from the checkpoint
    dcp.load({"model": ModelParts([model])}, checkpoint_id=str(step), no_dist=True)
    return model


def inference_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The weights a transformers model runs: without the multi-token prediction modules (training only; the
    families' modeling code, DeepseekV3ForCausalLM's included, has no place for them), which are left out."""
    state = model.state_dict()
    left_out = [name for name in state if name.startswith("mtp.")]
    if left_out:
        log.info("export leaves out the %d multi-token prediction tensors (training only)", len(left_out))
    return {name: tensor for name, tensor in state.items() if not name.startswith("mtp.")}


def export_hf(step: Path, out: Path) -> Path:
    from safetensors.torch import save_file

    from trillion.models.hf import family_classes, hf_config, to_hf_state_dict

    model = load_checkpoint_model(step)
    try:  # before anything is written: a model no transformers family expresses (debug-moe's shared expert)
        config = hf_config(model.args)
        weights = to_hf_state_dict(inference_state_dict(model), model.args)
    except ValueError as error:
        raise ConfigError(
            f"--checkpoint {step} cannot be exported to Hugging Face: {error} Train a model that one of "
            f"{family_classes()} expresses."
        ) from None
    if (
        model.args.tie_embeddings
    ):  # transformers ties lm_head to the embedding itself; safetensors refuses shared storage
        weights.pop("lm_head.weight")
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().contiguous() for k, v in weights.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config.save_pretrained(str(out))
    (out / RUN_CONFIG).write_text((step / CONFIG_FILE).read_text())
    return out / "model.safetensors"
