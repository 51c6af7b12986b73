"""What a checkpoint holds, as DCP Stateful objects: the model (or this rank's pipeline stages) and
its optimizers keyed by global parameter names, so any layout loads them; the training state (counters,
LR schedule, data position); the RNG states. And loading weights alone (a checkpoint or a Hugging
Face folder) for checkpoint.initial_load and `trillion export`. Writing, publishing and resuming:
checkpoint.py."""

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from trillion.errors import ConfigError
from trillion.trainer.checkpoint.resume_check import check_shapes

OPTIMIZER_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # keyed by parameter name: any layout


@dataclass
class RunStates:
    """What a checkpoint saves of a run, and what a resume loads into: the model parts (the model, or
    this rank's pipeline stages: not the `whole_model`, a share of the names), their optimizers, the
    LR schedule, the data loader's position, the run's counters, the RNG states of `device` and the parameters'
    moving average where kept;
    `model_args` check weights loaded from elsewhere (checkpoint.initial_load)."""

    model_parts: list
    optimizers: list
    scheduler: object
    loader: object
    counters: object
    device: torch.device
    model_args: object
    whole_model: bool = True
    ema: Stateful | None = None  # the parameters' host-memory average (optimizer.ema_decay > 0; parallel/host_ema.py)

    def stateful(self) -> dict:
        states = {
            "model": ModelParts(self.model_parts),
            "optimizer": Optimizers(self.model_parts, self.optimizers),
            "training": TrainingState(self.counters, self.scheduler, self.loader),
            "rng": RNGStates(self.device),
        }
        return states | ({"ema": self.ema} if self.ema is not None else {})


class ModelParts(Stateful):
    """The model (or this rank's pipeline stages) as one state dict keyed by global parameter names."""

    def __init__(self, parts: list[torch.nn.Module]):
        self.parts = parts

    def state_dict(self) -> dict:
        return {k: v for part in self.parts for k, v in get_model_state_dict(part).items()}

    def load_state_dict(self, state: dict) -> None:
        for part in self.parts:  # each stage takes its own names from the merged dict
            set_model_state_dict(part, state, options=StateDictOptions(strict=len(self.parts) == 1))


class Optimizers(Stateful):
    """One optimizer per model part, flattened to parameter-name keys so any layout can load them."""

    def __init__(self, parts: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]):
        self.pairs = list(zip(parts, optimizers, strict=True))

    def state_dict(self) -> dict:
        return {
            k: v
            for part, opt in self.pairs
            for k, v in get_optimizer_state_dict(part, opt, options=OPTIMIZER_OPTIONS).items()
        }

    def load_state_dict(self, state: dict) -> None:
        for part, opt in self.pairs:
            set_optimizer_state_dict(part, opt, state, options=OPTIMIZER_OPTIONS)


class TrainingState(Stateful):
    """Counters, LR schedule and data position: the same on every rank and under every layout."""

    def __init__(self, counters, scheduler, loader):
        self.counters, self.scheduler, self.loader = counters, scheduler, loader

    def state_dict(self) -> dict:
        return {
            "counters": self.counters.state_dict(),
            "lr_scheduler": self.scheduler.state_dict(),
            "data": self.loader.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.counters.load_state_dict(state["counters"])
        self.loader.load_state_dict(state["data"])
        # The position in the schedule comes from the checkpoint, its shape from this run's config
        # (so a changed optimizer.lr or training.steps takes effect); unchanged, this is bitwise
        # what the uninterrupted run computes.
        schedule = {k: v for k, v in state["lr_scheduler"].items() if k not in ("base_lrs", "_last_lr", "lr_lambdas")}
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **schedule})
        for group, base, factor in zip(
            self.scheduler.optimizer.param_groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas, strict=True
        ):
            group["initial_lr"], group["lr"] = base, base * factor(self.scheduler.last_epoch)
        self.scheduler._last_lr = [group["lr"] for group in self.scheduler.optimizer.param_groups]


class RNGStates(Stateful):
    """CPU and accelerator generator states. Every rank seeds alike, so one copy serves all ranks."""

    def __init__(self, device: torch.device):
        self.device = device
        self.saved_keys: set[str] | None = None  # on load: what the checkpoint has (a CPU run has no cuda state)

    def state_dict(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return {k: v for k, v in state.items() if self.saved_keys is None or k in self.saved_keys}

    def load_state_dict(self, state: dict) -> None:
        if "cpu" in state:
            torch.set_rng_state(state["cpu"])
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)


def load_model_weights(
    path: Path, parts: list[torch.nn.Module], model_args, setting: str, whole_model: bool = True
) -> None:
    """Weights only, from a checkpoint step directory or a Hugging Face folder (safetensors + config.json)."""
    model = ModelParts(parts)
    if (path / ".metadata").is_file():
        check_shapes(saved_model_shapes(path), model.state_dict(), f"{setting}={path}", whole_model)
        dcp.load({"model": model}, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        return
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise ConfigError(
            f"{setting}={str(path)!r} is neither a checkpoint step directory (with .metadata) nor a "
            f"Hugging Face folder with *.safetensors. Point it at checkpoints/step-NNNNNNNN of a run or at "
            f"the folder `trillion export` wrote."
        )
    from safetensors.torch import load_file

    from trillion.models.hf import from_hf_state_dict

    weights = from_hf_state_dict({k: v for f in files for k, v in load_file(f).items()}, model_args)
    # a transformers folder holds no multi-token prediction modules (training only): theirs keep their initial values
    ours = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    check_shapes({k: tuple(v.shape) for k, v in weights.items()}, ours, f"{setting}={path}", whole_model)
    for part in parts:  # full tensors in, each rank keeps its shards
        set_model_state_dict(part, weights, options=StateDictOptions(full_state_dict=True, strict=False))


def saved_model_shapes(path: Path) -> dict[str, tuple]:
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {
        k.removeprefix("model."): tuple(m.size)
        for k, m in metadata.items()
        if k.startswith("model.") and hasattr(m, "size")
    }
