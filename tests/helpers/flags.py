"""The small-run flags the tests share, in one place. A test that needs other numbers derives its list
from one of these with `with_flags` (a flag given again replaces the one of the same setting, in its
place) or `without`, so what differs from the shared run is written where the test is."""

# One layer, 64 wide, four 32-token windows a step in micro-batches of 2.
TINY_MODEL = [
    "--model.n_layers=1",
    "--model.dim=64",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.ffn_dim=128",
]
TINY_BATCH = ["--training.seq_len=32", "--training.global_batch_size=4", "--training.micro_batch_size=2"]
QUIET = ["--logging.wandb=false", "--logging.progress_bar=lines"]

# In-process runs (tests/helpers/runs.py gives the steps and the output folder), every step logged.
TINY = [*TINY_MODEL, *TINY_BATCH, "--lr_schedule.warmup_steps=2", "--metrics.log_freq=1", *QUIET]

# Two ranks launched as users launch them (srun-style, torchrun): 4 steps, logged every 2, FSDP over both.
LAUNCH = [
    *TINY_MODEL,
    *TINY_BATCH,
    "--training.steps=4",
    "--metrics.log_freq=2",
    "--parallel.dp_shard=2",
    "--job.device=cpu",
]

# Two layers, 96-wide feed-forward: the trainer's own runs compared across layouts with one process,
# eight 32-token windows a step for 3 steps, every step logged, no checkpoint written.
SMALL_MODEL = [
    "--model.n_layers=2",
    "--model.dim=64",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.ffn_dim=96",
]
NO_CHECKPOINTS = ["--checkpoint.interval=0", "--checkpoint.save_final=false"]
SMALL = [
    *SMALL_MODEL,
    "--training.seq_len=32",
    "--training.global_batch_size=8",
    "--training.micro_batch_size=2",
    "--training.steps=3",
    "--metrics.log_freq=1",
    *NO_CHECKPOINTS,
    "--logging.progress_bar=lines",
    "--lr_schedule.warmup_steps=1",
]

# The debug preset cut to two layers of 64-token sequences on CPU: `trillion estimate` and its real runs.
DEBUG_SMALL = ["--job.device=cpu", "--model.n_layers=2", "--training.seq_len=64"]


def _setting(flag: str) -> str | None:
    """`--section.field` of a `--section.field=value` flag; None for anything else (`--config PATH`)."""
    return flag.partition("=")[0] if flag.startswith("--") and "=" in flag else None


def with_flags(base: list[str], *flags: str) -> list[str]:
    """`base` with each of `flags` in place of the flag of the same setting, or appended when it has none."""
    out = list(base)
    for flag in flags:
        setting = _setting(flag)
        assert setting is not None, f"{flag!r}: give --section.field=value"
        places = [i for i, given in enumerate(out) if _setting(given) == setting]
        if places:
            out[places[0]] = flag
        else:
            out.append(flag)
    return out


def without(base: list[str], *settings: str) -> list[str]:
    """`base` less the flags of `settings` (`--section.field`)."""
    missing = [s for s in settings if s not in map(_setting, base)]
    assert not missing, f"{missing} are not in {base}"
    return [flag for flag in base if _setting(flag) not in settings]
