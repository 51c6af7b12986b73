"""The master weights stay in high precision, so checkpoints cross between float8 and plain runs both ways,
bit for bit (FSDP with float8 all-gather, whose weights are torchao's tensor subclass, saving ordinary
tensors), and `trillion export` of a float8 run writes ordinary weights that transformers loads. The float8
run is `trillion train` as a user starts it: its log names the conversion and the emulation, and importing
torchao leaves no warnings on stderr."""

import subprocess

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.flags import TINY
from tests.helpers.launch import TRILLION, clean_env
from tests.helpers.runs import losses, read_checkpoint, run
from tests.helpers.spawn import as_launched, run_ranks
from trillion.trainer.checkpoint.export import load_checkpoint_model
from trillion.trainer.cli.main import main

FLOAT8 = ["--float8.enabled=true", "--float8.emulate=true", "--job.device=cpu"]
KEEP = ["--checkpoint.keep_latest=0", "--eval.interval=0", "--job.device=cpu"]  # every checkpoint, no evaluation
FSDP_FLOAT8 = [*FLOAT8, *KEEP, "--parallel.dp_shard=2"]
FROZEN = ["--optimizer.lr=0"]  # a step that leaves the weights as loaded: the next checkpoint must equal them


def model_weights(out, step: int) -> dict:
    return {k: v for k, v in read_checkpoint(out, step).items() if k.startswith("model.")}


def _float8_fsdp_resumes(rank, world_size, out):
    as_launched(rank, world_size)
    run(out, *FSDP_FLOAT8, *FROZEN, steps=3)  # loads the plain step 2 into float8-gathered weights, saves step 3


def test_checkpoints_cross_between_plain_and_float8_fsdp_runs(tmp_path):
    out = tmp_path / "run"
    run(out, *KEEP, steps=2)  # plain fp32, one process
    run_ranks(_float8_fsdp_resumes, 2, out)
    run(out, *KEEP, *FROZEN, steps=4)  # plain again, one process, from the float8 run's step 3
    assert [step for step, _ in losses(out)] == [1, 2, 3, 4]
    weights = [model_weights(out, step) for step in (2, 3, 4)]
    assert weights[0].keys() == weights[1].keys() == weights[2].keys()
    for name, value in weights[0].items():  # float32 master weights, loaded and saved bit for bit both ways
        assert value.dtype == torch.float32, name
        assert torch.equal(weights[1][name], value) and torch.equal(weights[2][name], value), name


@pytest.fixture(scope="module")
def float8_run(tmp_path_factory):
    """`trillion train` with emulated float8 for 2 steps (one process, the filter keeping a 100-wide MLP)."""
    out = tmp_path_factory.mktemp("float8") / "run"
    result = subprocess.run(
        [*TRILLION, "train", *TINY, *FLOAT8, "--model.ffn_dim=100", "--training.steps=2", "--eval.interval=0",
         f"--job.output_dir={out}"],
        capture_output=True, text=True, timeout=600, env=clean_env(OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return out, result.stderr


def test_the_log_says_what_float8_does_and_torchao_is_quiet(float8_run):
    _, stderr = float8_run
    assert "float8 (tensorwise recipe, emulated" in stderr and "not faster" in stderr
    assert "4 linears converted: layers.*.attention.wq" in stderr
    assert "layers.0.feed_forward.w1 (100 x 64: not multiples of 16)" in stderr
    assert "output (the output projection)" in stderr
    for noise in ("Failed to load", "KernelPreference", "Warning", "warn("):
        assert noise not in stderr, stderr


def test_export_of_a_float8_run_loads_in_transformers(float8_run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    source, _ = float8_run
    hf = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(source), "--format", "hf", str(hf)]) == 0
    exported = load_file(str(hf / "model.safetensors"))
    assert {t.dtype for t in exported.values()} == {torch.float32}  # the master weights: no float8 anywhere

    ours = load_checkpoint_model(source / "checkpoints" / "step-00000002").eval()
    tokens = torch.randint(0, ours.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(tokens)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
        torch.testing.assert_close(theirs(tokens).logits, expected, atol=2e-5, rtol=1e-4)
        bf16 = transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.bfloat16).eval()
        assert next(bf16.parameters()).dtype == torch.bfloat16
        torch.testing.assert_close(bf16(tokens).logits.float(), expected, atol=0.05, rtol=0.05)
