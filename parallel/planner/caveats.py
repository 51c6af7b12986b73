"""What a plan row warns of beside its figures: a predicted MFU or HFU above the best published on the hardware
class (ceilings.toml, each with its source: a search must not promise what nobody reached), and a layout evaluated
though its predicted memory is past the plan's headroom (search.py shows those only where none fits in it)."""

from functools import lru_cache
from pathlib import Path

from trillion.devices import read_toml
from trillion.parallel.planner.memory import MEMORY_HEADROOM

CEILINGS_FILE = Path(__file__).with_name("ceilings.toml")


@lru_cache(maxsize=1)
def ceilings() -> tuple[dict, ...]:
    return tuple(read_toml(CEILINGS_FILE)["ceiling"])


def utilisation_warning(device: str, row: dict) -> str:
    """ "" unless the row's predicted MFU or HFU (bf16 layouts only) passes the best published on `device`'s class."""
    if row.get("float8"):
        return ""
    over = [c for c in ceilings() if device in c["devices"] and row[c["metric"]] > c["value"]]
    return "; ".join(
        f"predicted {c['metric'].upper()} {row[c['metric']]:.1%} is above the best published on {c['class']}, "
        f"{c['value']:.1%} ({' '.join(c['source'].split())}): treat it as the model's optimism, not a promise"
        for c in over
    )


def memory_warning(used_gb: float, capacity_gb: float, fits: bool) -> str:
    """ "" for a layout within the plan's headroom; else what it leaves free. Such a layout is evaluated, not
    refused: the memory model is an estimate (torchtitan's published 8B layout ran in 82.4 GiB of 96 GB where
    the planner predicts 87.0 GiB: experiments/validation/VALIDATION.md)."""
    if fits:
        return ""
    return (
        f"memory: {used_gb:.1f} of {capacity_gb:g} GB predicted, past the {MEMORY_HEADROOM:.0%} a plan keeps for the "
        f"allocator's fragmentation; it may run out of memory (check it with `trillion estimate`)"
    )
