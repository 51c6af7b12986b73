"""MuonClip in one process: a head whose logits pass tau has exactly its query and key rows rescaled (against the
same step without the clip, rows computed here from the Kimi K2 report's rule), the next forward of the same batch
has every head's max logit at or below tau (each attention on the input it had, up to the step's own O(lr) update),
and heads below tau keep their logits. Under tp 2 and dp 2 the clip is
the one-process clip: tests/muon/test_parity.py (MuonClip cases). Its bad input: an attention whose logits cannot
be clipped by its weights."""

import contextlib
import dataclasses

import pytest
import torch

from tests.muon.harness import MODELS, pump_first_head
from trillion.errors import ConfigError
from trillion.models import Transformer
from trillion.models.logit_probe import attention_probes, head_max_logits, install_probes
from trillion.parallel.dims import ParallelDims
from trillion.parallel.forward_backward import MicroBatchLoop
from trillion.parallel.muon.qk_clip import QKClip, check_clippable
from trillion.trainer.config.schema import Optimizer
from trillion.trainer.optim import build_optimizer
from trillion.trainer.step import train_step

# A small learning rate: the step's own update (AdamW moves the embeddings by about lr per element) changes the next
# forward's logits by O(lr) beside the clip, which alone would make them exactly tau for the same batch.
TAU, PUMP, SEED, LR, DRIFT = 2.0, 40.0, 5, 1e-5, 1e-3


def _pumped(args):
    """The model, probed, with head 0's logits pumped past the others'."""
    model = Transformer(args)
    install_probes(model)
    model.init_weights(SEED)
    pump_first_head([model], args, PUMP)
    return model


def _trained(args, tau: float):
    """(model, its probes' step maxima, each attention's input in that step) after one Muon step on a fixed batch
    from the pumped start."""
    model = _pumped(args)
    inputs = {}
    for index, (module, _) in attention_probes(model).items():
        module.register_forward_pre_hook(lambda _m, a, index=index: inputs.setdefault(index, a))
    config = Optimizer(name="muon", lr=LR, implementation="for-loop", newton_schulz_dtype="float32", qk_clip=tau)
    optimizer = build_optimizer(model, config, "cpu")
    tokens = torch.randint(0, args.vocab_size, (4, 17), generator=torch.Generator().manual_seed(SEED))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    train_step(
        MicroBatchLoop(model), [(tokens[:, :-1], tokens[:, 1:])], optimizer, scaler, contextlib.nullcontext(), 1.0
    )
    maxima = [probe.step_max for _, probe in attention_probes(model).values()] if tau else None
    return model, maxima, inputs


def _maxima_again(model, inputs) -> list[torch.Tensor]:
    """Each attention's per-head max logit on the input it had in the step, with its weights after the step: the
    logits the clip bounds (a later layer's input also changes when an earlier layer is clipped)."""
    found = []
    for index, (module, probe) in attention_probes(model).items():
        probe.reset()
        module(*inputs[index])
        found.append(probe.running)
    return found


def _weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_gqa_head_past_tau_is_rescaled_and_the_next_max_is_tau():
    args = MODELS["dense"]  # 4 query heads, 2 key/value heads: heads 0 and 1 share key block 0
    clipped, maxima, inputs = _trained(args, TAU)
    plain, _, _ = _trained(args, 0.0)
    after, before = _weights(clipped), _weights(plain)
    d, group = args.head_dim, args.n_heads // args.kv_heads
    for layer, layer_max in enumerate(maxima):
        gamma = (TAU / layer_max).clamp(max=1.0)
        assert gamma[0] < 1 and torch.all(gamma[1:] == 1), f"layer {layer}: only head 0 passes tau: {layer_max}"
        key = torch.stack([gamma[g * group : (g + 1) * group].min().sqrt() for g in range(args.kv_heads)])
        query = gamma / key.repeat_interleave(group)
        prefix = f"layers.{layer}.attention."
        torch.testing.assert_close(
            after[prefix + "wq.weight"], before[prefix + "wq.weight"] * query.repeat_interleave(d)[:, None]
        )
        torch.testing.assert_close(
            after[prefix + "wk.weight"], before[prefix + "wk.weight"] * key.repeat_interleave(d)[:, None]
        )
    untouched = [n for n in after if not n.endswith(("attention.wq.weight", "attention.wk.weight"))]
    assert untouched and all(torch.equal(after[n], before[n]) for n in untouched)
    again, reference = _maxima_again(clipped, inputs), _maxima_again(plain, inputs)
    for layer, (mine, theirs) in enumerate(zip(again, reference)):
        assert mine.max() <= TAU * (1 + DRIFT), f"layer {layer}: {mine}"
        torch.testing.assert_close(mine[0], torch.tensor(TAU), rtol=DRIFT, atol=0)  # clipped to tau
        torch.testing.assert_close(mine[1:], theirs[1:], rtol=1e-5, atol=1e-7)  # the others' logits kept


def test_latent_attention_clips_its_own_rows_and_leaves_the_shared_rotary_key():
    args = dataclasses.replace(MODELS["mla"], moe=None)
    clipped, maxima, inputs = _trained(args, TAU / 2)
    plain, _, _ = _trained(args, 0.0)
    after, before = _weights(clipped), _weights(plain)
    mla = args.mla
    nope, rope, v = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    for layer, layer_max in enumerate(maxima):
        gamma = (TAU / 2 / layer_max).clamp(max=1.0)
        assert gamma[0] < 1, f"layer {layer}: head 0 must pass tau: {layer_max}"
        # the report's rule: q and k no-position rows sqrt(gamma), the head's rotary query rows gamma, values kept
        query = torch.cat([torch.cat([g.sqrt().repeat(nope), g.repeat(rope)]) for g in gamma])
        key_value = torch.cat([torch.cat([g.sqrt().repeat(nope), torch.ones(v)]) for g in gamma])
        prefix = f"layers.{layer}.attention."
        torch.testing.assert_close(after[prefix + "wq_b.weight"], before[prefix + "wq_b.weight"] * query[:, None])
        torch.testing.assert_close(after[prefix + "wkv_b.weight"], before[prefix + "wkv_b.weight"] * key_value[:, None])
        assert torch.equal(after[prefix + "wkv_a.weight"], before[prefix + "wkv_a.weight"]), "the rotary key is shared"
    for layer, mine in enumerate(_maxima_again(clipped, inputs)):
        assert mine.max() <= TAU / 2 * (1 + DRIFT), f"layer {layer}: {mine}"


def test_max_logits_are_those_of_the_whole_score_matrix():
    """The chunked measure equals the eager scores' masked maximum (grouped heads, causal, a KV prefix)."""
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, generator=generator), torch.randn(2, 2, 7, 8, generator=generator)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-2, -1) * 0.3
    scores = scores.masked_fill(~torch.ones(5, 7, dtype=torch.bool).tril(2), float("-inf"))
    torch.testing.assert_close(head_max_logits(q, k, softmax_scale=0.3), scores.amax(dim=(0, 2, 3)))


def test_max_logits_under_document_masking_leave_out_other_documents_keys():
    """With document ids, only a query's own document's keys count, as in the attention (a query chunk at the end
    of a longer key sequence, as context parallelism runs it): a huge logit against another document is ignored."""
    generator = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, 4, 8, generator=generator), torch.randn(1, 2, 6, 8, generator=generator)
    ids = torch.tensor([[0, 0, 0, 1, 1, 2]])
    k[:, :, 0] = 50 * q[:, :, 1]  # key 0 (document 0) would win every head's maximum for query 1 (document 1)
    scores = q @ k.transpose(-2, -1)
    query_ids = ids[:, 2:]
    keep = torch.ones(4, 6, dtype=torch.bool).tril(2) & (query_ids[0, :, None] == ids[0, None, :])
    expected = scores.masked_fill(~keep, float("-inf")).amax(dim=(0, 2, 3))
    found = head_max_logits(q, k, softmax_scale=1.0, document_ids=ids)
    torch.testing.assert_close(found, expected)
    assert (found < head_max_logits(q, k, softmax_scale=1.0)).all()


def test_qk_clip_refuses_an_attention_that_cannot_report_clippable_logits():
    with pytest.raises(ConfigError, match=r"optimizer.qk_clip=100.*QK norms.*--optimizer.qk_clip=0"):
        check_clippable(dataclasses.replace(MODELS["dense"], qk_norm=True), "optimizer.qk_clip=100")


def test_a_step_without_a_measured_forward_leaves_the_weights():
    """No forward since the reset (a resume's optimizer step on zero gradients, which DCP runs to make the state it
    loads into): every maximum is -inf, and the clip scales by 1."""
    args = MODELS["dense"]
    model = Transformer(args)
    install_probes(model)
    model.init_weights(SEED)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    QKClip(model, args, TAU, ParallelDims(world_size=1)).apply()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_an_attention_without_an_attend_seam_is_named():
    """What the trainer refuses qk_clip with (trainer/assemble.py): an attention its probe cannot wrap."""
    with torch.device("meta"):
        model = Transformer(MODELS["dense"])
    del model.layers["1"].attention.attend
    assert install_probes(model) == ["layers.1.attention"]


def _reference_maxima(calls) -> torch.Tensor:
    """Each query head's largest q . k x scale over a step's forwards, from the q and k the attention received:
    the whole causal score matrix in float64, written here apart from the probe's chunked measure."""
    best = None
    for q, k, scale in calls:
        q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scores = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
        found = scores.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))
        best = found if best is None else torch.maximum(best, found)
    return best


def test_each_step_clips_with_its_own_max_logits():
    """Two MuonClip steps on two batches, the first pumped past tau: what each step's clip scales by is that step's
    own maxima, not a maximum kept from the step before (which would clip the rows again every step)."""
    args = MODELS["dense"]
    model = _pumped(args)
    calls = {}
    for index, (_, probe) in attention_probes(model).items():

        def recorded(q, k, v, *, inner=probe.attend, index=index, causal=True, softmax_scale=None, **kwargs):
            calls.setdefault(index, []).append((q.detach(), k.detach(), softmax_scale))
            return inner(q, k, v, causal=causal, softmax_scale=softmax_scale, **kwargs)

        probe.attend = recorded
    config = Optimizer(name="muon", lr=LR, implementation="for-loop", newton_schulz_dtype="float32", qk_clip=TAU)
    optimizer = build_optimizer(model, config, "cpu")
    generator = torch.Generator().manual_seed(SEED)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for step in range(2):
        calls.clear()
        tokens = torch.randint(0, args.vocab_size, (4, 17), generator=generator)
        batch = [(tokens[:, :-1], tokens[:, 1:])]
        train_step(MicroBatchLoop(model), batch, optimizer, scaler, contextlib.nullcontext(), 1.0)
        for index, (_, probe) in attention_probes(model).items():
            expected = _reference_maxima(calls[index]).float()
            torch.testing.assert_close(probe.step_max, expected, rtol=1e-5, atol=1e-5, msg=f"step {step}, {index}")
            assert step or expected[0] > TAU, "the first step's head 0 must pass tau"
