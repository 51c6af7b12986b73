"""The routed experts in float8 (float8.experts, parallel/float8_experts.py) as the trainer applies them: the log
counts the float8 expert GEMMs and keeps the routers in high precision, `off` keeps the experts, a short
debug-deepseek run emulated in float8 keeps the plain run's loss (the fast representative of the low-precision guide's
50-step figure, tests/float8/test_long_run.py), and the bad inputs exit 2 with one paragraph before any work:
float8 dispatch without float8 experts or without expert parallelism, a float8 expert recipe on a GPU
without float8 units or where neither of its backends runs. Blockwise dims that are not multiples of 128 are
not refused: the last scale block of a row is short (the log says so)."""

import dataclasses
import json
import logging

import pytest
import torch
from torch import nn

from tests.float8.test_config import FLOAT8, fake_gpu, refusal
from tests.helpers.flags import QUIET
from trillion.errors import ConfigError
from trillion.kernels import float8_grouped_gemm
from trillion.models import Transformer, get_preset
from trillion.models.moe import routed_expert_stacks
from trillion.parallel.float8 import convert
from trillion.parallel.float8_experts import check_experts
from trillion.parallel.layout import resolve_float8
from trillion.trainer.cli.main import main
from trillion.trainer.launch.env import LaunchEnv

EMULATED = [*FLOAT8, "--float8.emulate=true"]
DEEPSEEK = get_preset("debug-deepseek")  # 4 blocks, the first dense, and an MTP block: 4 MoE layers


def converted(args, experts: str = "auto"):
    with torch.device("meta"):
        model = Transformer(args)
    convert(model, resolve_float8("tensorwise", fsdp_enabled=False, emulate=True, experts=experts))
    return model


def test_the_log_counts_the_float8_expert_gemms_and_the_routers_stay(caplog):
    with caplog.at_level(logging.INFO, logger="trillion"):
        model = converted(DEEPSEEK)
    stacks = routed_expert_stacks(model)
    assert len(stacks) == 4 and all(s.float8 == float8_grouped_gemm.Float8GroupedMM("auto", True) for s in stacks)
    assert "12 grouped GEMMs in float8 (w1, w3, w2 of 4 MoE layers" in caplog.text
    assert all(type(layer.feed_forward.router.gate) is nn.Linear for layer in list(model.layers.values())[1:])
    assert "router.gate (a router)" in caplog.text and "not a multiple of 128" not in caplog.text


def test_off_keeps_the_experts_and_short_blocks_are_said(caplog):
    assert all(s.float8 is None for s in routed_expert_stacks(converted(DEEPSEEK, "off")))
    narrow = dataclasses.replace(DEEPSEEK, moe=dataclasses.replace(DEEPSEEK.moe, expert_ffn_dim=200))
    with caplog.at_level(logging.INFO, logger="trillion"):
        converted(narrow, "blockwise")
    assert "expert width 200 not a multiple of 128, the last block of each row is short" in caplog.text


def test_a_short_debug_deepseek_run_in_emulated_float8_keeps_the_plain_loss(tmp_path):
    """10 steps of debug-deepseek narrowed to 2 blocks (one dense, one MoE, and its MTP block) 128 wide, on the
    default corpus, emulated float8 (experts and linears) and plain fp32 from the same seed and data: the last 4
    steps' mean loss within 2% (measured 0.1%)."""
    flags = [
        "--model.name=debug-deepseek", "--model.n_layers=2", "--model.dim=128", "--training.seq_len=32",
        "--training.global_batch_size=4", "--training.micro_batch_size=4", "--training.steps=10",
        "--eval.interval=0", "--checkpoint.interval=0", "--metrics.log_freq=1", "--lr_schedule.warmup_steps=2",
        *QUIET,
    ]  # fmt: skip
    losses = {}
    for name, extra in (("plain", []), ("float8", EMULATED)):
        out = tmp_path / name
        assert main(["train", *flags, *extra, f"--job.output_dir={out}"]) == 0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in rows if "loss" in r]
    assert losses["plain"][-1] < losses["plain"][0] - 1.0  # it learns
    tail = {name: sum(values[-4:]) / 4 for name, values in losses.items()}
    assert abs(tail["float8"] - tail["plain"]) / tail["plain"] < 0.02, losses
    assert losses["float8"] != losses["plain"]  # float8 ran


def test_a_compiled_moe_layer_with_float8_experts_gives_the_eager_one():
    """torch.compile (aot_eager) around an MoE layer whose experts run the emulated float8 product: the same output
    and gradients as eager (the loop backend: torch._grouped_mm's fake kernel takes bf16 only)."""
    from trillion.models.moe import MoE

    spec = dataclasses.replace(DEEPSEEK.moe, experts_impl="loop", n_groups=1, topk_groups=1)
    torch.manual_seed(0)
    layer = MoE(64, spec)
    for weight in layer.experts.parameters():
        torch.nn.init.normal_(weight, std=0.1)
    layer.experts.float8 = float8_grouped_gemm.Float8GroupedMM("blockwise", emulate=True, impl="loop")
    x = torch.randn(2, 16, 64)
    results = []
    for run in (layer, torch.compile(layer, backend="aot_eager")):
        inputs = x.clone().requires_grad_()
        out = run(inputs)
        out.square().sum().backward()
        results.append((out.detach(), inputs.grad, layer.experts.w1.grad.clone()))
        layer.zero_grad()
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


def test_float8_dispatch_needs_float8_experts_and_expert_parallelism(capsys, tmp_path):
    err = refusal(capsys, tmp_path, *EMULATED, "--float8.experts=off", "--float8.dispatch=true")
    assert "float8.dispatch=true with float8.experts=off" in err and "--float8.experts=auto" in err
    err = refusal(capsys, tmp_path, "--float8.dispatch=true")
    assert "float8.dispatch=true does nothing in this run" in err and "float8.enabled=false" in err
    err = refusal(capsys, tmp_path, *EMULATED, "--float8.dispatch=true")
    assert "float8.dispatch=true with parallel.ep=1" in err and "--parallel.ep=2" in err


def test_a_float8_expert_recipe_on_a_gpu_without_float8_is_refused(monkeypatch, capsys, tmp_path):
    fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", capability=(8, 0))
    gpu = LaunchEnv(0, 1, 0, torch.device("cuda", 0))
    monkeypatch.setattr("trillion.trainer.set_up.init_launch_env", lambda *a, **k: gpu)
    err = refusal(capsys, tmp_path, *FLOAT8, "--float8.experts=blockwise", "--model.name=debug-moe")
    assert "sm80" in err and "routed experts' float8 grouped GEMMs" in err and "--float8.emulate=true" in err


def test_a_recipe_neither_of_whose_backends_runs_is_refused(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", capability=(9, 0))
    monkeypatch.setattr(float8_grouped_gemm, "torchao_unavailable", lambda device: "torchao is too old")
    monkeypatch.setattr(float8_grouped_gemm, "triton_unavailable", lambda device: "the triton package is not installed")
    with pytest.raises(ConfigError) as refused:
        check_experts("rowwise", torch.device("cuda", 0), emulate=False)
    message = str(refused.value)
    assert "float8.experts=rowwise cannot run here: torchao is too old; the triton package" in message
    assert "--float8.experts=off" in message and "\n" not in message
    check_experts("rowwise", torch.device("cuda", 0), emulate=True)  # emulation runs anywhere
