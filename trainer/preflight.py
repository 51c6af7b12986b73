"""The memory pre-flight: before any tensor is allocated, the parameters, gradients and optimizer
states the fullest rank of the layout will hold (the planner's byte counts per ZeRO mode, the same
that `trillion estimate` checks against real shards) are compared with this device's memory, or the
host's for every process on it. Those states are a lower bound (activations and buffers come on
top), so a refusal is certain, never a guess: the run stops with the figures and the `trillion plan`
command that finds a layout that fits, instead of being killed by the OOM killer without a word. A run planned
for a hardware profile (job.hardware) is refused as well where it trains in a number format that hardware's
matrix units lack (`check_planned_format`), as `trillion plan` refuses to price it."""

import os

import torch

from trillion.errors import ConfigError
from trillion.models import ModelArgs
from trillion.parallel.float8_recipes import float8_recipe
from trillion.parallel.layout import Layout
from trillion.parallel.planner.hardware import load_profile, low_precision_peak_tflops, profile_names
from trillion.parallel.planner.memory import pipeline_ranks, states_bytes
from trillion.parallel.planner.optimizer import state_bytes as optimizer_state_bytes


def states_per_rank(model_args: ModelArgs, layout: Layout, optimizer: str) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes of the fullest rank (`optimizer`'s state: AdamW's or Muon's)."""
    mode = "zero1" if layout.pp > 1 else layout.dp_shard_mode  # a pipeline keeps its stages gathered (memory.py)
    found = []
    for rank in pipeline_ranks(model_args, layout):
        # FSDP: dp_shard x cp; the routed experts E / ep a rank, sharded over the dp_shard x cp / ep left
        tp_numel, shard_numel = rank.numel(
            model_args, layout.tp, layout.dp_shard * layout.cp, layout.ep, layout.expert_tp
        )
        parameters, gradients, _ = states_bytes(tp_numel, shard_numel, mode)
        found.append((parameters, gradients, optimizer_state_bytes(model_args, layout, optimizer, rank, shard_numel)))
    return max(found, key=sum)


def memory_available(device: torch.device, local_processes: int) -> tuple[float, str]:
    """(bytes one rank may use, where they come from)."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory), f"{torch.cuda.get_device_name(device)}"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host / local_processes, (
        f"host memory, {host / 1e9:.1f} GB shared by {local_processes} processes"
        if local_processes > 1
        else "host memory"
    )


def check_memory(
    layout: Layout, model_args: ModelArgs, env, *, optimizer: str, model_name: str, global_batch_size: int
) -> None:
    """Refuse a layout whose weights, gradients and `optimizer`'s states (optimizer.name) alone overflow a rank's
    memory."""
    parameters, gradients, optimizer = states_per_rank(model_args, layout, optimizer)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size)) if env.device.type == "cpu" else 1
    available, where = memory_available(env.device, max(1, local))
    needed = parameters + gradients + optimizer
    if needed <= available:
        return
    raise ConfigError(
        f"model {model_name!r} does not fit this layout: its fullest rank would hold {parameters / 1e9:.1f} GB of "
        f"parameters, {gradients / 1e9:.1f} GB of gradients and {optimizer / 1e9:.1f} GB of optimizer states "
        f"({needed / 1e9:.1f} GB before any activation), but a rank has {available / 1e9:.1f} GB ({where}) at "
        f"parallel.tp={layout.tp} pp={layout.pp} dp_shard={layout.dp_shard} ({layout.dp_shard_mode}) on "
        f"{env.world_size} process(es). Shard it over more devices, or find a layout that fits with "
        f"`trillion plan --model {model_name} --hardware HARDWARE --gpus N --global-batch {global_batch_size}` "
        f"(HARDWARE: {', '.join(profile_names())}), or pick a smaller --model.name."
    )


def check_planned_format(layout: Layout, hardware: str) -> None:
    """Refuse the layout's float8 recipe where job.hardware's profile (`hardware`, "" for none) has no matrix units
    in its number format (MXFP8 on a Hopper, say), naming the formats it has."""
    if layout.float8 is not None and hardware:
        recipe = layout.float8.recipe
        low_precision_peak_tflops(load_profile(hardware), float8_recipe(recipe).format, f"float8.recipe={recipe}")
