"""parallel.pp_layout: a written layout read into units per stage (and back), every mistake refused before any work
with what to write instead, and `auto`: the split whose busiest pipeline rank is least busy, by the planner's cost
of each unit (its FLOPs). Parity of uneven splits with one process: tests/pipeline/test_pipeline_parity.py."""

import itertools
import random

import pytest

from trillion.errors import ConfigError
from trillion.models import PRESETS
from trillion.models.flops import unit_flops_per_token
from trillion.parallel.layout import AUTOMATIC_STAGES, StageLayers
from trillion.parallel.pp_layout import (
    _min_max_stages,
    balance,
    balance_paired,
    check_stages,
    describe,
    even,
    parse,
    resolve_auto,
    split_units,
    stage_ranks,
)
from trillion.trainer.assemble import check_model_layout, resolve_layout, resolve_stage_split
from trillion.trainer.config.schema import load_config

DEEPSEEK = PRESETS["deepseek-v3-671b"]  # 61 layers, 3 dense, one MTP module


def test_a_layout_reads_into_units_per_stage_and_back():
    # Megatron-Core's DeepSeek-V3 layout (Et*3|(tt|)*29,m|L), the multi-token prediction module beside the head
    units = parse("E+3 | 2*29 | M+O", 61, 31, ahead_modules=1)
    assert units == (4, *[2] * 29, 1) and sum(units) == 61 + 2
    assert describe(units, 61, 1, compact=True) == "E+3 | 2*29 | 0+M+O"
    assert parse(describe(units, 61, 1), 61, 31, 1) == units
    assert parse("E|3+O", 3, 2) == (1, 4)  # the embedding alone on a stage
    assert parse("E+0 | 3 | 0+O", 3, 3) == (1, 3, 1)  # the trainer's log form: 0 layers beside E or O


# (layout, n_layers, stages, MTP modules, words the message must hold)
REFUSED = [
    ("E+3|2*28|M+O", 61, 31, 1, ["gives 30 stages", "runs 31", "--parallel.pp_layout='E+1 | 2*14 | 3 | 2*14 | 1+M+O'"]),
    ("E+3|2*29|1|M+O", 61, 32, 1, ["places 62 transformer layers", "has 61 (model.n_layers)"]),
    ("E+2|0|2+O", 4, 3, 0, ["leaves stage 1 empty"]),
    ("2|E+2+O", 4, 2, 0, ["puts E in stage 1", "the first stage's first part"]),
    ("E+2+O|2", 4, 2, 0, ["puts O in stage 0", "the last stage's last part"]),
    ("E+2|2+O+M", 4, 2, 1, ["puts O in stage 1"]),
    ("E+2|2+M+O", 4, 2, 0, ["puts M", "the model has none (model.mtp_modules=0)"]),
    ("E+1+M|3+O", 4, 2, 1, ["puts M", "stage 0", "beside O"]),
    ("E+2|two+O", 4, 2, 0, ["has 'two' in a stage", "joined by +"]),
    ("E+2|2*x+O", 4, 2, 0, ["after * comes a count"]),
    ("2|2+O", 4, 2, 0, ["must start with E"]),
]


@pytest.mark.parametrize("text, n_layers, stages, ahead, words", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_wrong_layout_is_refused_with_the_fix(text, n_layers, stages, ahead, words):
    with pytest.raises(ConfigError) as error:
        parse(text, n_layers, stages, ahead)
    assert str(error.value).startswith(f"parallel.pp_layout={text!r}")
    for word in words:
        assert word in str(error.value), f"{word!r} not in: {error.value}"


def test_one_setting_sizes_the_stages():
    assert [len(r) for r in split_units(8, 4)] == [2, 3, 3, 2]  # the even split
    assert [len(r) for r in split_units(8, 4, StageLayers(3, first=1, last=1))] == [2, 3, 3, 2]  # the older settings
    assert [len(r) for r in split_units(4, 2, StageLayers(written="E+3|1+O"))] == [4, 2]  # pp_layout
    with pytest.raises(ConfigError, match="both size the pipeline's stages. Give one"):
        check_stages(StageLayers(2, written="E+2|2+O"), 4, 2)
    with pytest.raises(ConfigError, match="parallel.pp_layout") as refused:  # without a pipeline (config/effects.py)
        load_config(None, ["--parallel.pp_layout=E+4+O"])
    assert "--parallel.pp=2" in str(refused.value)
    check_stages(AUTOMATIC_STAGES, 4, 1)


def test_balance_finds_the_least_busy_busiest_rank_of_a_v():
    """Against every split of small random models on V placements of 2 and 3 ranks (rank r runs stages r and
    2 p - 1 - r): the busiest rank is as little busy as any split makes it, which evening the stages alone misses."""
    generator, beaten = random.Random(5), 0
    for _ in range(60):
        costs = [round(generator.uniform(0, 3), 1) for _ in range(generator.randint(6, 10))]
        p = generator.choice([2, 3])
        ranks = [*range(p), *range(p - 1, -1, -1)]
        units = balance(costs, ranks)
        assert sum(units) == len(costs) and min(units) >= 1
        best = min(_busiest(costs, split, ranks) for split in _splits(len(costs), 2 * p))
        assert _busiest(costs, units, ranks) == pytest.approx(best)
        beaten += _busiest(costs, _min_max_stages(costs, 2 * p), ranks) > best + 1e-9
    assert beaten > 10
    # within memory: no rank past the budget where a split allows it
    costs, memory = [0.0, 1, 1, 1, 1, 1, 1, 0.5], [4.0, 1, 1, 1, 1, 1, 1, 0.0]
    units = balance(costs, [0, 1], memory, budget=6.0)
    assert sum(memory[: units[0]]) <= 6.0 < sum(memory[: balance(costs, [0, 1])[0]])


def test_balance_paired_gives_every_stage_of_the_v_compute_and_evens_the_stages():
    """Under DualPipeV's pairing (each rank's two stages run side by side, parallel/pipeline_pairing.py) `auto` keeps
    the embedding beside a layer and, at the busiest rank of every split that does so (all of them enumerated),
    spreads each rank's units most evenly over its two stages. debug-moe widened as the pairing benchmark runs it
    (experiments/bench/ep_overlap.py --pp 2): the plain balance leaves stage 0 the embedding alone."""
    generator = random.Random(7)
    for _ in range(40):
        costs = [0.0, *(round(generator.uniform(0.2, 3), 1) for _ in range(generator.randint(6, 10)))]
        p = generator.choice([2, 3])
        ranks = [*range(p), *range(p - 1, -1, -1)]
        units = balance_paired(costs, ranks)
        fitting = [split for split in _splits(len(costs), 2 * p) if split[0] >= 2]
        best = min(_busiest(costs, split, ranks) for split in fitting)
        assert units[0] >= 2 and _busiest(costs, units, ranks) == pytest.approx(best)
        held = [units[r] + units[2 * p - 1 - r] for r in range(p)]
        same = [s for s in fitting if [s[r] + s[2 * p - 1 - r] for r in range(p)] == held]
        same = [s for s in same if _busiest(costs, s, ranks) <= best + 1e-9]
        assert _stage_squares(costs, units) == pytest.approx(min(_stage_squares(costs, s) for s in same))
    widened = [0.0, 0.36, *[1.0] * 8, 0.04]  # embedding, a dense layer, 8 MoE layers, the head (FLOPs / MoE layer)
    assert describe(balance(widened, [0, 1, 1, 0]), 9, compact=True) == "E+0 | 3 | 2 | 4+O"
    assert describe(balance_paired(widened, [0, 1, 1, 0]), 9, compact=True) == "E+3 | 2 | 2 | 2+O"


def test_auto_refuses_more_stages_than_units_with_the_fix():
    """A V of 4 stages over a 2-layer model: the 4 units (embedding, 2 layers, head) fill it one each, but not under
    the pairing, which keeps the embedding beside a layer."""
    costs, ranks = [0.0, 1.0, 1.0, 0.1], [0, 1, 1, 0]
    assert resolve_auto(StageLayers(written="auto"), 2, costs, ranks).written == "E+0 | 1 | 1 | 0+O"
    with pytest.raises(ConfigError, match=r"has 3 units .* for 4 pipeline stages.*lower parallel.pp"):
        resolve_auto(StageLayers(written="auto"), 2, costs, ranks, paired=True)


def _stage_squares(costs, units) -> float:
    return sum(sum(costs[start : start + count]) ** 2 for start, count in zip([0, *_ends(units)], units))


def _splits(units: int, stages: int):
    for cuts in itertools.combinations(range(1, units), stages - 1):
        bounds = [0, *cuts, units]
        yield [bounds[i + 1] - bounds[i] for i in range(stages)]


def _busiest(costs, units, ranks) -> float:
    loads = [0.0] * (max(ranks) + 1)
    for stage, (start, count) in enumerate(zip([0, *_ends(units)], units)):
        loads[ranks[stage]] += sum(costs[start : start + count])
    return max(loads)


def _ends(units):
    return [sum(units[: i + 1]) for i in range(len(units))]


def test_deepseek_v3_balanced_on_pp16_dualpipev():
    """DeepSeek-V3 in DeepSeek's layout: its three dense layers, 58 MoE layers, head and MTP module on 32 stages of a
    V, by each unit's FLOPs (what `auto` balances). A layer costs about the same dense or MoE (DeepSeek sized the
    experts so), the output end with its MTP module about 3.6 layers: the least busy busiest rank is the one holding
    the output end and one layer (with none, 61 layers over 15 ranks would put 5 on one), and `balance` finds it."""
    costs, ranks = unit_flops_per_token(DEEPSEEK, 4096), stage_ranks(16, 2, "DualPipeV")
    assert ranks[:3] == [0, 1, 2] and ranks[-3:] == [2, 1, 0]
    assert costs[1] < costs[4] < costs[-1]  # a dense layer, an MoE layer, the head with the MTP module
    units = balance(costs, ranks)
    assert units[0] + units[-1] == 3  # rank 0: the embedding, one layer and the output end
    assert _busiest(costs, units, ranks) == pytest.approx(costs[-1] + costs[1])
    assert 5 * costs[4] > costs[-1] + costs[1]
    assert _busiest(costs, units, ranks) <= _busiest(costs, even(61, 32), ranks)  # at this shape, even's is as low


def test_the_trainer_resolves_auto_before_any_work():
    """`auto` is written out once the model is known (assemble.resolve_stage_split), an explicit layout checked
    against the model's layers before any work."""
    args = PRESETS["debug-deepseek"]  # 4 layers, one MTP module
    flags = ["--parallel.pp=2", "--parallel.pp_schedule=1F1B", "--training.micro_batch_size=2"]

    def stages(layout_flag: str) -> StageLayers:
        config = load_config(None, [*flags, layout_flag])
        layout = resolve_layout(config, 2)
        check_model_layout(layout, args, config.training.seq_len)
        return resolve_stage_split(layout, args, config.training.seq_len).stage_layers

    written = stages("--parallel.pp_layout=auto").written
    counts = [len(r) for r in split_units(args.n_layers, 2, StageLayers(written=written), ahead_modules=1)]
    assert sum(counts) == args.n_layers + 2 and min(counts) >= 1 and "M+O" in written
    assert stages("--parallel.pp_layout=E+3|1+M+O").written == "E+3|1+M+O"
    with pytest.raises(ConfigError, match="places 3 transformer layers"):
        stages("--parallel.pp_layout=E+2|1+O")
