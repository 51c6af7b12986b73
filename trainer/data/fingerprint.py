"""The data corpus a checkpoint's data position points into, fingerprinted: every local file's size and
modification time (the default corpus, `data.path`, `data.prepared` stores), saved with each checkpoint
and compared at resume. Files added, removed or edited since the save are named and the resume is
refused (the saved position would count into other documents), unless
`--checkpoint.accept_data_change=true` says the change is intended. Hub datasets (`data.name`) are
not fingerprinted: their revision is the hub's to keep. Stat calls only: a few ms for thousands of files."""

import json
import logging
from pathlib import Path

from trillion.errors import ConfigError
from trillion.trainer.data.prepared import parse_prepared
from trillion.trainer.data.sources import SUFFIX_TO_BUILDER, default_corpus_files

log = logging.getLogger("trillion")
FILE = "data_fingerprint.json"


def corpus_files(cfg) -> list[Path]:
    if cfg.prepared:
        return sorted(p for folder, _ in parse_prepared(cfg.prepared) for p in Path(folder).rglob("*") if p.is_file())
    if cfg.path:
        root = Path(cfg.path)
        return sorted(p for p in root.rglob("*") if p.suffix in SUFFIX_TO_BUILDER) if root.is_dir() else [root]
    if cfg.name:
        return []
    return sorted(default_corpus_files(0))


def fingerprint(cfg) -> dict[str, list[int]]:
    """{file: [size, mtime_ns]}."""
    return {str(p): [p.stat().st_size, p.stat().st_mtime_ns] for p in corpus_files(cfg) if p.is_file()}


def write(folder: Path, cfg) -> None:
    (folder / FILE).write_text(json.dumps(fingerprint(cfg)))


def check(checkpoint: Path, cfg, accept: bool) -> None:
    """Raise ConfigError if the corpus changed since `checkpoint` was saved (log it when `accept`)."""
    saved_file = checkpoint / FILE
    if not saved_file.is_file():
        return
    saved, now = json.loads(saved_file.read_text()), fingerprint(cfg)
    added, removed = sorted(set(now) - set(saved)), sorted(set(saved) - set(now))
    edited = sorted(p for p in set(now) & set(saved) if now[p] != saved[p])
    if not (added or removed or edited):
        return
    change = "; ".join(
        f"{len(names)} {what} ({_some(names)})"
        for what, names in (("added", added), ("removed", removed), ("edited", edited))
        if names
    )
    if accept:
        log.warning(
            "the data changed since %s (%s); resuming anyway (checkpoint.accept_data_change=true)", checkpoint, change
        )
        return
    raise ConfigError(
        f"Cannot resume from {checkpoint}: the data files changed since it was saved: {change}. Its data "
        "position counts documents of the old corpus, so the run would not see the batches it would have "
        "seen. Restore the files, or pass --checkpoint.accept_data_change=true to resume on the new corpus."
    )


def _some(names: list[str], limit: int = 3) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
