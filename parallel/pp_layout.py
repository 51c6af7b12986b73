"""`parallel.pp_layout`: what each pipeline stage holds, written out or balanced by cost.

A pipeline splits the model into units, in order: 0 the embedding (E), 1..n the transformer layers, n + 1 the
output end (the final norm and the head, O, with the multi-token prediction modules, M, which read the head and
run beside it). Each stage takes a contiguous run of units. The layout is the number of units per stage, written
as the trainer logs it: stages separated by `|`, a stage's parts by `+`, e.g. `E+3 | 2 | 2 | 2+M+O`; `S*k` repeats
stage S k times (`E+3|2*29|M+O` is Megatron-Core's DeepSeek-V3 layout, its `Et*3|(tt|)*29,m|L`, with M beside O).

`auto` balances the stages by a cost of each unit (the trainer's: its FLOPs, models/flops.py; dense and MoE blocks
cost differently, the embedding next to nothing, the head and the multi-token prediction modules a block or more),
written out once the model is known (`resolve_auto`, before any work): `balance` looks for the split whose busiest
pipeline rank (the sum of its stages: two on a V schedule, stage r and 2 pp - 1 - r) is least busy, within a memory
budget per rank when one is given. No torch here: the planner imports it.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from trillion.errors import ConfigError
from trillion.parallel.layout import AUTOMATIC_STAGES, StageLayers
from trillion.parallel.modes import SCHEDULES

AUTO = "auto"
_PART = re.compile(r"^(E|O|M|\d+)$")


def _in_layers(stages: StageLayers) -> bool:
    """Whether the older settings (pp_layers_per_stage, pp_first_stage_layers, pp_last_stage_layers) size stages."""
    return (stages.per_stage, stages.first, stages.last) != (0, -1, -1)


def check_stages(stages: StageLayers, n_layers: int, num_stages: int, ahead_modules: int = 0) -> None:
    """Refuse, before any work, stage sizes this pipeline cannot take: pp_layout beside the older three settings, and
    (split_units) sizes that do not add up or leave a stage empty. Sizes without a pipeline the config refuses
    (trainer/config/effects.py)."""
    if stages.written and _in_layers(stages):
        raise ConfigError(
            f"{stages.describe()} and {dataclasses.replace(stages, written='').describe()} both size the pipeline's "
            "stages. Give one: pp_layout says everything the other three do (e.g. E+3 | 4 | 4 | 3+O)."
        )
    if num_stages > 1 and stages.written != AUTO:
        split_units(n_layers, num_stages, stages, ahead_modules)


def resolve_auto(
    stages: StageLayers, n_layers: int, costs: list[float], rank_of_stage: list[int], ahead_modules=0, paired=False
):
    """`stages` with pp_layout=auto written out: the split `balance` finds for `costs` (each unit's, in order) over
    the stages of `rank_of_stage` (`paired`: under DualPipeV's pairing, `balance_paired`); other stage sizes as they
    are."""
    if stages.written != AUTO:
        return stages
    units = len(costs) - 1 if paired else len(costs)  # paired, the embedding never makes a stage alone
    if units < len(rank_of_stage):
        raise ConfigError(
            f"parallel.pp_layout=auto has {units} units (the model's {n_layers} layers with the embedding and the "
            f"output head{', the embedding kept beside a layer under the pairing' if paired else ''}) for "
            f"{len(rank_of_stage)} pipeline stages, and every stage needs one: lower parallel.pp (or the virtual "
            "stages per rank), or train a model with more layers."
        )
    counts = balance_paired(costs, rank_of_stage) if paired else balance(costs, rank_of_stage)
    return dataclasses.replace(stages, written=describe(counts, n_layers, ahead_modules, True))


def balance_paired(costs: list[float], rank_of_stage: list[int]) -> tuple[int, ...]:
    """`balance` for a V whose two stages on a rank run paired (DualPipeV's pairing hides one stage's all-to-alls
    behind the compute of the other), so each stage needs compute of its own: the embedding, which costs next to
    nothing, never makes a stage alone (the least busy rank sum left debug-moe widened to 9 layers on pp 2 `E+0 | 3 |
    2 | 4+O`, and that rank's pairs hid next to nothing: experiments/bench/ep_overlap.py --pp 2), and among the splits
    as little busy, the one whose stages are most even (`E+3 | 2 | 2 | 2+O` there), as DeepSeek-V3 sized its chunks."""
    counts = list(balance([costs[0] + costs[1], *costs[2:]], rank_of_stage))
    counts[0] += 1
    return tuple(_even_out_v(costs, counts))


def _even_out_v(costs: list[float], counts: list[int]) -> list[int]:
    """The split of a V with the units per rank of `counts` and no rank busier than there whose stages are most even
    (least sum of squared stage costs), the first stage the embedding and a layer at least; exact, by dynamic
    programming over each rank's first stage's start x_r (its second stage ends at x_r plus the units left inside)."""
    stages, units = len(counts), len(costs)
    ranks, prefix = stages // 2, np.concatenate([[0.0], np.cumsum(costs)])
    held = [counts[r] + counts[stages - 1 - r] for r in range(ranks)]  # each rank's units
    inside = [units - sum(held[:r]) for r in range(ranks)]  # units from rank r's first stage to its second's end

    def load(x0: int, x1: int, r: int) -> float:  # rank r's two stages: [x0, x1) and [x1 + inside[r+1], x0 + inside[r])
        return prefix[x1] - prefix[x0] + prefix[x0 + inside[r]] - prefix[x1 + inside[r + 1]]

    starts, bound = np.cumsum([0, *counts[: ranks - 1]]), 0.0
    for r in range(ranks - 1):
        bound = max(bound, load(int(starts[r]), int(starts[r + 1]), r))
    bound = max(bound, prefix[starts[-1] + inside[-1]] - prefix[starts[-1]]) * (1 + 1e-12)
    best = {0: (0.0, [0])}  # x_r -> (sum of squares of the stages placed so far, x_0..x_r)
    for r in range(ranks - 1):
        reached = {}
        for x0, (squares, path) in best.items():
            for x1 in range(x0 + (2 if r == 0 else 1), x0 + held[r]):
                if load(x0, x1, r) > bound:
                    continue
                end0, end1 = x0 + inside[r], x1 + inside[r + 1]
                total = squares + (prefix[x1] - prefix[x0]) ** 2 + (prefix[end0] - prefix[end1]) ** 2
                if x1 not in reached or total < reached[x1][0]:
                    reached[x1] = (total, [*path, x1])
        best = reached
    last = min(
        (squares + (prefix[m] - prefix[x]) ** 2 + (prefix[x + inside[-1]] - prefix[m]) ** 2, path, m)
        for x, (squares, path) in best.items()
        if prefix[x + inside[-1]] - prefix[x] <= bound  # the last rank's load: its two stages meet inside
        for m in range(x + 1, x + inside[-1])
    )
    _, lefts, middle = last
    rights = [x + inside[r] for r, x in enumerate(lefts)]
    bounds = [*lefts, middle, *rights[::-1]]
    return [bounds[i + 1] - bounds[i] for i in range(stages)]


def stage_ranks(pp: int, virtual: int, schedule: str) -> list[int]:
    """The pipeline rank running each of the pp x virtual stages: stage k on rank k mod pp (looped), or on k, then
    2 pp - 1 - k (a V)."""
    v_shape = SCHEDULES[schedule].v_shape
    return [(k if k < pp else 2 * pp - 1 - k) if v_shape else k % pp for k in range(pp * virtual)]


def split_units(
    n_layers: int, num_stages: int, layers: StageLayers = AUTOMATIC_STAGES, ahead_modules: int = 0
) -> list[range]:
    """Units 0 = embedding, 1..n = layers, n+1 = output; one contiguous range per stage: as parallel.pp_layout writes
    them (`parse`), else stages that the older settings size get that many and the others share the rest evenly, a
    remainder going to the middle."""
    if layers.written:
        assert layers.written != AUTO, "pp_layout=auto is resolved once the model is known (resolve_auto)"
        counts = parse(layers.written, n_layers, num_stages, ahead_modules)
        ends = [sum(counts[: stage + 1]) for stage in range(num_stages)]
        return [range(end - count, end) for end, count in zip(ends, counts)]
    units = n_layers + 2
    sizes = layers.fixed_units(num_stages)
    free = [stage for stage in range(num_stages) if stage not in sizes]
    left = units - sum(sizes.values())
    if not free and left:
        per_stage = layers.per_stage
        if n_layers < (num_stages - 2) * per_stage:  # the middle stages alone hold too many
            per_stage = n_layers // (num_stages - 2)
        ends = n_layers - (num_stages - 2) * per_stage  # what first + last must hold at this per_stage
        fix = (
            f"--parallel.pp_layers_per_stage={per_stage} --parallel.pp_first_stage_layers={ends // 2} "
            f"--parallel.pp_last_stage_layers={ends - ends // 2}"
        )
        raise ConfigError(
            f"{layers.describe()} put {units - 2 - left} transformer layers on the {num_stages} pipeline stages, "
            f"but the model has {n_layers} (model.n_layers): first + (stages - 2) x per stage + last must equal "
            f"{n_layers}. Use e.g. {fix}, or --parallel.pp_layers_per_stage=0 to split automatically."
        )
    if free and left < len(free):
        raise ConfigError(
            f"{layers.describe()} give {units - left} of the model's {units} pipeline units ({n_layers} layers + "
            f"embedding + output) to the stages they size, leaving {max(left, 0)} for the other {len(free)} "
            f"stage(s); each stage needs at least one. Give the first / last stage fewer layers, or use "
            f"--parallel.pp_first_stage_layers=-1 --parallel.pp_last_stage_layers=-1 to split automatically."
        )
    base, extra = divmod(left, len(free)) if free else (0, 0)
    middle = sorted(free, key=lambda s: (abs(s - (num_stages - 1) / 2), s))[:extra]
    for stage in free:
        sizes[stage] = base + (stage in middle)
    ranges, start = [], 0
    for stage in range(num_stages):
        ranges.append(range(start, start + sizes[stage]))
        start += sizes[stage]
    return ranges


def parse(text: str, n_layers: int, num_stages: int, ahead_modules: int = 0) -> tuple[int, ...]:
    """Units per stage of an explicit layout for a model of `n_layers` (and `ahead_modules` multi-token prediction
    modules) over `num_stages` stages; a ConfigError naming the mistake and a layout that works otherwise."""
    stages = [_parts(stage, text) for stage in _expand(text)]
    example = describe(even(n_layers, num_stages), n_layers, ahead_modules, compact=True)
    fix = f"Use e.g. --parallel.pp_layout='{example}', or auto"
    if len(stages) != num_stages:
        raise _error(
            text, f"gives {len(stages)} stages, but the pipeline runs {num_stages} (pp x stages per rank)", fix
        )
    last = num_stages - 1
    for index, parts in enumerate(stages):
        if "E" in parts[1:] or ("E" in parts and index):
            raise _error(text, f"puts E in stage {index}; the embedding is the first stage's first part", fix)
        if "O" in parts[:-1] or ("O" in parts and index != last):
            raise _error(text, f"puts O in stage {index}; the output head is the last stage's last part", fix)
        if "M" in parts and (index != last or not ahead_modules or parts.count("M") > 1):
            why = "the model has none (model.mtp_modules=0)" if not ahead_modules else "they run once, beside O"
            raise _error(text, f"puts M (the multi-token prediction modules) in stage {index}: {why}", fix)
        if not any(part in ("E", "O") or int(part) for part in parts if part != "M"):
            raise _error(text, f"leaves stage {index} empty; every stage needs a layer, E or O", fix)
    if stages[0][0] != "E" or stages[-1][-1] != "O":
        raise _error(text, "must start with E (the embedding) and end with O (the output head)", fix)
    layers = sum(int(part) for parts in stages for part in parts if part.isdigit())
    if layers != n_layers:
        raise _error(text, f"places {layers} transformer layers, but the model has {n_layers} (model.n_layers)", fix)
    return tuple(sum(1 if part in ("E", "O") else int(part) for part in parts if part != "M") for parts in stages)


def _expand(text: str) -> list[str]:
    """The stages of `text`, each `S*k` repeated."""
    stages = []
    for stage in text.replace(" ", "").split("|"):
        body, _, times = stage.partition("*")
        if times and not times.isdigit():
            raise _error(text, f"repeats {stage!r}: after * comes a count", "Write S*k, e.g. 2*29")
        stages += [body] * (int(times) if times else 1)
    return stages


def _parts(stage: str, text: str) -> list[str]:
    parts = stage.split("+")
    for part in parts:
        if not _PART.match(part):
            raise _error(
                text,
                f"has {part or 'an empty part'!r} in a stage",
                "A stage's parts are E (embedding), a count of transformer layers, M (multi-token prediction "
                "modules) and O (output head), joined by +; stages are separated by |",
            )
    return parts


def _error(text: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"parallel.pp_layout={text!r} {problem}. {fix}.")


def describe(units: tuple[int, ...] | list[int], n_layers: int, ahead_modules: int = 0, compact: bool = False) -> str:
    """The layout of `units` per stage, as `parse` reads it; `compact`: a run of three or more equal stages as S*k."""
    out, start = [], 0
    for count in units:
        span = range(start, start + count)
        layers = sum(1 for unit in span if 0 < unit <= n_layers)
        parts = [*("E" for u in span if u == 0), str(layers)]
        if n_layers + 1 in span:
            parts += ["M", "O"] if ahead_modules else ["O"]
        out.append("+".join(parts))
        start += count
    if compact:
        runs = [[stage, 1] for stage in out[:1]]
        for stage in out[1:]:
            runs[-1][1] += stage == runs[-1][0]
            runs += [[stage, 1]] if stage != runs[-1][0] else []
        out = [f"{s}*{k}" if k >= 3 else " | ".join([s] * k) for s, k in runs]
    return " | ".join(out)


def even(n_layers: int, num_stages: int) -> tuple[int, ...]:
    """n_layers + 2 units as evenly as possible, the remainder to the middle stages (parallel/pipeline.py's split)."""
    base, extra = divmod(n_layers + 2, num_stages)
    middle = sorted(range(num_stages), key=lambda s: (abs(s - (num_stages - 1) / 2), s))[:extra]
    return tuple(base + (stage in middle) for stage in range(num_stages))


def balance(
    costs: list[float],
    rank_of_stage: list[int],
    memory: list[float] | None = None,
    budget: float = float("inf"),
) -> tuple[int, ...]:
    """Units per stage (each at least one) splitting units of `costs` (seconds of one micro-batch, in order) into
    len(rank_of_stage) contiguous stages so that the busiest rank (rank_of_stage: the rank running each stage) is
    least busy, with no rank's `memory` (bytes per unit) over `budget` where that can be had. It starts from the
    least busy split found exactly (a V: `_v_split`; else the split whose busiest stage is least busy, which is
    exact for one stage per rank) and moves one boundary by one unit at a time while that lowers (memory over
    budget, busiest rank, sum of squared rank loads): what trades time for memory, and improves looped placements."""
    stages, ranks = len(rank_of_stage), max(rank_of_stage) + 1
    v_shape = stages == 2 * ranks and all(rank_of_stage[s] == rank_of_stage[stages - 1 - s] for s in range(ranks))
    counts = _v_split(costs, ranks) if v_shape and ranks > 1 else _min_max_stages(costs, stages)

    def score(counts: list[int]) -> tuple:
        load, held, start = [0.0] * ranks, [0.0] * ranks, 0
        for stage, count in enumerate(counts):
            load[rank_of_stage[stage]] += sum(costs[start : start + count])
            held[rank_of_stage[stage]] += sum(memory[start : start + count]) if memory else 0.0
            start += count
        over = sum(max(0.0, h - budget) for h in held)
        return round(over, 6), round(max(load), 12), round(sum(x * x for x in load), 15)

    best = score(counts)
    while True:
        moves = []
        for boundary in range(stages - 1):
            for step in (1, -1):
                moved = list(counts)
                moved[boundary] += step
                moved[boundary + 1] -= step
                if min(moved[boundary], moved[boundary + 1]) >= 1:
                    moves.append((score(moved), moved))
        if not moves or min(moves)[0] >= best:
            return tuple(counts)
        best, counts = min(moves)


def _v_split(costs: list[float], ranks: int) -> list[int]:
    """The least busy busiest rank of a V (rank r runs stages r and 2 ranks - 1 - r), exactly. With x_r and y_r the
    first unit of stage r and the end of stage 2 ranks - 1 - r, rank r's load is D_r - D_{r+1}, D_r the cost of the
    units in [x_r, y_r): so a bound T is reachable when every step inward drops D by at most T, which one
    running minimum over the cursors' earlier positions per step decides (numpy, U^2 per step); T by bisection."""
    units, prefix = len(costs), np.concatenate([[0.0], np.cumsum(costs)])
    x, y = np.meshgrid(np.arange(units + 1), np.arange(units + 1), indexing="ij")
    inside = prefix[y] - prefix[x]  # D of cursors (x, y); only x < y is a window
    window = x < y

    def reachable(bound: float) -> list[np.ndarray]:
        levels = [(x == 0) & (y == units)]
        for _ in range(ranks - 1):
            held = np.where(levels[-1], inside, np.inf)
            # the least D among reachable (x0, y0) with x0 < x and y0 > y: a running minimum, shifted by one
            least = np.minimum.accumulate(np.minimum.accumulate(held, axis=0)[:, ::-1], axis=1)[:, ::-1]
            least = np.pad(least, ((1, 0), (0, 1)), constant_values=np.inf)[:-1, 1:]
            levels.append(window & (least <= inside + bound))
        levels.append(levels[-1] & (y - x >= 2) & (inside <= bound))  # the last rank: its two stages meet inside
        return levels

    low, high = 0.0, float(prefix[-1])
    while high - low > 1e-9 * high:  # the busiest rank's load to a billionth
        middle = (low + high) / 2
        low, high = (low, middle) if reachable(middle)[-1].any() else (middle, high)
    levels = reachable(high)
    cursors = [tuple(np.argwhere(levels[-1])[0])]
    for level in levels[-3::-1]:  # back out: a reachable earlier position the step from it stays within the bound
        x1, y1 = cursors[-1]
        fits = level & (x < x1) & (y > y1) & (inside <= inside[x1, y1] + high)
        cursors.append(tuple(np.argwhere(fits)[0]))
    cursors.reverse()
    lefts, rights = [int(c[0]) for c in cursors], [int(c[1]) for c in cursors]
    (x_last, y_last), half = cursors[-1], (prefix[cursors[-1][0]] + prefix[cursors[-1][1]]) / 2
    middle = min(range(x_last + 1, y_last), key=lambda cut: abs(prefix[cut] - half))  # the last rank's two stages
    bounds = [*lefts, int(middle), *rights[::-1]]
    return [bounds[i + 1] - bounds[i] for i in range(2 * ranks)]


def _min_max_stages(costs: list[float], stages: int) -> list[int]:
    """The contiguous split into `stages` non-empty stages whose costliest stage costs least (dynamic programming over
    the stages, each step one numpy pass over every (end, last cut) pair; the first of equal cuts kept)."""
    units = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    end, last = np.meshgrid(np.arange(units + 1), np.arange(units + 1), indexing="ij")
    stage_cost = np.where(last < end, prefix[end] - prefix[last], np.inf)  # the stage of units [last, end)
    # worst[u]: the least max stage cost splitting the first u units into s stages; cuts[s][u] its last cut
    worst = np.full(units + 1, np.inf)
    worst[0] = 0.0
    cuts = []
    for s in range(1, stages + 1):
        value = np.maximum(worst[None, :], stage_cost)
        valid = (end >= s) & (end <= units - (stages - s)) & (last >= s - 1)
        value = np.where(valid, value, np.inf)
        cuts.append(np.argmin(value, axis=1))
        worst = value.min(axis=1)
    counts, u = [], units
    for s in range(stages, 0, -1):
        cut = int(cuts[s - 1][u])
        counts.append(u - cut)
        u = cut
    return counts[::-1]
