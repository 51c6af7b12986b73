"""The one paragraph a failed save ends the run with: the OSError behind DCP's per-rank wrapping,
read as a full disk, a permission problem or anything else, with the last good checkpoint named."""

import errno
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from trillion.errors import RunAborted
from trillion.trainer.checkpoint.folders import complete_checkpoints


class CheckpointError(RunAborted):
    """A checkpoint could not be written or read; the message says where and what to do."""


def os_error_behind(error: BaseException) -> OSError | None:
    """The OSError behind a save failure, looking through DCP's per-rank wrapping."""
    seen = set()
    stack = [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        stack += [current.__cause__, current.__context__]
        if isinstance(current, CheckpointException):  # {rank: (exception, traceback)}
            stack += [exception for exception, _ in current.failures.values()]
    return None


def save_error(error: BaseException, step: int, root: Path, keep_latest: int) -> CheckpointError:
    previous = complete_checkpoints(root)
    kept = f"The last good checkpoint, {previous[-1].name}, is intact." if previous else "No earlier checkpoint exists."
    os_error = os_error_behind(error)
    if os_error is not None and os_error.errno == errno.ENOSPC:
        return CheckpointError(
            f"No space left on the device while saving checkpoint step {step} into {root}. {kept} "
            f"{_room_advice(previous, keep_latest)} Free space there or point --job.output_dir at a larger "
            f"filesystem, then run the same command again to resume."
        )
    if os_error is not None and os_error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CheckpointError(
            f"Cannot write checkpoint step {step} into {root} ({os_error.strerror}). {kept} Fix the permissions or "
            f"point --job.output_dir at a writable folder, then run the same command again to resume."
        )
    cause = os_error or first_failure(error)
    return CheckpointError(
        f"Saving checkpoint step {step} into {root} failed ({type(cause).__name__}: {cause}). "
        f"{kept} Run the same command again to resume from it."
    )


def _room_advice(previous: list[Path], keep_latest: int) -> str:
    """What a save needs room for: a whole checkpoint beside those on disk, since a checkpoint is removed only
    once a newer one is complete (checkpoint.keep_latest=1 too). Fewer kept ones help only where more are kept."""
    if not previous:
        return "A save needs room for one whole checkpoint."
    size = sum(f.stat().st_size for f in previous[-1].rglob("*") if f.is_file())
    advice = (
        f"A save needs room for one more whole checkpoint (about {_amount(size)}, as {previous[-1].name}) beside "
        f"the {len(previous)} on disk: older ones are removed only once a newer one is complete."
    )
    if len(previous) > 1 and keep_latest != 1:
        older = ", ".join(p.name for p in previous[:-1])
        advice += (
            f" --checkpoint.keep_latest=1 (now {keep_latest}) keeps one beside the one being written; to make room "
            f"now, move the older ones ({older}) elsewhere."
        )
    return advice


def _amount(size: int) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def first_failure(error: BaseException) -> BaseException:
    if isinstance(error, CheckpointException) and error.failures:
        return next(iter(error.failures.values()))[0]
    return error
