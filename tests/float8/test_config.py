"""The float8 section and its refusals: each one paragraph with exit status 2, before any work (no run
directory written). The GPUs that cannot run float8 are faked by their driver answers (name, compute
capability or gfx architecture)."""

import sys
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.flags import TINY
from trillion.errors import ConfigError
from trillion.parallel import float8
from trillion.parallel.layout import resolve_float8
from trillion.trainer.assemble import check_float8, resolve_layout
from trillion.trainer.cli.main import main
from trillion.trainer.config.schema import Config, help_text, load_config
from trillion.trainer.launch.env import LaunchEnv

FLOAT8 = ["--float8.enabled=true"]


def refusal(capsys, tmp_path, *flags: str) -> str:
    """`trillion train` with `flags`: the one-paragraph message of its exit 2, having written nothing."""
    out = tmp_path / "run"
    assert main(["train", *TINY, f"--job.output_dir={out}", "--job.device=cpu", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert not out.exists(), "a refused run must not start writing its run directory"
    return err


def test_defaults_and_help():
    f = Config().float8
    assert (f.enabled, f.recipe, f.emulate, f.fsdp_all_gather) == (False, "tensorwise", False, "auto")
    text = help_text()
    for setting in ("--float8.enabled", "--float8.recipe", "--float8.emulate", "--float8.fsdp_all_gather"):
        assert setting in text
    assert "rowwise_with_gw_hp" in text and "sm89" in text and "gfx942" in text
    config = load_config(None, [*FLOAT8, "--float8.recipe=rowwise", "--float8.emulate=true"])
    assert (config.float8.recipe, config.float8.emulate) == ("rowwise", True)


def test_unknown_recipe_is_refused(capsys, tmp_path):
    err = refusal(capsys, tmp_path, *FLOAT8, "--float8.recipe=blockwise")
    assert "float8.recipe='blockwise'" in err and "rowwise_with_gw_hp" in err


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_fsdp_float8_all_gather_needs_tensorwise(recipe, capsys, tmp_path):
    err = refusal(capsys, tmp_path, *FLOAT8, "--float8.emulate=true", f"--float8.recipe={recipe}",
                  "--float8.fsdp_all_gather=on")  # fmt: skip
    assert f"float8.fsdp_all_gather=on with float8.recipe={recipe}" in err
    assert "tensorwise" in err and "--float8.fsdp_all_gather=auto" in err
    # what auto resolves to: float8 all-gather where torchao has it, and only under FSDP
    assert resolve_float8(recipe, fsdp_enabled=True, fsdp_all_gather="auto").fsdp_all_gather is False
    assert resolve_float8("tensorwise", fsdp_enabled=True, fsdp_all_gather="auto").fsdp_all_gather is True
    assert resolve_float8("tensorwise", fsdp_enabled=False, fsdp_all_gather="on").fsdp_all_gather is False
    assert resolve_float8("tensorwise", fsdp_enabled=True, fsdp_all_gather="off").fsdp_all_gather is False


def test_cpu_without_emulation_is_refused(capsys, tmp_path):
    err = refusal(capsys, tmp_path, *FLOAT8)
    assert "float8.enabled=true on cpu" in err and "--float8.emulate=true" in err and "not faster" in err


def fake_gpu(monkeypatch, name: str, *, capability=(9, 0), arch: str | None = None):
    """The driver answers of a GPU: NVIDIA by compute capability, AMD (ROCm) by gfx architecture."""
    monkeypatch.setattr(torch.version, "hip", "6.3" if arch else None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(name=name, gcnArchName=arch)
    )


REFUSED = {
    "a100": ("NVIDIA A100-SXM4-80GB", {"capability": (8, 0)}, ["A100", "sm80", "a100 in trillion/devices.toml"]),
    "mi250x": ("AMD Instinct MI250X", {"arch": "gfx90a:sramecc+:xnack-"}, ["MI250X", "gfx90a"]),
}
ACCEPTED = {
    "h100": ("NVIDIA H100 80GB HBM3", {"capability": (9, 0)}),
    "h200": ("NVIDIA H200", {"capability": (9, 0)}),
    "l40s": ("NVIDIA L40S", {"capability": (8, 9)}),
    "mi300x": ("AMD Instinct MI300X", {"arch": "gfx942:sramecc+:xnack-"}),
}


@pytest.mark.parametrize("device", list(REFUSED))
def test_gpus_without_float8_units_are_refused(device, monkeypatch, capsys, tmp_path):
    name, answers, fragments = REFUSED[device]
    fake_gpu(monkeypatch, name, **answers)
    config = load_config(None, [*TINY, *FLOAT8, f"--job.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError) as refused:
        check_float8(resolve_layout(config, 1), torch.device("cuda", 0))  # set_up's check once the layout is resolved
    message = str(refused.value)
    assert "\n" not in message and "float8.enabled=true" in message and "--float8.emulate=true" in message
    for fragment in fragments:
        assert fragment in message, message
    # and through the CLI: exit 2 before the run directory exists (the launch env faked onto that GPU)
    monkeypatch.setattr(
        "trillion.trainer.set_up.init_launch_env", lambda *a, **k: LaunchEnv(0, 1, 0, torch.device("cuda", 0))
    )
    assert name in refusal(capsys, tmp_path, *FLOAT8)


@pytest.mark.parametrize("device", list(ACCEPTED))
def test_gpus_with_float8_units_pass_the_gate(device, monkeypatch):
    name, answers = ACCEPTED[device]
    fake_gpu(monkeypatch, name, **answers)
    float8.check_device(torch.device("cuda", 0), emulate=False)


def test_emulation_runs_anywhere(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", capability=(8, 0))
    float8.check_device(torch.device("cuda", 0), emulate=True)
    float8.check_device(torch.device("cpu"), emulate=True)


def test_missing_torchao_names_the_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import torchao.float8 -> ImportError
    err = refusal(capsys, tmp_path, *FLOAT8, "--float8.emulate=true")
    assert "pip install torchao" in err and "float8.enabled" in err
