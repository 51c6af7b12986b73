"""A setting that does nothing in the run's configuration is refused, by one table (trainer/config/effects.py):
every field of every section is either a rule of that table or declared to act always, so a new setting forces
the decision; each rule's settings, given a value of their own where the condition fails, are refused in one
paragraph naming them, the condition and the fix, and the fix makes the same values load; defaults never are."""

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from tests.helpers.fault_record import report
from tests.helpers.flags import TINY
from trillion.errors import ConfigError
from trillion.trainer.cli.main import main
from trillion.trainer.config.checks import ExistingPath, Flag, OneOf, Range, Text
from trillion.trainer.config.effects import ALWAYS_ACTS, RULES
from trillion.trainer.config.schema import Config, load_config

SECTIONS = {section.name: section.default_factory for section in dataclasses.fields(Config)}
FIELDS = {f"{name}.{f.name}": f for name, section in SECTIONS.items() for f in dataclasses.fields(section)}
RULED = [key for rule in RULES for key in rule.settings]

# Flags under which a rule's condition fails where the defaults satisfy it.
CONDITION_FAILS = {
    "lr_schedule.min_lr_ratio": ["--lr_schedule.name=constant"],
    "eval.held_out": [f"--eval.path={__file__}"],
    **{f"eval.{name}": ["--eval.interval=0"] for name in ("steps", "batch_size", "document_mask")},
    **{
        f"logging.wandb_{name}": ["--logging.wandb=false"]
        for name in ("project", "entity", "run_name", "group", "tags", "init_timeout_s")
    },
}
# Where a rule's fix names a placeholder (FILE, DATASET) or needs more than it says: the flags that carry it out.
FIX_FLAGS = {
    "data.split": [f"--data.path={__file__}"],
    "data.config_name": ["--data.name=some/dataset"],
    "data.text_field": [f"--data.path={__file__}"],
    "data.streaming": [f"--data.path={__file__}"],
    "eval.split": [f"--eval.path={__file__}"],
    "eval.held_out": [],
    "parallel.ep_dispatch": ["--parallel.ep=2", "--model.name=debug-moe"],
    "parallel.ep_overlap": ["--parallel.ep=2", "--model.name=debug-moe"],
    "tokenizer.eos_token": ["--tokenizer.kind=hf", f"--tokenizer.path={__file__}"],
}


def test_every_setting_is_ruled_or_declared_to_act_always():
    assert len(RULED) == len(set(RULED)), "a setting in two rules"
    both = set(RULED) & set(ALWAYS_ACTS)
    undecided = set(FIELDS) - set(RULED) - set(ALWAYS_ACTS)
    stale = (set(RULED) | set(ALWAYS_ACTS)) - set(FIELDS)
    assert not both and not undecided and not stale, (both, undecided, stale)


def changed_value(key: str) -> str:
    """A value of `key`'s own check other than its default, as command-line text."""
    section, _, name = key.partition(".")
    field, kind = FIELDS[key], typing.get_type_hints(SECTIONS[section])[name]
    check, default = field.metadata["check"], field.default
    if isinstance(check, Flag):
        return str(not default).lower()
    if isinstance(check, OneOf):
        return next(c for c in check.choices() if c != default and not c.endswith(":N"))
    if isinstance(check, ExistingPath):
        return __file__
    if isinstance(check, Text):
        return "x"
    assert isinstance(check, Range), key
    candidates = [default + 1, default * 2, 0.5, 1, 2, 3, check.low, check.high]
    return str(next(kind(v) for v in candidates if v is not None and kind(v) != default and not check.problem(kind(v))))


def fix_flags(key: str, rule) -> list[str]:
    """The flags that make the rule's condition hold: its fix's own, or FIX_FLAGS where that names a placeholder."""
    if key in FIX_FLAGS:
        return FIX_FLAGS[key]
    flags = re.findall(r"--[\w.]+=[^\s,)]+", rule.fix)
    assert flags and not any(p in f for f in flags for p in ("FILE", "DIR", "DATASET")), (key, rule.fix)
    return flags


@pytest.mark.parametrize("key", RULED)
def test_a_setting_that_does_nothing_is_refused_naming_it_and_the_fix(key):
    rule = next(rule for rule in RULES if key in rule.settings)
    flag = f"--{key}={changed_value(key)}"
    with pytest.raises(ConfigError) as refused:
        load_config(None, [*CONDITION_FAILS.get(key, []), flag])
    message = str(refused.value)
    assert message.startswith(f"{key}=") and " nothing in this run: " in message and rule.condition in message
    assert all(f"{read}=" in message for read in rule.reads) and "or drop it." in message
    if key == "data.shuffle":  # the fix, --data.prepared=DIR, needs a token store: tests/prepared trains from one
        return
    load_config(None, [*fix_flags(key, rule), flag])  # where the condition holds, the same value loads


def test_defaults_and_a_default_given_explicitly_are_never_refused():
    load_config(None, [])
    explicit = [f"--{key}={str(FIELDS[key].default).lower()}" for key in RULED if isinstance(FIELDS[key].default, bool)]
    load_config(None, explicit)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--float8.emulate=true"], "float8.emulate=true does nothing in this run"),
        (
            ["--float8.enabled=true", "--float8.emulate=true", "--float8.experts=blockwise"],
            "float8.experts='blockwise' does nothing in this run",
        ),
        (
            ["--model.top_k=2", "--moe.rank_capacity_factor=2"],
            "model.top_k=2 and moe.rank_capacity_factor=2.0 do nothing in this run",
        ),
    ],
)
def test_trillion_train_refuses_them_with_exit_2_and_one_paragraph(flags, named, tmp_path, capsys):
    assert main(["train", *TINY, f"--job.output_dir={tmp_path / 'run'}", *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not Path(tmp_path / "run").exists()
    if flags == ["--float8.emulate=true"]:
        report(
            "a setting that does nothing in the run",
            err.strip() + " (exit 2)",
            None,
            None,
            None,
            "--float8.emulate=true without float8.enabled (before: trained in full precision with no word); every "
            "setting of the table in trainer/config/effects.py alike",
        )


def test_the_conditions_follow_the_model_as_its_parts_resolve_it():
    """Multi-token prediction trains where the part resolves model.mtp_modules to one or more modules: a preset's own
    (-1 keeps it) takes a loss weight, the same preset with its modules turned off refuses it; routed experts come
    from the preset alone."""
    load_config(None, ["--model.name=debug-deepseek", "--model.mtp_loss_weight=0.5"])
    with pytest.raises(ConfigError, match=r"model.mtp_loss_weight=0.5 does nothing .* model.mtp_modules=0"):
        load_config(None, ["--model.name=debug-deepseek", "--model.mtp_modules=0", "--model.mtp_loss_weight=0.5"])
    load_config(None, ["--model.name=debug-deepseek", "--moe.aux_loss_coef=0.01"])
    with pytest.raises(ConfigError, match=r"moe.aux_loss_coef=0.01 does nothing .* model.name='llama3-8b'"):
        load_config(None, ["--model.name=llama3-8b", "--moe.aux_loss_coef=0.01"])
