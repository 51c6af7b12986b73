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


@pytest.mark.slow  # about 15-60 s each: four or five ranks of thousands simulated on meta tensors
@pytest.mark.parametrize(
    "model,hardware,gpus,batch,extra",
    [("kimi-k2", "frontier", 4096, 4096, []), ("deepseek-v3-671b", "dgx-h800", 2048, 15360, ["--mtp-modules", "0"])],
)
def test_the_planned_layout_on_thousands_of_fake_ranks_fits_in_under_two_minutes(
    model, hardware, gpus, batch, extra, tmp_path, capsys
):
    """Each model at the layout `trillion plan` picks (experiments/frontier/KIMI_K2.md): every simulated stage fits,
    measured in under two minutes, and the planner's fullest rank is within a quarter of the fullest measured."""
    config = tmp_path / "plan.toml"
    plan = ["plan", "--model", model, "--hardware", hardware, "--gpus", str(gpus), "--global-batch", str(batch)]
    assert main([*plan, "--seq-len", "4096", *extra, "--config-out", str(config), "--format", "json"]) == 0
    capsys.readouterr()
    start = time.perf_counter()
    assert main(["estimate", "--config", str(config), "--world-size", str(gpus), "--hardware", hardware]
                + ["--format", "json"]) == 0  # fmt: skip
    seconds = time.perf_counter() - start
    data = json.loads(capsys.readouterr().out)
    stages = {rank["coords"]["pp"] for rank in data["ranks"]}
    assert {0, 1, data["layout"]["pp"] // 2, data["layout"]["pp"] - 1} <= stages  # first, second, middle, last
    for rank in data["ranks"]:
        assert rank["activations_source"] == "measured"
        assert rank["total"] <= rank["usable"], rank
    fullest = max(data["ranks"], key=lambda rank: rank["total"])
    assert fullest["planner"]["total"] == pytest.approx(fullest["total"], rel=0.25)
    assert seconds < 120


def test_stages_of_one_depth_but_different_moe_layers_are_told_apart():
    """debug-deepseek's first block is dense: with the embedding alone on stage 0, stages 1 and 2 both hold two
    blocks, one MoE block and two. The estimate reuses what it built for a stage of the same shape, so the shape
    counts the MoE blocks (it once gave stage 2 stage 1's experts: deepseek-v3-671b's MoE stages as dense ones)."""
    flags = ["--model.name=debug-deepseek", "--model.mtp_modules=0", "--model.n_layers=6", "--training.seq_len=128"]
    flags += ["--training.global_batch_size=8", "--training.micro_batch_size=1", "--parallel.pp=4"]
    flags += ["--parallel.dp_shard=2", "--parallel.dp_shard_mode=zero1", "--parallel.pp_layers_per_stage=2"]
    flags += ["--parallel.pp_first_stage_layers=0", "--parallel.pp_last_stage_layers=2"]
    result = estimate(load_config(None, flags), 8, ranks="2,4")
    assert result.layout["stage_units"][1:3] == [[1, 3], [3, 5]]
    one, two = (rank.detail["routed_expert_parameters"] for rank in result.ranks)
    assert two == 2 * one > 0
