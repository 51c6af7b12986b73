"""May this checkpoint continue this run? Checks done before any tensor is read, so a mismatch
ends with one paragraph naming the setting or the parameters, not a tensor-copy traceback."""

import json
import logging
import os
from pathlib import Path

import tomllib

from trillion.errors import ConfigError

log = logging.getLogger("trillion")

# Settings whose change would make the resumed run a different run, with the reason.
BREAKS_RESUME = {
    "model.": "the network's shape",
    "training.seq_len": "the window length the data position counts in",
    "training.global_batch_size": "which windows make up each step",
    "job.seed": "the order of the default corpus",
    "data.": "what the saved data position points into",
    "tokenizer.": "the tokens the saved data position counts",
    "eval.held_out": "which documents training skips",
    "eval.path": "whether training documents are held out",
    "eval.name": "whether training documents are held out",
    "optimizer.name": "the optimizer state the checkpoint holds (AdamW's two moments per parameter, or Muon's one "
    "momentum per hidden matrix and AdamW's moments for the rest); neither is the other's, so no rule converts them",
}

# Settings added since checkpoints were first written, with the value that reproduces what a
# checkpoint saved without them did: an on-the-fly run of that time read one document after another.
ADDED_SINCE = {"data.lanes": 1}


def settings(config_toml: str) -> dict:
    """A resolved config's TOML text as {"section.field": value}: the run's and a checkpoint's alike."""
    table = tomllib.loads(config_toml)
    return {f"{section}.{name}": value for section, fields in table.items() for name, value in fields.items()}


def saved_config(path: Path) -> dict:
    """The resolved config a checkpoint was saved with, as {"section.field": value} ({} if absent)."""
    return settings(path.read_text()) if path.is_file() else {}


def check_resume_config(saved: dict, current: dict, checkpoint: Path) -> None:
    """Raise if a setting that defines the run changed since the checkpoint (`saved` and `current` as
    `settings` gives them); log the harmless changes."""
    if saved and not saved.get("data.prepared"):
        saved = {**ADDED_SINCE, **saved}
    changed = [(key, old, current[key]) for key, old in saved.items() if key in current and current[key] != old]
    breaking = [
        (key, old, new, why)
        for key, old, new in changed
        for prefix, why in BREAKS_RESUME.items()
        if key == prefix or (prefix.endswith(".") and key.startswith(prefix))
    ]
    if breaking:
        details = "; ".join(f"{key} was {old!r} there and is {new!r} now ({why})" for key, old, new, why in breaking)
        restore = " ".join(f"--{key}={old}" for key, old, _, _ in breaking)
        raise ConfigError(
            f"Cannot resume from {checkpoint}: {details}. To continue that run, pass {restore}. To start a different "
            f"run, use a new --job.output_dir (with --checkpoint.initial_load={checkpoint} to start from its weights)."
        )
    if changed:
        log.info("resuming with changed settings: %s", ", ".join(f"{k} {old!r} -> {new!r}" for k, old, new in changed))


def check_shapes(saved: dict[str, tuple], model_state: dict, source: str, whole_model: bool = True) -> None:
    """Every parameter of the model is in `saved` with its global shape, and nothing else is (a
    pipeline rank, not the `whole_model`, holds only its stages' share)."""
    ours = {name: tuple(tensor.shape) for name, tensor in model_state.items()}
    problems = [
        f"{name} is {tuple(saved[name])} there but {shape} here"
        for name, shape in ours.items()
        if name in saved and tuple(saved[name]) != shape
    ]
    missing, unexpected = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
    if missing:
        problems.append(f"missing there: {_some(missing)}")
    if unexpected and whole_model:
        problems.append(f"not in this model: {_some(unexpected)}")
    if problems:
        raise ConfigError(
            f"{source} does not fit this model: {'; '.join(problems[:6])}{' ...' if len(problems) > 6 else ''}. "
            "Use the model settings it was saved with (its config.toml: [model] and the preset), "
            "or start a fresh run in another --job.output_dir."
        )


def _some(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def trim_metrics(path: Path, step: int) -> int:
    """Drop the records of steps after `step` (logged before a crash; they will run again); returns how many."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            keep = json.loads(line)["step"] <= step
        except (json.JSONDecodeError, KeyError, TypeError):
            keep = False  # a line cut short by the crash
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        partial = path.with_name(path.name + ".tmp")
        partial.write_text("".join(line + "\n" for line in kept))
        os.replace(partial, path)
    return dropped
