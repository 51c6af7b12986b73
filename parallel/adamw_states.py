"""AdamW whose two moments are kept in another dtype than the parameters (`optimizer.state_dtype=bfloat16`):
DeepSeek-V3's "BF16 instead of FP32 to track the first and second moments" (arXiv 2412.19437 section 3.3.1).

The step is torch's AdamW's (decoupled weight decay, bias-corrected moments, eps outside the square root), computed
in float32: each parameter's moments are read into float32, updated with its gradient, used for this step's update,
and written back rounded to nearest. So the moments take 2 + 2 bytes per parameter instead of 4 + 4 and the update
differs from float32 AdamW's only by the moments' earlier rounding (tests/test_adamw_states.py: state_dtype=float32
gives torch's AdamW; bfloat16 drifts as README shows). One parameter at a time, so the float32 copies take one
parameter's room, not the model's. Parameters sharded by FSDP or TP (DTensors) keep DTensor moments of the same
placement (a checkpoint reshards them), updated through their local shards.

No found-inf tensor masks this step on the device: under the non-finite guard the trainer reads the step's flag on
the host, as for torch's foreach AdamW (trainer/step.py step_unless_flagged).
"""

import math

import torch
from torch.distributed.tensor import DTensor

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class StateDtypeAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's step (amsgrad and maximize off) with exp_avg and exp_avg_sq in `state_dtype`."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, state_dtype=torch.bfloat16):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def _update(self, param: torch.Tensor, group: dict) -> None:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, dtype=self.state_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.state_dtype, memory_format=torch.preserve_format)
        (beta1, beta2), lr = group["betas"], group["lr"]
        state["step"] += 1
        step = state["step"].item()  # a host tensor, as torch's AdamW keeps it: no device read
        weights, grad = _local(param), _local(param.grad).float()
        stored = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        exp_avg, exp_avg_sq = (moment.float() for moment in stored)  # float32 moments: the stored ones themselves
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        stored[0].copy_(exp_avg)
        stored[1].copy_(exp_avg_sq)
        denominator = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        weights.mul_(1 - lr * group["weight_decay"])
        weights.addcdiv_(exp_avg, denominator, value=-lr / (1 - beta1**step))
