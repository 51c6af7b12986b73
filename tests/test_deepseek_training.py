"""`trillion train --model.name=debug-deepseek` (latent attention + DeepSeek's MoE block) on the default corpus:
the held-out loss falls at every evaluation and the expert loads are logged; `trillion export` of the run loads
in transformers as DeepseekV3ForCausalLM with the same logits and imports back exactly."""

import json

import pytest
import torch

from tests.helpers.flags import QUIET, TINY_BATCH
from trillion.trainer.cli.main import main

# debug-deepseek narrowed: 3 blocks (the first dense), 64 wide, 4 heads; its latent shapes and routing as preset
SMALL_DEEPSEEK = [
    "--model.name=debug-deepseek",
    "--model.n_layers=3",
    "--model.dim=64",
    "--model.n_heads=4",
    *TINY_BATCH,
    "--metrics.log_freq=1",
    *QUIET,
]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_debug_deepseek_trains_logs_expert_loads_and_exports(tmp_path):
    transformers = pytest.importorskip("transformers")
    from trillion.trainer.checkpoint.export import load_checkpoint_model, resolve_checkpoint
    from trillion.trainer.checkpoint.state import ModelParts, load_model_weights

    out, hf = tmp_path / "run", tmp_path / "hf"
    args = ["--training.steps=24", "--eval.interval=8", "--eval.steps=4", "--lr_schedule.warmup_steps=4"]
    assert main(["train", *SMALL_DEEPSEEK, *args, f"--job.output_dir={out}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(evals) == 4 and all(later < earlier for earlier, later in zip(evals, evals[1:])), evals
    for r in (r for r in rows if "loss" in r):
        for layer in (1, 2):  # block 0 is dense
            loads = r[f"moe/layer{layer}/tokens_per_expert"]
            assert len(loads) == 8 and sum(loads) == 4 * 32 * 2  # every token reaches its 2 experts
        assert "moe/layer0/max_mean" not in r

    assert main(["export", "--checkpoint", str(out), "--format", "hf", str(hf)]) == 0
    ours = load_checkpoint_model(resolve_checkpoint(out)).eval()
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert not any(info.values()), info
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs.eval()(tokens).logits, atol=2e-5, rtol=1e-4)

    # --checkpoint.initial_load of the folder (load_model_weights is its path) gives exactly the trained weights
    fresh = load_checkpoint_model(resolve_checkpoint(out))
    with torch.no_grad():
        for tensor in fresh.state_dict(keep_vars=True).values():
            tensor.zero_()
    load_model_weights(hf, [fresh], fresh.args, "--checkpoint.initial_load")
    expected = ModelParts([ours]).state_dict()
    not_exported = []
    for name, tensor in ModelParts([fresh]).state_dict().items():
        if name.startswith("mtp."):  # multi-token prediction is training-only: export leaves it out
            not_exported.append(name)
            continue
        assert torch.equal(tensor, expected[name]), name  # the balancing bias too (e_score_correction_bias)
    assert not_exported, "debug-deepseek trains an MTP module"


def test_a_key_value_head_count_is_refused_for_latent_attention(tmp_path, capsys):
    argv = ["train", *SMALL_DEEPSEEK, "--model.n_kv_heads=2", "--training.steps=1", f"--job.output_dir={tmp_path}/r"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "model.n_kv_heads=2 does not apply" in err and "Drop" in err, err


def test_a_top_k_beyond_the_routing_groups_is_refused_naming_top_k(tmp_path, capsys):
    """debug-deepseek: 8 experts in 4 groups, each token choosing among 2 groups, so top_k 4 at most."""
    argv = ["train", *SMALL_DEEPSEEK, "--model.top_k=5", "--training.steps=1", f"--job.output_dir={tmp_path}/r"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("trillion train: model.top_k=5:") and "model.n_experts=" not in err, err
    assert "(2 x 2 experts at most)" in err and "model.top_k at most 2 groups' experts" in err, err
