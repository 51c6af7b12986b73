"""Which settings act only in some configurations, declared once: a setting given a value other than its default
where it does nothing (float8.emulate without float8.enabled, a Muon setting under AdamW, moe.* on a dense model)
is refused with one paragraph naming it, what it needs and the flag that gives it, instead of being ignored.

`RULES` lists each such setting with the condition it needs; `ALWAYS_ACTS` names every other setting, with why it
acts whatever the rest says (or why the config alone cannot tell). tests/test_config_effects.py walks every field of
every section and fails for one in neither, so a new setting forces the decision. A default is never refused, and
`without_idle` lets code that derives a config from another leave such settings out. Each condition reads the
setting's own users: the code that reads it does so only where the condition holds.
"""

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from trillion.errors import ConfigError
from trillion.parallel.modes import pairs_across_stages


def _has_experts(config) -> bool:
    """Whether the model has routed experts: only its preset gives them (the MoE part refuses counts on a dense one)."""
    from trillion.models.presets import expert_presets

    return config.model.name in expert_presets()


def _trains_ahead(config) -> bool:
    """Whether multi-token prediction modules train, as the part resolves model.mtp_modules against the preset."""
    from trillion.models.parts import mtp
    from trillion.models.presets import get_preset

    given = mtp.MTPSettings(modules=config.model.mtp_modules)
    return mtp.apply_settings(get_preset(config.model.name), given, config.model.name).mtp_modules > 0


@dataclass(frozen=True)
class Needs:
    """`settings` act only when `holds(config)`: `condition` says when in words, `reads` names the settings it
    looks at (their values go into the message), `fix` is what to give instead."""

    settings: tuple[str, ...]
    condition: str
    holds: Callable
    reads: tuple[str, ...]
    fix: str


RULES = (
    Needs(
        ("float8.recipe", "float8.linears", "float8.emulate", "float8.fsdp_all_gather", "float8.dispatch"),
        "with float8.enabled=true",
        lambda c: c.float8.enabled,
        ("float8.enabled",),
        "Add --float8.enabled=true",
    ),
    Needs(
        ("float8.combine_gradient",),
        "with float8.dispatch=true, whose wire form it sends the gradient in",
        lambda c: c.float8.enabled and c.float8.dispatch,
        ("float8.enabled", "float8.dispatch"),
        "Add --float8.enabled=true and --float8.dispatch=true",
    ),
    Needs(
        ("float8.experts", "float8.cache_activations"),
        "with float8.enabled=true on a model with routed experts",
        lambda c: c.float8.enabled and _has_experts(c),
        ("float8.enabled", "model.name"),
        "Add --float8.enabled=true with an MoE preset (--model.name=debug-moe)",
    ),
    Needs(
        (
            "model.n_experts",
            "model.top_k",
            "moe.aux_loss_coef",
            "moe.seq_aux_loss_coef",
            "moe.bias_update_rate",
            "moe.capacity_factor",
            "moe.rank_capacity_factor",
            "kernels.grouped_gemm",
            "kernels.permutation",
        ),
        "on a model with routed experts",
        _has_experts,
        ("model.name",),
        "Use a preset with routed experts ({routed_presets}), e.g. --model.name=debug-moe",
    ),
    Needs(
        ("model.mtp_loss_weight",),
        "where multi-token prediction modules train",
        _trains_ahead,
        ("model.mtp_modules", "model.name"),
        "Add --model.mtp_modules=1",
    ),
    Needs(
        ("parallel.ep_dispatch", "parallel.ep_overlap"),
        "with expert parallelism (parallel.ep > 1), where tokens travel to their experts",
        lambda c: c.parallel.ep > 1,
        ("parallel.ep",),
        "Add --parallel.ep=2 or more (an MoE model)",
    ),
    Needs(
        ("parallel.ep_pairing_phase",),
        "where a forward pairs with a backward across pipeline stages (parallel.ep_overlap with parallel.ep > 1 and "
        "pp_schedule DualPipeV or Interleaved1F1B at parallel.pp > 1)",
        lambda c: pairs_across_stages(c.parallel),  # its fields are the Layout's names
        ("parallel.ep_overlap", "parallel.ep", "parallel.pp", "parallel.pp_schedule"),
        "Add --parallel.ep_overlap=true, --parallel.ep=2, --parallel.pp=2 and --parallel.pp_schedule=DualPipeV (MoE)",
    ),
    Needs(
        ("parallel.etp",),
        "with expert parallelism under tensor parallelism (parallel.ep > 1 and parallel.tp > 1), where ep can fold "
        "over the tp ranks",
        lambda c: c.parallel.ep > 1 and c.parallel.tp > 1,
        ("parallel.ep", "parallel.tp"),
        "Add --parallel.ep=2 and --parallel.tp=2 or more (an MoE model)",
    ),
    Needs(
        (
            "parallel.pp_schedule",
            "parallel.pp_virtual_stages",
            "parallel.pp_layout",
            "parallel.pp_layers_per_stage",
            "parallel.pp_first_stage_layers",
            "parallel.pp_last_stage_layers",
        ),
        "with a pipeline (parallel.pp > 1)",
        lambda c: c.parallel.pp > 1,
        ("parallel.pp",),
        "Add --parallel.pp=2 or more",
    ),
    Needs(
        ("optimizer.momentum", "optimizer.newton_schulz_steps", "optimizer.newton_schulz_dtype", "optimizer.qk_clip"),
        "with optimizer.name=muon (Muon's and MuonClip's settings)",
        lambda c: c.optimizer.name == "muon",
        ("optimizer.name",),
        "Add --optimizer.name=muon",
    ),
    Needs(
        ("lr_schedule.decay_ratio",),
        "with lr_schedule.name=wsd (its final decay)",
        lambda c: c.lr_schedule.name == "wsd",
        ("lr_schedule.name",),
        "Add --lr_schedule.name=wsd",
    ),
    Needs(
        ("lr_schedule.min_lr_ratio",),
        "with a schedule that decays (the constant one stays at the peak)",
        lambda c: c.lr_schedule.name != "constant",
        ("lr_schedule.name",),
        "Use --lr_schedule.name=cosine (or linear, wsd)",
    ),
    Needs(
        ("tokenizer.path", "tokenizer.eos_token"),
        "with tokenizer.kind=hf or tiktoken (the byte tokenizer has no file, and 256 ends each document)",
        lambda c: c.tokenizer.kind != "byte",
        ("tokenizer.kind",),
        "Add --tokenizer.kind=hf (a tokenizer.json) or tiktoken",
    ),
    Needs(
        ("data.shuffle",),
        "with data.prepared (the token stores' window order)",
        lambda c: bool(c.data.prepared),
        ("data.prepared",),
        "Add --data.prepared=DIR",
    ),
    Needs(
        ("data.split",),
        "with data.path or data.name (eval.split chooses the evaluation set's)",
        lambda c: bool(c.data.path or c.data.name),
        ("data.path", "data.name"),
        "Add --data.path=FILE or --data.name=DATASET",
    ),
    Needs(
        ("data.config_name",),
        "with a hub dataset (data.name or eval.name)",
        lambda c: bool(c.data.name or c.eval.name),
        ("data.name", "eval.name"),
        "Add --data.name=DATASET",
    ),
    Needs(
        ("data.text_field", "data.streaming"),
        "with a dataset read by the datasets library (data.path, data.name, eval.path or eval.name; the default "
        "corpus is files of plain text)",
        lambda c: bool(c.data.path or c.data.name or c.eval.path or c.eval.name),
        ("data.path", "data.name", "eval.path", "eval.name"),
        "Add --data.path=FILE or --data.name=DATASET",
    ),
    Needs(
        ("eval.steps", "eval.batch_size", "eval.document_mask"),
        "with evaluation on (eval.interval > 0)",
        lambda c: c.eval.interval > 0,
        ("eval.interval",),
        "Add --eval.interval=50",
    ),
    Needs(
        ("eval.split",),
        "with a separate evaluation set (eval.path or eval.name)",
        lambda c: bool(c.eval.path or c.eval.name),
        ("eval.path", "eval.name"),
        "Add --eval.path=FILE or --eval.name=DATASET",
    ),
    Needs(
        ("eval.held_out",),
        "without a separate evaluation set (with eval.path or eval.name no training document is held out)",
        lambda c: not (c.eval.path or c.eval.name),
        ("eval.path", "eval.name"),
        "Drop eval.path and eval.name to hold documents out",
    ),
    Needs(
        (
            "logging.wandb_project",
            "logging.wandb_entity",
            "logging.wandb_run_name",
            "logging.wandb_group",
            "logging.wandb_tags",
            "logging.wandb_init_timeout_s",
        ),
        "with logging.wandb=true",
        lambda c: c.logging.wandb,
        ("logging.wandb",),
        "Add --logging.wandb=true",
    ),
    Needs(
        ("profiling.wait", "profiling.warmup", "profiling.active", "profiling.repeat"),
        "with profiling.enabled=true (the trace schedule)",
        lambda c: c.profiling.enabled,
        ("profiling.enabled",),
        "Add --profiling.enabled=true",
    ),
    Needs(
        ("profiling.memory_snapshot_step",),
        "with profiling.memory_snapshot=true",
        lambda c: c.profiling.memory_snapshot,
        ("profiling.memory_snapshot",),
        "Add --profiling.memory_snapshot=true",
    ),
    Needs(
        (
            "fault_tolerance.replica_id",
            "fault_tolerance.group_size",
            "fault_tolerance.min_replica_size",
            "fault_tolerance.semi_sync_method",
            "fault_tolerance.process_group",
            "fault_tolerance.process_group_timeout_ms",
            "fault_tolerance.timeout_s",
        ),
        "with fault_tolerance.enabled=true",
        lambda c: c.fault_tolerance.enabled,
        ("fault_tolerance.enabled",),
        "Add --fault_tolerance.enabled=true",
    ),
    Needs(
        ("fault_tolerance.sync_steps",),
        "with semi-synchronous replica groups (fault_tolerance.enabled=true, semi_sync_method diloco or local_sgd)",
        lambda c: c.fault_tolerance.enabled and c.fault_tolerance.semi_sync_method != "none",
        ("fault_tolerance.enabled", "fault_tolerance.semi_sync_method"),
        "Add --fault_tolerance.enabled=true --fault_tolerance.semi_sync_method=diloco",
    ),
    Needs(
        ("fault_tolerance.outer_lr", "fault_tolerance.outer_momentum"),
        "with DiLoCo (fault_tolerance.enabled=true, semi_sync_method=diloco: its outer step)",
        lambda c: c.fault_tolerance.enabled and c.fault_tolerance.semi_sync_method == "diloco",
        ("fault_tolerance.enabled", "fault_tolerance.semi_sync_method"),
        "Add --fault_tolerance.enabled=true --fault_tolerance.semi_sync_method=diloco",
    ),
)

ALWAYS_ACTS = {
    "job.output_dir": "where the run writes",
    "job.seed": "the weights' and the data order's seed",
    "job.device": "the device",
    "job.collective_timeout_s": "bounds collectives; whether there are any depends on the launch",
    "job.overwrite": "decided by the run directory's contents, which the config cannot see",
    "job.world_size": "checked against the launch; trillion estimate simulates it",
    "job.hardware": "read by trillion estimate, and for ranks per node",
    "model.name": "the model",
    "model.n_layers": "the model's shape",
    "model.dim": "the model's shape",
    "model.n_heads": "the model's shape",
    "model.n_kv_heads": "the model's shape; refused by the parts where they have no key/value heads",
    "model.ffn_dim": "the model's shape",
    "model.vocab_size": "the model's shape",
    "model.max_seq_len": "the model's shape",
    "model.mtp_modules": "turns multi-token prediction on or off",
    "data.path": "the training text",
    "data.name": "the training text",
    "data.prepared": "the training text",
    "data.lanes": "the training order on the fly, and the evaluation set's with every source",
    "data.document_mask": "the attention mask",
    "data.reset_positions": "the positions, with or without the mask",
    "tokenizer.kind": "the tokenizer",
    "training.steps": "the run's length and schedule",
    "training.global_batch_size": "the batch",
    "training.micro_batch_size": "the micro-batches",
    "training.seq_len": "the windows",
    "training.dtype": "the precision",
    "training.max_grad_norm": "the clipping",
    "training.exit_interval": "this job's stop",
    "training.exit_after_minutes": "this job's stop",
    "training.max_nonfinite_skips": "the divergence stop",
    "optimizer.name": "the optimizer",
    "optimizer.lr": "the learning rate",
    "optimizer.beta1": "AdamW's, with Muon too (embeddings, head, norms)",
    "optimizer.beta2": "AdamW's, with Muon too",
    "optimizer.eps": "AdamW's, with Muon too",
    "optimizer.weight_decay": "AdamW's and Muon's",
    "optimizer.implementation": "AdamW's, with Muon too",
    "optimizer.state_dtype": "AdamW's moments, with Muon too (its AdamW part's)",
    "optimizer.ema_decay": "the host-memory average of the parameters, with either optimizer",
    "lr_schedule.name": "the schedule",
    "lr_schedule.warmup_steps": "every schedule warms up",
    "checkpoint.interval": "the saves",
    "checkpoint.keep_latest": "prunes the checkpoints of this and later jobs",
    "checkpoint.async_mode": "how saves are written",
    "checkpoint.initial_load": "a fresh start's weights; ignored on resume, which the config cannot see",
    "checkpoint.load_step": "the resume; whether there is one the config cannot see",
    "checkpoint.save_final": "the last save",
    "checkpoint.mtbf_hours_per_gpu": "the interval advice after a save before the last step, early stops included",
    "checkpoint.accept_data_change": "the resume; whether there is one the config cannot see",
    "metrics.log_freq": "the logging",
    "metrics.peak_tflops": "MFU",
    "logging.wandb": "W&B on or off",
    "logging.tensorboard": "TensorBoard on or off",
    "logging.progress_bar": "the console",
    "parallel.dp_replicate": "the layout",
    "parallel.dp_shard": "the layout",
    "parallel.dp_shard_mode": "FSDP's mode; dp_shard=-1 resolves with the world, which the config cannot see",
    "parallel.tp": "the layout",
    "parallel.tp_overlap": "how TP's collectives run; refused without tp > 1 by the layout's checks (tp_checks.py)",
    "parallel.async_tp": "how TP's collectives run; refused without tp > 1 or compile by the layout's checks",
    "parallel.defer_weight_grads": "refused without a schedule's weight passes, or with tp > 1, by the layout's checks",
    "parallel.ep": "the layout; refused on a dense model by the layout's checks",
    "parallel.ranks_per_node": "the expert dispatch's nodes, and trillion estimate's placement of ranks",
    "parallel.pp": "the layout",
    "parallel.cp": "the layout",
    "parallel.activation_checkpoint": "recomputation",
    "kernels.attention": "the attention kernel",
    "kernels.norm": "the norm kernel",
    "compile.enabled": "torch.compile",
    "float8.enabled": "float8 on or off",
    "profiling.enabled": "the profiler",
    "profiling.memory_snapshot": "allocation history, on a GPU (the config cannot see the device)",
    "eval.interval": "evaluation on or off",
    "eval.path": "the evaluation set, and no training document held out",
    "eval.name": "the evaluation set, and no training document held out",
    "fault_tolerance.enabled": "replica groups on or off",
}


def _value(config, key: str):
    return getattr(getattr(config, key.partition(".")[0]), key.partition(".")[2])


def _default(config, key: str):
    section, _, name = key.partition(".")
    return next(f.default for f in dataclasses.fields(getattr(config, section)) if f.name == name)


def _changed(config, rule: Needs) -> list[str]:
    return [key for key in rule.settings if _value(config, key) != _default(config, key)]


def check_effects(config) -> None:
    """Refuse a setting changed from its default where it does nothing: one paragraph per rule, naming every
    setting of the rule that was given."""
    for rule in RULES:
        if (given := _changed(config, rule)) and not rule.holds(config):
            raise ConfigError(_message(config, rule, given))


def _shown(value) -> str:
    """A value as the command line takes it: true/false, numbers as they are, text quoted."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _message(config, rule: Needs, given: list[str]) -> str:
    one = len(given) == 1
    named = " and ".join(f"{key}={_shown(_value(config, key))}" for key in given)
    now = ", ".join(f"{key}={_shown(_value(config, key))}" for key in rule.reads)
    from trillion.models.presets import expert_presets

    fix = rule.fix.replace("{routed_presets}", ", ".join(expert_presets()))
    return (
        f"{named} {'does' if one else 'do'} nothing in this run: {'it acts' if one else 'they act'} only "
        f"{rule.condition}, and here {now}. {fix}, or drop {'it' if one else 'them'}."
    )


def without_idle(config):
    """A copy of `config` with the settings that do nothing in it (what check_effects refuses) back at their
    defaults: for code that derives a config from another (`trillion plan --config-out` from a plan's row,
    `trillion estimate`'s measured steps with evaluation and logging off)."""
    config = copy.deepcopy(config)
    for rule in RULES:
        if not rule.holds(config):
            for key in _changed(config, rule):
                section, _, name = key.partition(".")
                setattr(getattr(config, section), name, _default(config, key))
    return config
