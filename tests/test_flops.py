"""FLOP and parameter accounting against PyTorch's own counters."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from trillion.models import PRESETS, Transformer
from trillion.models.flops import (
    count_params,
    hardware_flops_per_token,
    megatron_flops_per_iteration,
    model_flops_per_token,
)
from trillion.parallel.activation_checkpoint import apply_activation_checkpointing


@pytest.mark.parametrize("name", list(PRESETS))
def test_count_params_equals_the_built_model(name):
    with torch.device("meta"):
        model = Transformer(PRESETS[name])
    counted = count_params(PRESETS[name])
    assert counted.total == sum(p.numel() for p in model.parameters())
    tables = [model.tok_embeddings.weight] + ([model.pos_embeddings.weight] if model.pos_embeddings is not None else [])
    assert counted.embedding == sum(t.numel() for t in tables)


def test_paper_model_sizes():
    """experiments/frontier/PAPER.md: about 22B, 175B and 1T parameters."""
    assert 21e9 < count_params(PRESETS["gpt-22b"]).total < 23e9
    assert 170e9 < count_params(PRESETS["gpt-175b"]).total < 180e9
    assert 0.98e12 < count_params(PRESETS["gpt-1t"]).total < 1.03e12


def _measured_flops_per_token(args, seq_len, checkpointing="none"):
    model = Transformer(
        dataclasses.replace(args, attention_impl="eager")
    )  # eager: attention matmuls are visible to the counter
    model.init_weights(0)
    apply_activation_checkpointing(model, checkpointing)
    tokens = torch.randint(0, args.vocab_size, (2, seq_len))
    # Without early stop the recompute runs each block's whole forward, the convention HFU counts.
    with torch.utils.checkpoint.set_checkpoint_early_stop(False), FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    return counter.get_total_flops() / tokens.numel()


@pytest.mark.parametrize("name", ["debug", "debug-gpt"])
def test_model_flops_match_flop_counter(name):
    """The formula counts 6 FLOPs per token for every non-embedding parameter; norm gains and biases
    are in N but do no matmul, which is exactly the difference to the counted matmul FLOPs."""
    args = dataclasses.replace(PRESETS[name], n_layers=2)
    seq_len = 64
    elementwise = sum(p.numel() for n, p in Transformer(args).named_parameters() if "norm" in n or n.endswith("bias"))
    measured = _measured_flops_per_token(args, seq_len)
    assert measured == model_flops_per_token(args, seq_len) - 6 * elementwise


def test_multi_token_prediction_flops_match_flop_counter():
    """The MTP module's block, eh_proj and shared head cost 6 FLOPs per parameter and its attention 12 H d T per
    token, as the trunk's; it runs at the trunk's length (models/mtp.py: every position, the last ones padded)."""
    args = dataclasses.replace(PRESETS["debug"], n_layers=1, dim=128, attention_impl="eager")
    mtp_args = dataclasses.replace(args, mtp_modules=1, mtp_loss_weight=0.3)
    seq, attention = 32, 12 * args.n_heads * args.head_dim
    model = Transformer(mtp_args)
    tokens = torch.randint(0, args.vocab_size, (2, seq))
    with FlopCounterMode(display=False) as counter:
        logits, ahead = model(tokens, ahead=tokens.unsqueeze(-1))  # any tokens: FLOPs do not depend on them
        (logits.sum() + ahead.sum()).backward()
    extra = counter.get_total_flops() - _measured_flops_per_token(args, seq) * tokens.numel()
    norms = sum(p.numel() for n, p in model.mtp.named_parameters() if "norm" in n)
    module = model_flops_per_token(mtp_args, seq) - model_flops_per_token(args, seq) - attention * seq
    assert module > 6 * args.vocab_size * args.dim  # the shared head's matmul is counted
    assert extra == 2 * seq * (module - 6 * norms + attention * seq)


def test_hardware_flops_count_the_recomputed_forward():
    args = dataclasses.replace(PRESETS["debug"], n_layers=2)
    elementwise = sum(p.numel() for n, p in Transformer(args).named_parameters() if "norm" in n)
    block_elementwise = elementwise - args.dim  # the final norm is outside the blocks
    measured = _measured_flops_per_token(args, 64, checkpointing="full")
    assert measured == hardware_flops_per_token(args, 64, 1.0) - 6 * elementwise - 2 * block_elementwise


def test_megatron_formula_matches_the_paper_convention():
    """k=4 (recompute) over k=3 is exactly 4/3, and the 1T model at seq 2048 costs about 6*N*tokens*4/3."""
    args = PRESETS["gpt-1t"]
    with_recompute = megatron_flops_per_iteration(args, batch=1, seq_len=2048, recompute=True)
    without = megatron_flops_per_iteration(args, batch=1, seq_len=2048, recompute=False)
    assert with_recompute / without == pytest.approx(4 / 3)
    assert without / 2048 == pytest.approx(model_flops_per_token(args, 2048), rel=0.02)
