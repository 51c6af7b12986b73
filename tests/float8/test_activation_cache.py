"""float8.cache_activations (models/moe.py RoutedExperts, kernels/swiglu.py): the routed experts keep their
activations for backward in float8. On debug-deepseek's kind (fp32, the experts emulated in float8, blockwise), the
forward is the uncached one's bit for bit and the gradients stay within float8's rounding of it; the bytes held from
forward to backward drop by what the experts no longer keep in high precision; settings where no product of this
project's quantises the experts' inputs are refused before any work. Under expert parallelism it equals one process
(tests/float8/test_experts_parity.py), under DualPipeV's pairing too (-m slow, tests/pipeline/test_dualpipe_pairing.py);
its loss drift over 200 steps is experiments/bench/RESULTS.md's (experiments/bench/memory_recipe.py)."""

import dataclasses
from dataclasses import replace

import pytest
import torch

from tests.helpers.parallelized import parallelized_model
from trillion.errors import ConfigError
from trillion.models import PRESETS, Transformer
from trillion.models.presets import get_preset
from trillion.parallel.layout import Float8Training, Layout
from trillion.parallel.planner.activations import moe_activation_bytes
from trillion.parallel.planner.assumptions import ASSUMED
from trillion.parallel.planner.memory import layout_memory
from trillion.trainer.assemble import resolve_layout
from trillion.trainer.config.schema import load_config
from trillion.trainer.tools.estimate.activations import measure_micro_batch

ARGS = dataclasses.replace(PRESETS["debug-deepseek"], n_layers=3, mtp_modules=0)  # one dense layer, two MoE


def _model(cache: bool) -> Transformer:
    float8 = Float8Training(emulate=True, experts="blockwise", linears=False, cache_activations=cache)
    return parallelized_model(ARGS, float8=float8)


def _batch(seq_len: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, ARGS.vocab_size, (2, seq_len), generator=generator) for _ in range(2))


def test_forward_is_unchanged_and_gradients_stay_within_float8_rounding():
    inputs, target = _batch(32)
    results = []
    for cache in (False, True):
        model = _model(cache)
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), target.flatten())
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss, grads), (cached_loss, cached_grads) = results
    assert torch.equal(loss, cached_loss)
    relative = {n: ((cached_grads[n] - g).norm() / g.norm()).item() for n, g in grads.items() if g.norm() > 0}
    assert max(relative.values()) < 0.1, max(relative.items(), key=lambda item: item[1])
    # SwiGLU's backward reads the float8 gate and up: w1's and w3's gradients move by float8's rounding (w2's of
    # the last layer hardly does: its input's float8 quantised again along the token tiles gives back nearly itself)
    gated = {name: value for name, value in relative.items() if name.endswith(("experts.w1", "experts.w3"))}
    assert len(gated) == 4 and min(gated.values()) > 1e-3, gated


def test_it_drops_the_experts_high_precision_activations_as_the_planner_counts():
    """Bytes held from the forward to the backward of one micro-batch (MemTracker, fp32): per routed slot (256
    tokens x top 2 in each of 2 MoE layers) the cache no longer keeps the row (dim 256) for w1 and w3, nor gate, up
    and w2's input (3 x expert width 256; kernels/swiglu.py recomputes the rest), 4096 bytes, and keeps instead the
    row, gate, up and w2's input in float8 (4 x 256 bytes) with one float32 scale per 128 elements (8 of them): 1056
    bytes. The planner's
    activation accounting (parallel/planner/activations.py moe_activation_bytes) drops the same within 5%, and so does a
    plan's memory (deepseek-v3-671b, its layers' activations only)."""
    inputs, target = _batch()
    held = {cache: measure_micro_batch(_model(cache), inputs, target, False, True).held for cache in (False, True)}
    slots = 2 * 128 * ARGS.moe.top_k * (ARGS.n_layers - ARGS.moe.n_dense_layers)
    expected = slots * (4 * (ARGS.dim + 3 * ARGS.moe.expert_ffn_dim) - (4 * 256 + 8 * 4))
    dropped = held[False] - held[True]
    assert 0.95 * expected <= dropped <= 1.05 * expected, (dropped, expected)
    tokens, moe_layers = 2 * 128, ARGS.n_layers - ARGS.moe.n_dense_layers
    planned = [moe_activation_bytes(ARGS, tokens, 1, 1, 1.0, 4, cache) for cache in (False, True)]
    assert 0.95 * dropped <= moe_layers * (planned[0] - planned[1]) <= 1.05 * dropped, (planned, dropped)
    args, layout = get_preset("deepseek-v3-671b"), Layout(pp=16, ep=64, dp_shard=128, microbatches=32)
    f8 = Float8Training(experts="blockwise", cache_activations=True)
    plain, cached = (
        layout_memory(args, replace(layout, float8=f), 4096, ASSUMED)
        for f in (replace(f8, cache_activations=False), f8)
    )
    # its fullest rank's activations 130 GB without the cache, 107 GB with it (no recompute): at least a tenth less
    # (the fullest rank is another pipeline rank with the cache, so only the activations compare)
    assert cached.activations < 0.9 * plain.activations


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model.name=debug-moe", "--float8.experts=off"], "cache_activations=true with float8.experts=off"),
        (["--model.name=debug-moe", "--float8.recipe=mxfp8"], "cache_activations=true with float8.experts=mxfp8"),
        (["--model.name=debug"], "float8.cache_activations"),  # no routed experts: it would do nothing
    ],
)
def test_where_it_cannot_act_it_is_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        config = load_config(None, ["--float8.enabled=true", "--float8.cache_activations=true", *flags])
        resolve_layout(config, 1)


def test_under_deepseeks_recompute_w2s_input_is_rebuilt_from_the_cached_gate_and_up():
    """DeepSeek recomputes the SwiGLU output from its cached float8 inputs (models/moe.py RoutedExperts with
    recompute_swiglu, as parallel.activation_checkpoint=deepseek sets it): w2's product keeps nothing of its input, 256
    float8 bytes and 2 float32 scales a slot; the forward and every gradient but w2's are the same bit for bit, w2's
    moves by float8's rounding (its weight gradient reads the input rebuilt from float8 gate and up); the planner
    drops the same bytes."""
    inputs, target = _batch()
    held, grads = {}, {}
    for rebuilt in (False, True):
        model = _model(True)
        for module in model.modules():
            if hasattr(module, "recompute_swiglu"):
                module.recompute_swiglu = rebuilt
        held[rebuilt] = measure_micro_batch(model, inputs, target, False, True).held
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), target.flatten())
        loss.backward()
        grads[rebuilt] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    slots = 2 * 128 * ARGS.moe.top_k * (ARGS.n_layers - ARGS.moe.n_dense_layers)
    assert held[False] - held[True] == slots * (ARGS.moe.expert_ffn_dim + 4 * ARGS.moe.expert_ffn_dim // 128)
    moved = {n for n, g in grads[False].items() if not torch.equal(g, grads[True][n])}
    assert moved and all(n.endswith("experts.w2") for n in moved), moved
    for name in moved:
        assert (grads[True][name] - grads[False][name]).norm() < 0.1 * grads[False][name].norm()
    tokens, moe_layers = 2 * 128, ARGS.n_layers - ARGS.moe.n_dense_layers
    planned = [moe_activation_bytes(ARGS, tokens, 1, 1, 1.0, 4, True, rebuilt) for rebuilt in (False, True)]
    assert moe_layers * (planned[0] - planned[1]) == pytest.approx(held[False] - held[True], rel=0.05)
