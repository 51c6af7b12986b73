"""`trillion export --checkpoint DIR --format hf [--weights live|ema] OUT`: a training checkpoint as a Hugging Face
model folder (model.safetensors + config.json) that `transformers` loads as the class of its family
(models/hf.py's registry of adapters; experts one matrix per expert, the layout of Hub checkpoints and of
save_pretrained; multi-token prediction modules are training-only and left out).
`--checkpoint.initial_load=OUT` starts a new run from such a folder (its modules from their initial values)."""

import dataclasses
import errno
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from trillion.errors import ConfigError, RunAborted
from trillion.models import Transformer
from trillion.trainer.checkpoint.folders import CONFIG_FILE, complete_checkpoints, is_complete
from trillion.trainer.checkpoint.state import ModelParts
from trillion.trainer.checkpoint.verify import damaged_files
from trillion.trainer.config.schema import load_config

log = logging.getLogger("trillion")

RUN_CONFIG = "trillion_config.toml"  # the run's config beside the weights: `trillion generate` reads its tokenizer


def resolve_checkpoint(path: Path) -> Path:
    """A step directory, or the newest intact one of a run directory or its checkpoints/ folder: each
    file checked against the checkpoint's manifest (as training does at resume), so a damaged shard is
    named instead of read. Read-only: a damaged one is skipped, not renamed as training does. A step
    named explicitly is never swapped for another: when damaged, the intact one to give is named."""
    if is_complete(path):
        if problems := damaged_files(path):
            older = _newest_intact([c for c in complete_checkpoints(path.parent) if c.name < path.name])
            instead = f"give the intact {older} instead" if older else "no older intact checkpoint is beside it"
            raise RunAborted(
                f"--checkpoint {path} IS DAMAGED: {'; '.join(problems)}. Restore its files from a copy, or {instead}."
            )
        return path
    if path.name.startswith("step-") and path.is_dir():
        raise ConfigError(
            f"--checkpoint {path} is not a complete checkpoint (no COMPLETE marker: its save was "
            f"interrupted). Use an earlier step directory."
        )
    for root in (path / "checkpoints", path):
        if found := complete_checkpoints(root):
            if newest := _newest_intact(found):
                return newest
            raise RunAborted(
                f"--checkpoint {path}: every checkpoint in {root} IS DAMAGED (see the warnings above). Restore "
                f"their files from a copy, or give another --checkpoint."
            )
    raise ConfigError(
        f"--checkpoint {path}: no complete checkpoint there. Give a step directory "
        f"(<output_dir>/checkpoints/step-NNNNNNNN) or a run's output_dir."
    )


def _newest_intact(checkpoints: list[Path]) -> Path | None:
    """The newest of `checkpoints` (oldest first) whose files match their manifest; each damaged one
    passed over is named in a warning."""
    passed_over = False
    for step in reversed(checkpoints):
        problems = damaged_files(step)
        if not problems:
            if passed_over:
                log.warning("Using the intact %s instead.", step)
            return step
        log.warning(
            "CHECKPOINT %s IS DAMAGED, not reading it: %s. Trying the one before it.", step, "; ".join(problems)
        )
        passed_over = True
    return None


def load_checkpoint_model(step: Path, weights: str = "live") -> Transformer:
    """The checkpoint's model, whole, on the CPU, built from the config it was saved with, as one process runs it
    (whatever layout trained it: no expert-parallel ranks, so no per-rank capacity drops a token, as in the
    transformers model the export writes). `weights`: live, the trained parameters; ema, their moving average
    (optimizer.ema_decay)."""
    from trillion.parallel.layout import Layout
    from trillion.trainer.assemble import build_model_args

    config = load_config(str(step / CONFIG_FILE))
    args = dataclasses.replace(build_model_args(config, 0, Layout()), attention_impl="sdpa", norm_impl="torch")
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(config.job.seed)  # fills the non-persistent rope table; the weights come from the checkpoint
    dcp.load({"model": ModelParts([model])}, checkpoint_id=str(step), no_dist=True)
    if weights == "ema":
        load_moving_average(model, step)
    return model


def load_moving_average(model: Transformer, step: Path) -> None:
    """The parameters' moving average the run kept (parallel/host_ema.py), in place of the trained values."""
    metadata = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    if not any(key.startswith("ema.") for key in metadata):
        raise ConfigError(
            f"--weights ema: checkpoint {step} holds no moving average of the parameters (its run had "
            "optimizer.ema_decay=0). Export its trained weights with --weights live, or train with "
            "--optimizer.ema_decay=0.999 (for example) to keep one."
        )
    averages = {name: torch.empty(p.shape, dtype=torch.float32) for name, p in model.named_parameters()}
    dcp.load({"ema": averages}, checkpoint_id=str(step), no_dist=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(averages[name])


def inference_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The weights a transformers model runs: without the multi-token prediction modules (training only; the
    families' modeling code, DeepseekV3ForCausalLM's included, has no place for them), which are left out."""
    state = model.state_dict()
    left_out = [name for name in state if name.startswith("mtp.")]
    if left_out:
        log.info("export leaves out the %d multi-token prediction tensors (training only)", len(left_out))
    return {name: tensor for name, tensor in state.items() if not name.startswith("mtp.")}


def export_hf(step: Path, out: Path, weights: str = "live") -> Path:
    from trillion.models.hf import family_classes, hf_config, to_hf_state_dict

    check_destination(out)
    model = load_checkpoint_model(step, weights)
    try:  # before anything is written: a model no transformers family expresses (debug-moe's shared expert)
        config = hf_config(model.args)
        config.bos_token_id = config.eos_token_id = end_of_document_id(step)
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
    write_folder(out, {k: v.detach().contiguous() for k, v in weights.items()}, config, step)
    return out / "model.safetensors"


def end_of_document_id(step: Path) -> int:
    """The id the run's tokenizer ends each document with: transformers' `generate` stops there. It is the BOS
    too, as GPT-2's <|endoftext|> is: training packs every document right after the one before's end, and no
    tokenizer adds a begin-of-text id of its own in this trainer."""
    from trillion.trainer.data.tokenizer import build_tokenizer

    tokenizer_config = load_config(str(step / CONFIG_FILE)).tokenizer
    try:
        return build_tokenizer(tokenizer_config).eos_id
    except ConfigError as error:
        raise ConfigError(
            f"--checkpoint {step} was trained with tokenizer.kind={tokenizer_config.kind}, whose file export reads "
            f"for the end-of-document id it writes into config.json (where `generate` stops): {error}"
        ) from None


def check_destination(out: Path) -> None:
    """Export never replaces files: a non-empty OUT would be a mix of two models, or the loss of one."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"Export destination {out} exists and is not an empty folder; export does not replace files. "
            f"Give a new OUT folder (or remove this one first)."
        )


def write_folder(out: Path, weights: dict[str, torch.Tensor], config, step: Path) -> None:
    """The files under temporary names in OUT, renamed into place only when all are written: a full
    disk leaves no half-written model behind, and the folder is removed if export created it."""
    from safetensors.torch import save_file

    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
    try:
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(staging))
        (staging / RUN_CONFIG).write_text((step / CONFIG_FILE).read_text())
        for path in staging.iterdir():  # safetensors writes 0600 (a temporary file): readable as any other file
            path.chmod(0o666 & ~current_umask())
            path.rename(out / path.name)
    except Exception as error:  # safetensors raises its own SafetensorError for ENOSPC, not OSError
        shutil.rmtree(staging, ignore_errors=True)
        for name in ("model.safetensors", "config.json", "generation_config.json", RUN_CONFIG):
            (out / name).unlink(missing_ok=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        full = isinstance(error, OSError) and error.errno == errno.ENOSPC or "No space left" in str(error)
        raise RunAborted(
            f"Export into {out} failed: {'the disk is full' if full else error}. Nothing was left there "
            f"(the partial files are removed). Free space or give an OUT folder on another disk, and export again."
        ) from None
    staging.rmdir()


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
