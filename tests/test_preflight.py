"""The memory pre-flight refuses a model that cannot fit before anything is allocated or written,
with the figures and the `trillion plan` command; its counts are the model's exact states."""

from trillion.models import get_preset
from trillion.models.flops import count_params
from trillion.parallel.layout import Layout
from trillion.parallel.planner.hardware import profile_names
from trillion.trainer.cli.main import main
from trillion.trainer.preflight import states_per_rank


def test_a_model_too_large_for_the_host_is_refused_with_the_figures(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--model.name=gpt-1t", f"--job.output_dir={out}", "--logging.wandb=false"]) == 2
    err = capsys.readouterr().err
    assert "4037.3 GB of parameters" in err and "8074.6 GB of optimizer states" in err and "host memory" in err
    assert "trillion plan --model gpt-1t --hardware HARDWARE --gpus N --global-batch 8" in err
    assert not out.exists() and "Traceback" not in err
    hardware = err.split("(HARDWARE: ")[1].split(")")[0].split(", ")
    assert "dgx-h800" in hardware and hardware == profile_names()  # every profile `trillion plan` takes


def test_states_are_16_bytes_a_parameter_and_shard_over_dp_shard():
    args = get_preset("debug")
    one = states_per_rank(args, Layout(micro_batch_size=8), "adamw")
    assert one == (4 * count_params(args).total, 4 * count_params(args).total, 8 * count_params(args).total)
    sharded = states_per_rank(args, Layout(dp_shard=4, micro_batch_size=2), "adamw")
    assert abs(sum(sharded) - sum(one) / 4) < 0.01 * sum(one)  # rank 0 holds the ceiling of each chunk


def test_moe_states_count_each_ranks_routed_experts_under_ep():
    """debug-moe on 4 ranks, ep 4, zero1 (which keeps the unsharded gradients): a rank's gradients are its
    E / ep routed experts and the rest whole; without ep they would be all E experts."""
    import torch

    from trillion.models import Transformer
    from trillion.models.moe import RoutedExperts

    args = get_preset("debug-moe")
    with torch.device("meta"):
        model = Transformer(args)
    experts = sum(p.numel() for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters())
    rest = sum(p.numel() for p in model.parameters()) - experts
    states = {
        ep: states_per_rank(args, Layout(dp_shard=4, ep=ep, dp_shard_mode="zero1", micro_batch_size=2), "adamw")
        for ep in (1, 4)
    }
    assert states[4][1] == 4 * (rest + experts // 4) and states[1][1] == 4 * (rest + experts)
    assert states[4][2] == states[1][2]  # the sharded optimizer states do not depend on ep
