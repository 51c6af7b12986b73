"""The planner's Muon: the hidden-matrix elements it counts are those the trainer's optimizer gives Muon; its
Newton-Schulz FLOPs are those torch counts; `trillion plan --optimizer muon` costs kimi-k2 with half of AdamW's
state on the hidden matrices and writes a config that trains with Muon."""

import dataclasses
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from trillion.models import PRESETS, Transformer
from trillion.parallel.layout import Layout
from trillion.parallel.muon.matrices import newton_schulz_flops
from trillion.parallel.muon.newton_schulz import orthogonalize
from trillion.parallel.planner.memory import RankParams, pipeline_ranks
from trillion.parallel.planner.optimizer import muon_numel, state_bytes, step_buffer_bytes
from trillion.trainer.cli.main import main
from trillion.trainer.config.schema import Optimizer, load_config
from trillion.trainer.optim import build_optimizer


@pytest.mark.parametrize("name", ["debug-moe", "debug-deepseek"])
def test_hidden_matrix_elements_are_those_muon_steps(name):
    args = dataclasses.replace(PRESETS[name], vocab_size=320)
    model = Transformer(args)
    optimizer = build_optimizer(model, Optimizer(name="muon"), "cpu")
    stepped = sum(p.numel() for group in optimizer.param_groups if group["use_muon"] for p in group["params"])
    (rank,) = pipeline_ranks(args, Layout())
    assert muon_numel(args, rank, 1, 1, 1) == (stepped, stepped)
    assert muon_numel(args, RankParams(args.n_layers, True, True), 1, 4, 1)[1] < stepped / 3  # sharded over dp 4


def test_newton_schulz_flops_are_what_torch_counts():
    for rows, cols in ((64, 96), (96, 64), (32, 32)):
        with FlopCounterMode(display=False) as counter:
            orthogonalize(torch.randn(3, rows, cols), 5, torch.float32)
        assert counter.get_total_flops() == 3 * newton_schulz_flops(rows, cols, 5)


def _plan(tmp_path, *extra: str) -> dict:
    out = tmp_path / f"plan{len(extra)}.json"
    argv = ["plan", "--model", "kimi-k2", "--hardware", "dgx-h200", "--gpus", "2048", "--global-batch", "2048"]
    argv += ["--seq-len", "4096", "--tp", "8", "--pp", "16", "--ep", "16", "--micro-batch-size", "1"]
    argv += ["--activation-checkpoint", "full", "--dp-shard-mode", "zero1", "--pp-schedule", "1F1B", "--top", "1"]
    argv += ["--format", "json", "--config-out", str(tmp_path / f"best{len(extra)}.toml"), *extra]
    return argv, out


def test_plan_costs_muon_beside_adamw_for_kimi_k2(tmp_path, capsys):
    rows = {}
    for extra in ((), ("--optimizer", "muon")):
        argv, _ = _plan(tmp_path, *extra)
        assert main(argv) == 0
        rows[extra[-1] if extra else "adamw"] = json.loads(capsys.readouterr().out)["candidates"][0]
    adamw, muon = rows["adamw"], rows["muon"]
    assert muon["optimizer"] == "muon" and adamw["optimizer"] == "adamw"
    assert (muon["ep"], muon["etp"]) == (adamw["ep"], adamw["etp"]) == (16, 1)  # ep 16 folded over tp 8 (x 2 dp)
    for part in ("parameters", "gradients", "activations", "buffers"):
        assert muon["memory"][part] == adamw["memory"][part], part
    # the states halved, the step's buffers beyond the activations added (at this layout the states are small: the
    # buffers outweigh the halving)
    args = PRESETS["kimi-k2"]
    layout = Layout(tp=8, pp=16, dp_shard=16, ep=16, etp=1, micro_batch_size=1)
    rank = pipeline_ranks(args, layout)[1]
    buffers = step_buffer_bytes(args, layout, "muon", rank, 2) / 1e9 - muon["memory"]["activations"]
    assert muon["memory"]["optimizer"] == pytest.approx(adamw["memory"]["optimizer"] / 2 + buffers, abs=0.002)
    assert (
        muon["time_shares"]["optimizer"] * muon["step_time_s"]
        > adamw["time_shares"]["optimizer"] * adamw["step_time_s"]
    )
    assert load_config(str(tmp_path / "best2.toml")).optimizer.name == "muon"
    args, layout = PRESETS["kimi-k2"], Layout(tp=8, pp=16, dp_shard=16, ep=16)
    rank = pipeline_ranks(args, layout)[1]
    shard = rank.numel(args, 8, 16, 16, layout.expert_tp)[1]
    states = {o: state_bytes(args, layout, o, rank, shard) for o in ("adamw", "muon")}
    assert 0.5 < states["muon"] / states["adamw"] < 0.51  # one state per hidden-matrix element instead of two
