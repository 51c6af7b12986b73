"""The config `trillion plan --config-out` writes: the best layout as a file `trillion train --config` and `trillion
estimate --config` run with no flag added (it carries the world size, the hardware and, with a budget, the steps)."""

import math

from trillion.models.presets import get_preset
from trillion.parallel.planner.hardware import profile_names
from trillion.parallel.planner.search import Request
from trillion.trainer.config.schema import Config, to_toml, without_idle
from trillion.trainer.tools.plan_args import PART_FLAGS


def train_config_toml(request: Request, row: dict) -> str:
    """The best layout as a config `trillion train --config` loads (checked by loading it back)."""
    config = Config()
    config.job.world_size = request.gpus
    config.job.hardware = hardware_setting(request.hardware)
    config.model.name = request.model
    if request.tokens > 0:  # the budget's steps, so that the file trains the plan as is
        config.training.steps = math.ceil(request.tokens / (request.global_batch * request.seq_len))
    config.training.global_batch_size = request.global_batch
    config.training.micro_batch_size = row["micro_batch_size"]
    config.training.seq_len = request.seq_len
    if request.seq_len > request.args.max_seq_len:  # a rotary model trained past its preset's length
        config.model.max_seq_len = request.seq_len
    for key in (
        "dp_replicate",
        "dp_shard",
        "dp_shard_mode",
        "tp",
        "pp",
        "pp_schedule",
        "activation_checkpoint",
        "cp",
        "ep",
        "etp",
    ):
        setattr(config.parallel, key, row[key])
    for setting in PART_FLAGS.values():  # a part setting the plan changed from the preset's
        field = setting.removeprefix("model.")
        if getattr(request.args, field) != getattr(get_preset(request.model), field):
            setattr(config.model, field, getattr(request.args, field))
    config.parallel.ep_dispatch = request.fixed.get("ep_dispatch", "auto")  # auto: as the plan resolved it
    config.parallel.ep_overlap = row["ep_overlap"] and row["ep"] > 1
    config.parallel.ep_pairing_phase = row["ep_pairing_phase"]  # the plan's (0 where nothing pairs across stages)
    config.parallel.defer_weight_grads = row["defer_weight_grads"]
    config.parallel.tp_overlap, config.parallel.async_tp = row["tp_overlap"], row["async_tp"]
    config.moe.rank_capacity_factor = row["ep_capacity"]
    config.optimizer.name = row["optimizer"]
    config.optimizer.state_dtype = row["optimizer_state_dtype"]
    config.optimizer.ema_decay = row["ema_decay"]
    config.parallel.pp_layout = row["pp_layout"] if row["pp"] > 1 else ""  # the split the plan timed, written out
    config.data.document_mask = row["attention_share"] < 1.0  # --documents: the plan timed masked attention
    config.compile.enabled = row["compile"]
    config.float8.enabled = row["float8"]  # FSDP float8 all-gather auto (tensorwise only): what the plan timed
    config.float8.recipe = row["float8_recipe"]
    config.float8.linears = row["float8_linears"]
    config.float8.experts = row["float8_experts"]
    config.float8.dispatch = row["float8_dispatch"]  # only under ep > 1 (space.py), as the trainer allows it
    config.float8.cache_activations = row["float8_cache_activations"]
    config.float8.combine_gradient = row["float8_combine_gradient"]
    header = [
        f"# trillion plan: {request.model} on {request.gpus} x {request.hardware.name} "
        f"({request.hardware.device.name})",
        f"# predicted: {row['step_time_s']:.2f} s/step, {row['tokens_per_s']:,.0f} tokens/s, "
        f"MFU {row['mfu']:.1%}, {row['memory_gb']:.1f} of {row['memory_capacity_gb']:g} GB per GPU",
        f"# pipeline chunks per rank (virtual stages): {row['virtual_stages']}",
        "",
    ]
    return "\n".join(header) + to_toml(without_idle(config))  # nothing idle (a schedule at pp 1) is written


def hardware_setting(profile) -> str:
    """job.hardware for a plan on `profile`: its name where that finds it again, else the file it came from."""
    return profile.name if profile.name in profile_names() else profile.source
