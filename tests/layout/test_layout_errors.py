"""Every invalid layout is refused up front with a ConfigError that names the setting and a fix."""

import dataclasses
import logging

import pytest
import torch

from trillion.errors import ConfigError
from trillion.models import PRESETS
from trillion.parallel.activation_checkpoint import apply_activation_checkpointing
from trillion.parallel.dims import ParallelDims, check_layout
from trillion.parallel.layout import layout_on
from trillion.parallel.modes import recompute_fraction, zero_mode
from trillion.trainer.assemble import build_parallel_dims, resolve_layout, validate_training
from trillion.trainer.config.schema import Config
from trillion.trainer.launch.env import LaunchEnv

LLAMA, GPT = PRESETS["debug"], PRESETS["debug-gpt"]  # 8 heads, 4 KV heads (Llama), ffn 704 / 1024, vocab 320


def _args(base=LLAMA, **overrides):
    return dataclasses.replace(base, **overrides)


# (degrees, world size, model, seq_len, words the message must contain)
CASES = [
    ({"tp": 3}, 3, LLAMA, 256, ["parallel.tp=3", "model.n_heads=8", "--parallel.tp=2"]),
    ({"tp": 8}, 8, LLAMA, 256, ["parallel.tp=8", "model.n_kv_heads=4", "--parallel.tp=4"]),
    ({"tp": 4}, 4, _args(ffn_dim=702), 256, ["parallel.tp=4", "model.ffn_dim=702", "--parallel.tp=2"]),
    ({"tp": 4}, 4, _args(vocab_size=322), 256, ["parallel.tp=4", "model.vocab_size=322", "pad"]),
    ({"tp": 4}, 4, LLAMA, 250, ["parallel.tp=4", "training.seq_len=250", "sequence parallelism", "--parallel.tp=2"]),
    ({"tp": 16}, 16, _args(GPT, n_heads=16, max_seq_len=1000), 256, ["max_seq_len=1000", "--parallel.tp=8"]),
    ({"tp": 2}, 2, _args(tie_embeddings=True), 256, ["tie", "--parallel.tp=1"]),
    ({"tp": 2}, 2, _args(norm_impl="triton"), 256, ["kernels.norm='triton'", "--kernels.norm=torch"]),
    ({"dp_shard": 2, "tp": 2}, 8, LLAMA, 256, ["= 4", "world size is 8", "--parallel.dp_shard=-1"]),
    ({"dp_replicate": 2, "dp_shard": 3}, 4, LLAMA, 256, ["= 6", "world size is 4"]),
    ({"tp": 3}, 8, LLAMA, 256, ["does not divide the world size 8", "dp_shard=-1", "--parallel.tp=2"]),
    ({"tp": 0}, 1, LLAMA, 256, ["parallel.tp=0", "positive"]),
    ({"dp_shard": -2}, 1, LLAMA, 256, ["parallel.dp_shard=-2", "-1 to infer"]),
    (
        {"pp": LLAMA.n_layers + 3},
        LLAMA.n_layers + 3,
        LLAMA,
        256,
        [f"parallel.pp={LLAMA.n_layers + 3}", f"--parallel.pp={LLAMA.n_layers + 2}"],
    ),
    ({"cp": 3}, 3, LLAMA, 256, ["training.seq_len=256", "2 x parallel.cp=3", "--training.seq_len=252"]),
    ({"cp": 2, "tp": 4}, 8, LLAMA, 260, ["130 tokens per rank", "parallel.tp=4", "--training.seq_len=256"]),
]


@pytest.mark.parametrize("degrees, world, args, seq_len, words", CASES, ids=[str(i) for i in range(len(CASES))])
def test_invalid_layout_is_refused_with_the_setting_and_a_fix(degrees, world, args, seq_len, words):
    with pytest.raises(ConfigError) as error:
        check_layout(layout_on(**degrees, world_size=world), args, seq_len)
    for word in words:
        assert word in str(error.value), f"{word!r} not in: {error.value}"


def test_dp_shard_is_inferred_from_the_world():
    dims = ParallelDims.of(dp_replicate=2, tp=2, world_size=16)
    assert (dims.dp_shard, dims.dp_size) == (4, 8)
    check_layout(dims.layout, LLAMA, 256)  # valid: 8 heads, 4 KV heads, ffn 704, vocab 320 all divide by 2


def test_tp_beyond_a_node_is_warned_not_refused(caplog):
    args = _args(n_heads=16, n_kv_heads=16)  # head size 16; ffn 704, vocab 320 and seq 256 divide by 16
    with caplog.at_level(logging.WARNING, logger="trillion"):
        check_layout(layout_on(tp=16, world_size=16), args, 256, gpus_per_node=8)
    assert "parallel.tp=16 is larger than the 8 devices of a node" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trillion"):
        check_layout(layout_on(tp=8, world_size=8), _args(n_kv_heads=8), 256, gpus_per_node=8)
    assert caplog.text == ""


def _config(**parallel) -> Config:
    config = Config()
    for key, value in parallel.items():
        section, field = key.split("__")
        setattr(getattr(config, section), field, value)
    return config


@pytest.mark.parametrize(
    "settings, world, words",
    [
        (
            {"parallel__dp_shard": 4, "training__global_batch_size": 6, "training__micro_batch_size": 1},
            4,
            ["training.global_batch_size=6", "4 data-parallel ranks", "--training.global_batch_size=4"],
        ),
        (
            {"parallel__dp_shard": 2, "training__global_batch_size": 12, "training__micro_batch_size": 4},
            2,
            ["training.micro_batch_size=4", "--training.micro_batch_size=3"],
        ),
    ],
)
def test_batch_that_does_not_split_over_data_parallel_ranks(settings, world, words):
    env = LaunchEnv(rank=0, world_size=world, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError) as error:
        config = _config(**settings)
        build_parallel_dims(resolve_layout(config, world), LLAMA, config.training.seq_len, env)
    for word in words:
        assert word in str(error.value), f"{word!r} not in: {error.value}"


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"parallel__dp_shard_mode": "zero4"}, ["parallel.dp_shard_mode='zero4'", "zero1", "zero3"]),
        ({"training__dtype": "fp16"}, ["training.dtype=fp16", "--training.dtype=bf16"]),
    ],
)
def test_settings_refused_with_several_ranks(settings, words):
    env = LaunchEnv(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError) as error:
        validate_training(_config(**settings), env)
    for word in words:
        assert word in str(error.value), f"{word!r} not in: {error.value}"


def test_activation_checkpoint_modes():
    with pytest.raises(ConfigError, match="selective:op"):
        recompute_fraction("some", 4)
    with pytest.raises(ConfigError, match="zero1, zero2 or zero3"):
        zero_mode("zero0")
    assert recompute_fraction("selective", 4) == 0.5
    assert recompute_fraction("selective:3", 6) == pytest.approx(2 / 6)
    assert recompute_fraction("selective:op", 4) == 0.0
    assert recompute_fraction("full", 4) == 1.0


@pytest.mark.parametrize("mode", ["full", "selective:op"])
def test_checkpointed_blocks_give_identical_gradients_in_one_process(mode):
    from trillion.models import Transformer

    args = _args(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=32)
    tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpointing in ("none", mode):
        model = Transformer(args)
        model.init_weights(5)
        apply_activation_checkpointing(model, checkpointing)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, checkpointed in zip(*grads):
        assert torch.equal(plain, checkpointed)
