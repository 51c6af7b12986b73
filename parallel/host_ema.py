"""The parameters' exponential moving average in host memory (optimizer.ema_decay), as DeepSeek-V3 kept it: a float32
copy of each rank's own shard of every parameter in (pinned) CPU memory, updated after each optimizer step,

    ema = decay * ema + (1 - decay) * parameter,

so it takes no accelerator memory and no collective: under FSDP each rank averages the shard it steps (a DTensor's
local tensor), never the gathered whole. On an accelerator the step's parameters are copied into a pinned staging
buffer with non_blocking (the copy queued behind the optimizer's kernels, the host not waiting) and folded into the
average at the next step, or before a checkpoint reads it; on the CPU the fold is immediate.

A checkpoint saves it under `ema.<parameter name>` with the parameters' global shapes and placements, so a resume
under any layout loads it (DCP re-slices it as it does the model) and `trillion export --weights ema` writes it.
"""

import logging
import re

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

log = logging.getLogger("trillion")

# what wrappers (activation checkpointing, torch.compile, FSDP) add to a parameter's name; a checkpoint's names
# carry none of them (DCP's get_model_state_dict strips them alike)
_WRAPPER_NAMES = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")


def checkpoint_name(name: str) -> str:
    return _WRAPPER_NAMES.sub("", name)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class HostEMA(Stateful):
    """The moving average of `model`'s trainable parameters, each rank's shard in host memory."""

    def __init__(self, model: nn.Module, decay: float, device: torch.device):
        assert 0 < decay < 1, decay
        self.decay = decay
        self.params = {checkpoint_name(n): p for n, p in model.named_parameters() if p.requires_grad}
        pinned = device.type == "cuda"  # pinned host memory: what a non_blocking device-to-host copy needs
        self.average = {n: self._host(_local(p), pinned) for n, p in self.params.items()}
        for name, average in self.average.items():
            average.copy_(_local(self.params[name]).detach())
        # the step's parameters on their way to the host (accelerators only), and the event marking their arrival
        self.staging = {n: self._host(_local(p), pinned, p.dtype) for n, p in self.params.items()} if pinned else None
        self.in_flight: torch.cuda.Event | None = None
        numel = sum(a.numel() for a in self.average.values())
        log.info("optimizer.ema_decay=%g: %.1f MB of host memory on this rank", decay, numel * 4 / 1e6)

    @staticmethod
    def _host(local: torch.Tensor, pinned: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(local.shape, dtype=dtype, device="cpu", pin_memory=pinned)

    def update(self) -> None:
        """Fold in the parameters as the step left them: on an accelerator, the previous step's copy is folded and
        this step's copy queued (non_blocking into pinned memory); on the CPU, folded now."""
        if self.staging is None:
            for name, average in self.average.items():
                average.lerp_(_local(self.params[name]).detach().float(), 1 - self.decay)
            return
        self.fold()
        for name, staged in self.staging.items():
            staged.copy_(_local(self.params[name]).detach(), non_blocking=True)
        self.in_flight = torch.cuda.Event()
        self.in_flight.record()

    def fold(self) -> None:
        """Wait for the queued copy (it was queued a step ago: normally done) and fold it into the average."""
        if self.in_flight is None:
            return
        self.in_flight.synchronize()
        self.in_flight = None
        for name, average in self.average.items():
            average.lerp_(self.staging[name].float(), 1 - self.decay)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Update after every optimizer step the optimizer takes (GradScaler's and the masked fused step's too)."""
        optimizer.register_step_post_hook(lambda *_: self.update())

    def state_dict(self) -> dict:
        """Each average as its parameter is laid out (a DTensor on the same mesh and placements: DCP saves each
        rank's shard under the global shape), the parameter's name as key."""
        self.fold()
        state = {}
        for name, average in self.average.items():
            param = self.params[name]
            if isinstance(param, DTensor):  # built round the host tensor: from_local would move it to the device
                meta = TensorMeta(param.shape, param.stride(), average.dtype)
                average = DTensor(average, DTensorSpec(param.device_mesh, param.placements, meta), requires_grad=False)
            state[name] = average
        return state

    def load_state_dict(self, state: dict) -> None:
        self.in_flight = None
        for name, average in self.average.items():
            loaded = state[name]
            average.copy_(_local(loaded) if isinstance(loaded, DTensor) else loaded)
