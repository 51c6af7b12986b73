"""What the two ways of hiding tensor parallelism's collectives need of a layout, checked before any work
(dims.py check_layout) and by the planner, which proposes only what passes: the chunked overlap
(parallel.tp_overlap, parallel/tp_overlap.py) and torch's async TP (parallel.async_tp, parallel/async_tp.py, whose
device checks are there). No torch here: the planner and the config checks import it."""

from trillion.errors import ConfigError
from trillion.parallel.layout import divisors


def local_sequence(layout, seq_len: int) -> int:
    """Positions of a sequence on one rank between the blocks: seq_len over cp, then over tp (sequence parallel)."""
    return seq_len // layout.cp // layout.tp


def overlap_chunks(layout, seq_len: int) -> list[int]:
    """The chunk counts parallel.tp_overlap may take at this layout: the divisors of the local sequence."""
    return divisors(local_sequence(layout, seq_len)) if layout.tp > 1 else []


def check_tp_overlap(layout, seq_len: int) -> None:
    """ConfigError naming the setting and the fix where parallel.tp_overlap or parallel.async_tp cannot run."""
    chunks = layout.tp_overlap
    if not chunks and not layout.async_tp:
        return
    if chunks and layout.async_tp:
        raise ConfigError(
            f"parallel.tp_overlap={chunks} and parallel.async_tp=true are two ways of hiding the same collectives; "
            "pick one: --parallel.async_tp=true on CUDA with compile, else --parallel.tp_overlap=N (any backend)."
        )
    setting = f"parallel.tp_overlap={chunks}" if chunks else "parallel.async_tp=true"
    if layout.tp == 1:
        raise ConfigError(
            f"{setting} hides tensor parallelism's all-gathers and reduce-scatters, but parallel.tp=1 has none. Give "
            f"--parallel.tp=2 or more, or drop {setting.split('=')[0]}."
        )
    if layout.async_tp and not layout.compile:
        raise ConfigError(
            "parallel.async_tp=true is a pass of torch.compile's Inductor (it fuses each all-gather and "
            "reduce-scatter with the GEMM next to it), so it needs --compile.enabled=true. Without compile, use the "
            "chunked overlap instead: --parallel.tp_overlap=N (any backend)."
        )
    if chunks:
        _check_chunks(layout, seq_len)


def _check_chunks(layout, seq_len: int) -> None:
    chunks, local = layout.tp_overlap, local_sequence(layout, seq_len)
    if local * layout.cp * layout.tp != seq_len:  # not split evenly: the degrees' own check says so (dims.py)
        return
    if local % chunks:
        valid = ", ".join(map(str, overlap_chunks(layout, seq_len)))
        raise ConfigError(
            f"parallel.tp_overlap={chunks} does not divide the {local} positions each rank holds between the blocks "
            f"(training.seq_len={seq_len} / cp {layout.cp} / tp {layout.tp}): the overlap cuts each rank's slice of "
            f"the sequence into equal chunks. Use a chunk count that divides {local} (valid: {valid})."
        )
    if layout.float8:
        raise ConfigError(
            f"parallel.tp_overlap={chunks} with float8.enabled=true is not built: the chunked overlap runs its GEMMs "
            "in the compute dtype, and float8's per-tensor scales must come from the whole input before it is cut "
            "into chunks. Use --parallel.async_tp=true on CUDA with compile (it fuses the float8 GEMMs too), or "
            "float8 without the overlap (--parallel.tp_overlap=0)."
        )
