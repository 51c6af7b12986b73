"""The pairing's phase (parallel.ep_pairing_phase) as the planner prices it (planner/pairing.py): the segment each
post meets is the one the trainer's turns run beside it (expert_overlap.Pair with its lead), the search picks the
phase that leaves DeepSeek-V3's step shortest, the plan's config carries it, and the trainer's auto gives the same."""

import dataclasses

import pytest

from tests.planner.test_dualpipe_plan import ASSUMED, DEEPSEEK, H800, LAYOUT, _request
from trillion.errors import ConfigError
from trillion.models.presets import expert_presets, get_preset
from trillion.parallel.ep_checks import (
    AUTO_PAIRING_PHASE,
    attention_outweighs_shared,
    check_ep_dispatch,
    ep_nodes,
    resolve_pairing_phase,
)
from trillion.parallel.expert_overlap import Pair, after_post
from trillion.parallel.planner.cost import step_time
from trillion.parallel.planner.pairing import Segments, Turns, backward_turns, exposed_at_phase, forward_turns
from trillion.parallel.planner.search import evaluate


def _turn_order(turns: int, layers: int, phase: int) -> list[tuple[str, int]]:
    """The posts of a forward and a paired backward in the order the Pair runs them: (side, index in the layer)."""
    log = []

    def side(name: str):
        def run():
            for post in range(turns * layers):
                log.append((name, post % turns))
                after_post()

        return run

    Pair(backward_side=True, lead=phase).run(side("F"), side("B"))
    return log


@pytest.mark.parametrize("turns, phase", [(3, 0), (3, 1), (3, 2), (2, 1), (5, 4), (5, 2)])
def test_each_post_meets_the_segment_the_trainers_turns_run_beside_it(turns, phase):
    """After each post the other side runs the segment ending in its next post: where the two alternate (past the
    start), the forward's post i meets the backward's segment i - phase and the backward's post k the forward's
    segment k + phase + 1, pairing.py's indices."""
    log = _turn_order(turns, 3, phase)
    met = 0
    for (side, post), (other, nxt) in zip(log, log[1:]):
        if side == other:  # the start's hand-backs, or the end: nothing beside
            continue
        expected = (post - phase) % turns if side == "F" else (post + phase + 1) % turns
        assert nxt == expected, (side, post, nxt, log)
        met += 1
    assert met >= 2 * turns * 2  # two layers' worth of turns alternated at least


def test_a_post_is_exposed_for_what_the_segment_beside_it_leaves():
    forward = Turns(segments=(5.0, 1.0, 6.0), posts=(0.5, 4.0, 8.0))
    backward = Turns(segments=(12.0, 13.0, 2.0), posts=(8.0, 8.0, 0.0))
    # phase 0: counts by 12, rows by 13, combine by 2 (6 left); the reverses by 1 (7 left) and by 6 (2 left)
    assert exposed_at_phase(forward, backward, 0) == pytest.approx((6.0, 9.0))
    # phase 1: counts by 2, rows by 12, combine by 13; the reverses by 6 (2 left) and by 5 (3 left)
    assert exposed_at_phase(forward, backward, 1) == pytest.approx((0.0, 5.0))


@pytest.mark.parametrize("mode", ["rank", "node"])
@pytest.mark.parametrize("attention_outweighs", [True, False])
def test_the_trainers_auto_phase_is_the_models_best_for_either_heavier_segment(mode, attention_outweighs):
    """The trainer's auto (ep_checks.AUTO_PAIRING_PHASE) decides by one comparison, the attention's FLOPs against the
    shared experts'; pairing.py, given segments and all-to-alls of DeepSeek-V3's proportions (the shared experts and
    the attention swapped for the other case), puts its least exposure at that phase."""
    heavy, light = 5.7, 0.6
    forward = Segments(heavy, light, 6.6) if attention_outweighs else Segments(light, heavy, 6.6)
    backward = Segments(2 * forward.attention, 2 * forward.shared, 13.3)
    hops = [6.0, 2.9] if mode == "node" else [8.8]
    sent = [3.1, 1.5] if mode == "node" else [5.9]
    ahead = forward_turns(mode, False, 0.2, sent, hops, forward)
    behind = backward_turns(mode, False, hops, hops, backward)
    exposed = [sum(exposed_at_phase(ahead, behind, p)) for p in range(len(ahead.posts))]
    assert min(range(len(exposed)), key=exposed.__getitem__) == AUTO_PAIRING_PHASE[mode, attention_outweighs], exposed


def test_the_attention_outweighs_the_shared_experts_in_every_moe_preset_but_llama4_scout():
    """docs/parallelism.md's claim: auto takes the attention-heavy phases for every MoE preset at 4096 tokens but
    llama4-scout, whose shared expert is as wide as its routed ones beside a small GQA attention."""
    heavier = {name: attention_outweighs_shared(get_preset(name), 4096) for name in expert_presets()}
    assert [name for name, attention in heavier.items() if not attention] == ["llama4-scout"], heavier


def test_deepseeks_layout_is_planned_at_the_phase_that_exposes_least():
    """On DeepSeek-V3's layout (per node: five turns a side) phase 0 puts the first hop's rows and the combine's
    reverse beside empty gaps; the search takes phase 4, which the trainer's auto also gives."""
    exposed = [
        step_time(DEEPSEEK, H800, dataclasses.replace(LAYOUT, ep_pairing_phase=p), 4096, ASSUMED).ep_exposed
        for p in range(5)
    ]
    assert min(range(5), key=exposed.__getitem__) == 4 and exposed[4] < 0.6 * exposed[0], exposed
    candidate = evaluate(_request(), LAYOUT)
    assert candidate.layout.ep_pairing_phase == 4
    assert resolve_pairing_phase(LAYOUT, -1, DEEPSEEK, 4096) == 4
    per_rank = dataclasses.replace(LAYOUT, ep_dispatch="rank")
    auto = resolve_pairing_phase(per_rank, -1, DEEPSEEK, 4096)
    assert evaluate(_request(), per_rank).layout.ep_pairing_phase == auto == 1
    # a phase the user gave is planned as given
    fixed = evaluate(_request(ep_pairing_phase=0), dataclasses.replace(LAYOUT, ep_pairing_phase=0))
    assert fixed.layout.ep_pairing_phase == 0 and fixed.step.total > candidate.step.total


@pytest.mark.parametrize("phase", [5, -2])
def test_a_phase_past_the_layers_turns_is_refused_naming_the_setting(phase):
    layout = dataclasses.replace(LAYOUT, ep_pairing_phase=phase)
    with pytest.raises(ConfigError, match=r"parallel.ep_pairing_phase=.*0 to 4"):
        check_ep_dispatch(layout, ep_nodes(layout), DEEPSEEK, warn=False)
