"""`trillion train` on mixture-of-experts presets: debug-moe trains on the default corpus (held-out loss
falls at every evaluation; per-layer load statistics in metrics.jsonl and the log; total and active
parameters stated), the balancing bias is model state that checkpoints and resumes, and bad MoE
settings exit 2 with one paragraph naming the setting and the fix."""

import json

import pytest

from tests.helpers.flags import QUIET, TINY_BATCH
from tests.helpers.runs import run
from trillion.models import moe
from trillion.models.moe import MoEStepHooks
from trillion.trainer.cli.main import main
from trillion.trainer.step import train_step
from trillion.trainer.train import RunHooks

# debug-moe narrowed: 3 blocks (the first dense), 64 wide, 8 experts top-2 and a shared expert
SMALL_MOE = [
    "--model.name=debug-moe",
    "--model.n_layers=3",
    "--model.dim=64",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    *TINY_BATCH,
    "--metrics.log_freq=1",
    *QUIET,
]


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_debug_moe_trains_on_the_default_corpus_with_load_statistics(tmp_path, caplog):
    out = tmp_path / "run"
    caplog.set_level("INFO", logger="trillion")
    args = ["--training.steps=24", "--eval.interval=8", "--eval.steps=4", "--lr_schedule.warmup_steps=4"]
    assert main(["train", *SMALL_MOE, *args, f"--job.output_dir={out}"]) == 0
    rows = records(out)
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(evals) == 4 and all(later < earlier for earlier, later in zip(evals, evals[1:])), evals
    trained = [r for r in rows if "loss" in r]
    for r in trained:
        for layer in (1, 2):  # block 0 is dense
            loads = r[f"moe/layer{layer}/tokens_per_expert"]
            assert len(loads) == 8 and sum(loads) == 4 * 32 * 2  # every token reaches its 2 experts
            assert r[f"moe/layer{layer}/max_mean"] == pytest.approx(max(loads) / (sum(loads) / 8))
            assert r[f"moe/layer{layer}/dropped"] == 0.0
        assert "moe/layer0/max_mean" not in r
    assert trained[-1]["moe/layer1/bias_spread"] > 0  # the preset's loss-free bias moved
    assert "active per token" in caplog.text and "experts max/mean" in caplog.text


def test_the_balancing_bias_is_checkpointed_and_resumes(tmp_path):
    from trillion.trainer.checkpoint.export import load_checkpoint_model, resolve_checkpoint

    out = tmp_path / "run"
    assert main(["train", *SMALL_MOE, "--training.steps=3", "--eval.interval=0", f"--job.output_dir={out}"]) == 0
    state = load_checkpoint_model(resolve_checkpoint(out)).state_dict()
    bias = state["layers.1.feed_forward.router.expert_bias"]
    assert bias.abs().sum() > 0 and abs(bias.sum().item()) < 1e-5  # moved, and centred
    assert not any("load_tally" in name for name in state)  # the per-step tally is not state


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--model.top_k=9"], ("model.top_k=9", "8 experts", "--model.top_k=8")),
        (
            ["--model.name=debug", "--moe.aux_loss_coef=0.01"],
            ("moe.aux_loss_coef=0.01 does nothing", "routed experts", "--model.name=debug-moe"),
        ),
        (["--moe.capacity_factor=0.5"], ("moe.capacity_factor", "at least 1", "0 (dropless)")),
        (
            ["--kernels.grouped_gemm=torch", "--model.dim=66", "--model.n_heads=3", "--model.n_kv_heads=3"],
            ("kernels.grouped_gemm=torch cannot run here", "16 bytes", "--kernels.grouped_gemm=auto"),
        ),
    ],
)
def test_bad_moe_settings_exit_2_naming_the_setting(flags, named, tmp_path, capsys):
    argv = ["train", *SMALL_MOE, "--training.steps=1", "--eval.interval=0", *flags, f"--job.output_dir={tmp_path}/r"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(fragment in err for fragment in named), err


# The model parts' step hooks (models/step_hooks.py) are found once, when the run is assembled: the loop
# hands the same hooks to every step, a dense model's loop gets none, and the MoE layers are not looked
# for again step after step.
EVAL_OFF = ["--eval.interval=0", "--checkpoint.save_final=false"]


def hooks_seen(out, *flags, steps: int) -> list[tuple]:
    """The step_hooks the loop passed to each of `steps` steps."""
    seen = []

    def step(*args, **kwargs):
        seen.append(kwargs["step_hooks"])
        return train_step(*args, **kwargs)

    run(out, *flags, *EVAL_OFF, steps=steps, hooks=RunHooks(step=step))
    return seen


def test_a_dense_model_loop_calls_no_hooks(tmp_path):
    assert hooks_seen(tmp_path / "dense", steps=2) == [(), ()]


def test_moe_hooks_are_found_once_and_reused_every_step(tmp_path, monkeypatch):
    lookups = []
    original = moe.moe_layers
    monkeypatch.setattr(moe, "moe_layers", lambda model: lookups.append(1) or original(model))
    hooks_seen(tmp_path / "short", *SMALL_MOE, steps=1)
    found_for_one = len(lookups)
    seen = hooks_seen(tmp_path / "long", *SMALL_MOE, steps=3)
    assert len(lookups) == 2 * found_for_one  # as many lookups for 3 steps as for 1: none per step
    (hooks,) = {id(hooks): hooks for hooks in seen}.values()  # one tuple, every step of the run
    assert len(hooks) == 1 and isinstance(hooks[0], MoEStepHooks) and sorted(hooks[0].layers) == [1, 2]
