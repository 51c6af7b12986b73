"""optimizer.ema_decay (parallel/host_ema.py): the parameters' moving average in host memory. It is the float64
average of the parameters torch's own AdamW steps to, within float32 rounding; under FSDP (2 gloo ranks) each rank
averages its own shard and the checkpoint holds the average of the parameters every step's checkpoint holds, a resume
continues it exactly, and `trillion export --weights ema` loads it in place of the trained weights; bad values are
refused."""

import pytest
import torch

from tests.helpers.runs import read_checkpoint, run
from tests.helpers.spawn import as_launched, run_ranks
from trillion.errors import ConfigError
from trillion.parallel.host_ema import HostEMA
from trillion.trainer.checkpoint.export import load_checkpoint_model
from trillion.trainer.cli.main import main
from trillion.trainer.config.schema import load_config

DECAY = 0.75  # a fast average: four steps move it well away from the initial weights


def _relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.double() - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("staged", [False, True], ids=["folded-now", "staged-fold-thread"])
def test_average_of_torch_adamw_matches_a_float64_reference(staged):
    """Both paths: folded at once (the CPU's), and the accelerators' (staging buffers, folded by a thread of its own
    while the step goes on: run here with a synchronous copy)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = HostEMA(model, DECAY, torch.device("cpu"), staged=staged)
    ema.attach(optimizer)
    reference = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    for _ in range(8):
        model(torch.randn(16, 32)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        for name, param in model.named_parameters():
            reference[name] = DECAY * reference[name] + (1 - DECAY) * param.detach().double()
        assert (ema.folding is not None) == staged  # staged, the training thread left the fold to its thread
    state = ema.state_dict()
    for name, param in model.named_parameters():
        assert _relative(state[name], reference[name]) < 1e-6, name
        assert _relative(param.detach(), reference[name]) > 1e-3, name  # the average is not the parameters


def test_a_failed_fold_is_raised_on_the_training_thread():
    model = torch.nn.Linear(4, 4)
    ema = HostEMA(model, DECAY, torch.device("cpu"), staged=True)
    ema.average = {name: torch.zeros(3) for name in ema.average}  # a shape the staged copy cannot fold into
    ema.update()
    with pytest.raises(RuntimeError, match="optimizer.ema_decay: folding"):
        ema.fold()
    assert ema.folding is None and ema.fold_error is None


FSDP = ["--parallel.dp_shard=2", f"--optimizer.ema_decay={DECAY}"]


def _fsdp_runs(rank, world_size, root):
    as_launched(rank, world_size)
    run(root / "straight", *FSDP, "--checkpoint.interval=1", "--checkpoint.keep_latest=0", steps=4)
    run(root / "chained", *FSDP, "--checkpoint.interval=1", "--training.exit_interval=2", steps=4)
    run(root / "chained", *FSDP, "--checkpoint.interval=1", steps=4)


def test_fsdp_shards_average_resume_continues_it_and_export_takes_it(tmp_path, capsys):
    run(tmp_path / "initial", "--optimizer.lr=0", steps=1)  # lr 0: the checkpoint holds the initial weights
    run_ranks(_fsdp_runs, 2, tmp_path)
    steps = [read_checkpoint(tmp_path / "initial", step=1)] + [
        read_checkpoint(tmp_path / "straight", step=s) for s in range(1, 5)
    ]
    names = [k.removeprefix("model.") for k in steps[0] if k.startswith("model.") and not k.endswith("freqs_cis")]
    final = steps[-1]
    assert {f"ema.{n}" for n in names} <= set(final), "every parameter's average is saved"
    for name in names:
        reference = steps[0][f"model.{name}"].double()
        for state in steps[1:]:
            reference = DECAY * reference + (1 - DECAY) * state[f"model.{name}"].double()
        assert _relative(final[f"ema.{name}"], reference) < 1e-6, name
    resumed = read_checkpoint(tmp_path / "chained", step=4)
    assert all(torch.equal(resumed[k], v) for k, v in final.items() if k.startswith(("ema.", "model.")))
    exported = load_checkpoint_model(tmp_path / "straight" / "checkpoints" / "step-00000004", "ema")
    for name, param in exported.named_parameters():
        assert torch.equal(param.detach(), final[f"ema.{name}"].to(param.dtype)), name
    assert main(["export", "--checkpoint", str(tmp_path / "initial"), "--weights", "ema", str(tmp_path / "hf")]) == 2
    assert "--weights ema: checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["1", "-0.5", "1.5"])
def test_decay_outside_zero_to_one_is_refused(value):
    with pytest.raises(ConfigError, match="optimizer.ema_decay"):
        load_config(None, [f"--optimizer.ema_decay={value}"])


def test_unknown_weights_choice_is_refused(tmp_path, capsys):
    assert main(["export", "--checkpoint", str(tmp_path), "--weights", "best", str(tmp_path / "hf")]) == 2
    assert "--weights 'best' is not known. Use live or ema" in capsys.readouterr().err
