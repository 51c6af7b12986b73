"""Checkpoints verified on load: a manifest of every file's size and CRC-32, written into the staging
folder before the COMPLETE marker, and checked at resume. Each rank checksums the shards it wrote
(`ChecksummedWriter`, while they are hot in its page cache, in the async writer's thread too) and
rank 0 merges them, so a save reads no byte twice whatever the world size. A checkpoint damaged after it was
published (a truncated shard, a missing `.metadata`, flipped bytes) is named file by file, set aside
as `damaged-step-NNNNNNNN/` and the run falls back to the newest intact one, or stops with a clear
error when none is intact.

Verification is split over the ranks (rank r reads files r, r + world, ...), so resuming reads each
byte once whatever the world size; the verdict is agreed on the checkpoint's gloo group.
"""

import json
import logging
import os
import zlib
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from trillion.errors import RunAborted

log = logging.getLogger("trillion")
MANIFEST = "MANIFEST.json"
RANK_SUMS = ".crc-"  # one file per rank's shards, merged into the manifest
CHUNK = 1 << 22


def crc32(path: Path) -> int:
    value = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            value = zlib.crc32(chunk, value)
    return value


class ChecksummedWriter(FileSystemWriter):
    """DCP's file writer that also records the size and CRC-32 of the files this rank wrote."""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)  # FileSystemWriter writes synchronously: the files are there
        folder = Path(self.path)
        names = sorted({result.storage_data.relative_path for result in future.value()})
        sums = {name: [(folder / name).stat().st_size, crc32(folder / name)] for name in names}
        (folder / f"{RANK_SUMS}{plan.storage_data.prefix}.json").write_text(json.dumps(sums))
        return future


def write_manifest(folder: Path) -> None:
    """{relative path: [size, crc32]} of every file in `folder`, synced to disk: the ranks' own sums
    of their shards, and rank 0 reads the rest (.metadata, config.toml: small)."""
    table = {}
    for sums in folder.glob(f"{RANK_SUMS}*.json"):
        table.update(json.loads(sums.read_text()))
        sums.unlink()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        if str(path.relative_to(folder)) not in table:
            table[str(path.relative_to(folder))] = [path.stat().st_size, crc32(path)]
    with open(folder / MANIFEST, "w") as handle:
        json.dump(table, handle, indent=0)
        handle.flush()
        os.fsync(handle.fileno())


def damaged_files(folder: Path, rank: int = 0, world: int = 1) -> list[str]:
    """What is wrong with this rank's share of `folder`'s files ([] when intact); rank 0 also reads
    the manifest itself and looks for `.metadata`, without which DCP cannot load anything."""
    try:
        table = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        # Every checkpoint published since checksums exist has its manifest before its COMPLETE
        # marker, so a complete one without it was written by an earlier version: load it unverified
        # (refusing would strand those runs), unless DCP's own index is gone too.
        if rank == 0 and not (folder / ".metadata").is_file():
            return [f"{MANIFEST} and .metadata are missing"]
        if rank == 0:
            log.warning(
                "Checkpoint %s has no %s (written before checkpoints carried checksums): loading it unverified.",
                folder,
                MANIFEST,
            )
        return []
    except (OSError, ValueError) as error:
        return [f"{MANIFEST} is unreadable ({error})"] if rank == 0 else []
    problems = [".metadata is missing"] if rank == 0 and ".metadata" not in table else []
    for name in sorted(table)[rank::world]:
        size, expected = table[name]
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{name} has {path.stat().st_size} bytes, {size} when saved (truncated or overwritten)")
        elif crc32(path) != expected:
            problems.append(f"{name} has other bytes than when saved (CRC-32 differs)")
    return problems


def newest_intact(checkpoints: list[Path], group, is_rank0: bool) -> Path | None:
    """The newest of `checkpoints` (oldest first) whose files match their manifest. Damaged ones are
    reported by file and renamed `damaged-step-N` (kept for inspection, never loaded again)."""
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    for folder in reversed(checkpoints):
        problems = damaged_files(folder, rank, world)
        if group is not None:
            everyone = [None] * world
            dist.all_gather_object(everyone, problems, group=group)
            problems = [p for share in everyone for p in share]
        if not problems:
            return folder
        if is_rank0:
            log.warning(
                "CHECKPOINT %s IS DAMAGED, not loading it: %s. Set aside as %s; falling back to an older checkpoint.",
                folder,
                "; ".join(problems),
                folder.with_name("damaged-" + folder.name).name,
            )
            folder.rename(folder.with_name("damaged-" + folder.name))
        if group is not None:
            dist.barrier(group=group)  # the rename is seen before anyone lists checkpoints again
    if checkpoints:
        raise RunAborted(
            f"No intact checkpoint in {checkpoints[0].parent}: each one's files differ from its manifest "
            f"(see the warnings above; they are kept as damaged-step-*). Restore the files from a copy, or "
            f"start a fresh run with another --job.output_dir (--checkpoint.initial_load=DIR to start from "
            f"weights you trust)."
        )
    return None
