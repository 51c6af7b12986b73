"""The parameters' exponential moving average in host memory (optimizer.ema_decay), as DeepSeek-V3 kept it: a float32
copy of each rank's own shard of every parameter in (pinned) CPU memory, updated after each optimizer step,

    ema = decay * ema + (1 - decay) * parameter,

so it takes no accelerator memory and no collective: under FSDP each rank averages the shard it steps (a DTensor's
local tensor), never the gathered whole. On an accelerator the step's parameters are copied into a pinned staging
buffer with non_blocking (the copy queued behind the optimizer's kernels, the host not waiting) and folded into the
average by a host thread of its own once the copy lands, while the training thread goes on launching the next step:
the fold reads and writes about 18 bytes of host memory a parameter, seconds a step on one core at DeepSeek-V3's
shard sizes (torchrun gives each rank one intra-op thread), which on the training thread would hold the next step's
launches. The next update, and a checkpoint's read, wait for it. On the CPU the fold is immediate.

A checkpoint saves it under `ema.<parameter name>` with the parameters' global shapes and placements, so a resume
under any layout loads it (DCP re-slices it as it does the model) and `trillion export --weights ema` writes it.
"""

import logging
import re
import threading

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

    def __init__(self, model: nn.Module, decay: float, device: torch.device, staged: bool | None = None):
        """`staged` (default: on an accelerator): each step's parameters go through the staging buffers and a fold
        thread (the module docstring); on the CPU that path copies synchronously (tests run it there)."""
        assert 0 < decay < 1, decay
        self.decay = decay
        self.params = {checkpoint_name(n): p for n, p in model.named_parameters() if p.requires_grad}
        staged = device.type != "cpu" if staged is None else staged
        pinned = device.type == "cuda"  # pinned host memory: what a non_blocking device-to-host copy needs
        self.average = {n: self._host(_local(p), pinned) for n, p in self.params.items()}
        for name, average in self.average.items():
            average.copy_(_local(self.params[name]).detach())
        # the step's parameters on their way to the host, and the thread folding them in once they land
        self.staging = {n: self._host(_local(p), pinned, p.dtype) for n, p in self.params.items()} if staged else None
        self.folding: threading.Thread | None = None
        self.fold_error: BaseException | None = None
        numel = sum(a.numel() for a in self.average.values())
        log.info("optimizer.ema_decay=%g: %.1f MB of host memory on this rank", decay, numel * 4 / 1e6)

    @staticmethod
    def _host(local: torch.Tensor, pinned: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(local.shape, dtype=dtype, device="cpu", pin_memory=pinned)

    def update(self) -> None:
        """Fold in the parameters as the step left them: staged, the previous step's fold awaited, this step's
        copy queued (non_blocking into pinned memory) and its fold started on a host thread; else folded now."""
        if self.staging is None:
            for name, average in self.average.items():
                average.lerp_(_local(self.params[name]).detach().float(), 1 - self.decay)
            return
        self.fold()
        for name, staged in self.staging.items():
            staged.copy_(_local(self.params[name]).detach(), non_blocking=True)
        landed = torch.cuda.Event() if next(iter(self.params.values())).is_cuda else None
        if landed is not None:
            landed.record()
        self.folding = threading.Thread(target=self._fold_staged, args=(landed,), daemon=True)
        self.folding.start()

    def _fold_staged(self, landed) -> None:
        try:
            if landed is not None:
                landed.synchronize()
            for name, average in self.average.items():  # torch's CPU ops release the GIL: the step goes on
                average.lerp_(self.staging[name].float(), 1 - self.decay)
        except BaseException as error:  # noqa: BLE001 (raised on the training thread by fold)
            self.fold_error = error

    def fold(self) -> None:
        """Wait for the last step's fold (normally done: it had a step's time)."""
        if self.folding is None:
            return
        self.folding.join()
        self.folding = None
        if self.fold_error is not None:
            error, self.fold_error = self.fold_error, None
            raise RuntimeError("optimizer.ema_decay: folding the step's parameters into the average failed") from error

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
        self.fold()
        for name, average in self.average.items():
            loaded = state[name]
            average.copy_(_local(loaded) if isinstance(loaded, DTensor) else loaded)
