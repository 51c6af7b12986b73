"""`trillion estimate` on DeepSeek's family (multi-head latent attention, the DeepSeek MoE block): the activation
peak is measured on meta tensors through latent attention, whose value heads are narrower than its query/key heads
(aten's flash op takes neither on meta; activations.py keeps flash attention's saved set for it), and the states
are the planner's; at full scale, Kimi K2 at the layout `trillion plan` picks for 4096 Frontier GCDs."""

import json
import time

import pytest

from trillion.trainer.cli.main import main
from trillion.trainer.config.schema import load_config
from trillion.trainer.tools.estimate.dry_run import estimate


def test_debug_deepseek_under_pp_tp_and_ep_is_measured_and_its_states_are_the_planners():
    flags = ["--model.name=debug-deepseek", "--model.mtp_modules=0", "--training.seq_len=128"]
    flags += ["--training.global_batch_size=16", "--training.micro_batch_size=1", "--parallel.pp=2", "--parallel.tp=2"]
    flags += ["--parallel.dp_shard=4", "--parallel.ep=4", "--parallel.dp_shard_mode=zero1"]
    result = estimate(load_config(None, flags), 16)  # the default ranks: first, second, middle, last, max
    assert result.layout["ep"] == 4 and result.layout["tp"] == 2 and not result.notes
    assert [rank.rank for rank in result.ranks][:3] == [0, 8, 15]  # the second stage begins at 16 / pp
    for rank in result.ranks:
        assert rank.activations_source == "measured", rank.rank
    last = result.ranks[-1]  # a stage of MoE blocks only, as the planner's fullest (first) rank is
    for kind in ("gradients", "optimizer"):
        assert getattr(last, kind) == pytest.approx(last.planner[kind], rel=0.01), kind


@pytest.mark.slow  # about 15-60 s: four ranks of 4096 simulated on meta tensors
def test_kimi_k2_at_its_frontier_plan_on_4096_fake_ranks_fits_in_under_two_minutes(tmp_path, capsys):
    config = tmp_path / "kimi-k2-frontier-4096.toml"
    plan = ["plan", "--model", "kimi-k2", "--hardware", "frontier", "--gpus", "4096", "--global-batch", "4096"]
    assert main([*plan, "--seq-len", "4096", "--config-out", str(config), "--format", "json"]) == 0
    capsys.readouterr()
    start = time.perf_counter()
    assert main(["estimate", "--config", str(config), "--world-size", "4096", "--hardware", "frontier"]
                + ["--format", "json"]) == 0  # fmt: skip
    seconds = time.perf_counter() - start
    data = json.loads(capsys.readouterr().out)
    stages = {rank["coords"]["pp"] for rank in data["ranks"]}
    assert {0, 1, data["layout"]["pp"] // 2, data["layout"]["pp"] - 1} <= stages  # first, second, middle, last
    for rank in data["ranks"]:
        assert rank["activations_source"] == "measured"
        assert rank["total"] <= rank["usable"], rank
    assert seconds < 120
