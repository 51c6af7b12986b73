"""`trillion plan` then `trillion estimate` of its written config on today's hardware: DeepSeek-V3, Kimi K2,
Qwen3-235B-A22B and Llama 3 405B on each new profile exit 0 with a layout whose sampled ranks fit (the estimate's
first and last rank, measured on meta tensors). The search takes the fastest path (micro-batches of 1, full
checkpointing fixed); 256 GPUs on 8-GPU nodes, 288 (four racks) on NVL72. Kimi K2 on GB300 NVL72 is the fast
representative: its 288 GPUs are where the planner once proposed an ep whose expert shards FSDP2 cannot split
(parallel/ep_checks.py check_expert_shards); the other 19 run under -m slow."""

import json

import pytest

from trillion.trainer.cli.main import main

MODELS = ("deepseek-v3-671b", "kimi-k2", "qwen3-235b-a22b", "llama3-405b")
PROFILES = {"dgx-b200": 256, "mi325x": 256, "mi355x": 256, "gb200-nvl72": 288, "gb300-nvl72": 288}
FAST = ("kimi-k2", "gb300-nvl72")


def plan_and_estimate(model: str, hardware: str, tmp_path, capsys) -> None:
    gpus, config = PROFILES[hardware], tmp_path / "plan.toml"
    plan = ["plan", "--model", model, "--hardware", hardware, "--gpus", str(gpus), "--global-batch", str(8 * gpus)]
    plan += ["--seq-len", "4096", "--micro-batch-size", "1", "--activation-checkpoint", "full", "--top", "1"]
    assert main([*plan, "--format", "json", "--config-out", str(config)]) == 0
    best = json.loads(capsys.readouterr().out)["candidates"][0]
    assert best["fits"] and best["tokens_per_s"] > 0, best
    estimate = ["estimate", "--config", str(config), "--ranks", "first,last", "--format", "json"]
    assert main(estimate) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert ranks and all(rank["total"] <= rank["usable"] for rank in ranks), ranks


def test_kimi_k2_on_four_gb300_racks_plans_and_dry_runs(tmp_path, capsys):
    plan_and_estimate(*FAST, tmp_path, capsys)


@pytest.mark.slow  # 19 plans and estimates: about 15 minutes on two cores
@pytest.mark.parametrize("hardware", list(PROFILES))
@pytest.mark.parametrize("model", MODELS)
def test_every_model_plans_and_dry_runs_on_every_new_profile(model, hardware, tmp_path, capsys):
    if (model, hardware) == FAST:
        pytest.skip("the fast representative")
    plan_and_estimate(model, hardware, tmp_path, capsys)
