"""What a restarted replica group copies live from a healthy one through torchft's checkpoint transport:
the weights and optimizer state of this rank's shards (the groups share one layout, so rank r of one group
holds the shards of rank r of another), and, for synchronous groups, the step and token counters, the LR
schedule, the data position and the RNG states. Sharded tensors travel as their local shards (plain tensors)
and become DTensors again with the receiver's own placements."""

import copy

import torch
from torch.distributed.tensor import DTensor

from trillion.trainer.checkpoint.state import RNGStates, TrainingState


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds (the tensor itself when it is not sharded); shares its storage."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class LiveState:
    """The state dict torchft's Manager sends and loads (its `state_dict` / `load_state_dict`).

    `snapshot` freezes the progress (counters, schedule, data position, RNG) at the start of an iteration,
    before its batch is read: a peer may ask for the state while this group is in the middle of a step, and
    what it gets must be the state after the previous step. Weights and optimizer moments change only after
    the step's commit vote, which waits for a transfer in flight (torchft's transport lock)."""

    def __init__(self, model: torch.nn.Module, optimizer, training: TrainingState | None, rng: RNGStates | None):
        self.model, self.optimizer, self.training, self.rng = model, optimizer, training, rng
        self.progress: dict = {}

    def snapshot(self) -> None:
        if self.training is not None:
            self.progress = copy.deepcopy({"training": self.training.state_dict(), "rng": self.rng.state_dict()})

    def state_dict(self) -> dict:
        optimizer = self.optimizer.state_dict()
        state = {
            i: {k: local(v) if torch.is_tensor(v) else v for k, v in s.items()} for i, s in optimizer["state"].items()
        }
        return {
            "model": {name: local(value) for name, value in self.model.state_dict().items()},
            "optimizer": {"state": state, "param_groups": optimizer["param_groups"]},
            **self.progress,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for name, value in self.model.state_dict().items():
            local(value).copy_(state["model"][name])
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        moments = {
            i: {k: self._like(params[i], v) if torch.is_tensor(v) else v for k, v in entry.items()}
            for i, entry in state["optimizer"]["state"].items()
        }
        self.optimizer.load_state_dict({"state": moments, "param_groups": state["optimizer"]["param_groups"]})
        if self.training is not None:
            self.training.load_state_dict(state["training"])
            self.rng.load_state_dict(state["rng"])
            self.snapshot()

    @staticmethod
    def _like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """An optimizer moment of `param` as the receiver holds it: a DTensor of the parameter's placements when
        the parameter is one (scalars such as AdamW's step stay plain)."""
        shard = local(param)
        if isinstance(param, DTensor) and value.shape == shard.shape:
            value = value.to(shard.device)
            return DTensor.from_local(
                value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
            )
        return value
