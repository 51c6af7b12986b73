"""Muon for the hidden matrices, AdamW for the rest, as one torch.optim.Optimizer (one state dict, one LR
schedule, one step that the trainer's clipping, non-finite skip and checkpoints treat like AdamW's).

Per hidden matrix, each step (torch.optim.Muon's arithmetic, torch/optim/_muon.py, with Nesterov momentum):
    buffer = lerp(buffer, grad, 1 - momentum)              (momentum x buffer + (1 - momentum) x grad)
    update = NewtonSchulz(lerp(grad, buffer, momentum))    each whole matrix once (distributed.py)
    param  = param x (1 - lr x weight_decay) - lr x 0.2 sqrt(max(rows, cols)) x update
The momentum and the decay are element-wise, so each rank applies them to its own shard; only Newton-Schulz needs
whole matrices. A stacked expert weight (E, in, out) is E matrices. The rest (embeddings, output head, norms,
biases) steps with torch's AdamW, its implementation as configured, sharing this optimizer's groups and state.
After the step, MuonClip's clip (qk_clip.py) when it is on.

State: `momentum_buffer` per hidden matrix, shaped and sharded like its parameter (a DTensor under FSDP or TP),
and AdamW's `step`, `exp_avg`, `exp_avg_sq` for the rest: DCP saves and reshards them by parameter name like any
optimizer's (trainer/checkpoint/state.py).
"""

import torch
from torch.distributed.tensor import DTensor

from trillion.parallel.muon.distributed import Orthogonalizer, as_stack
from trillion.parallel.muon.matrices import HiddenMatrix


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Muon(torch.optim.Optimizer):
    """`matrices`: (parameter, its HiddenMatrix) for Muon; `adamw`: an AdamW over the other parameters, whose
    groups (with every AdamW setting) join this optimizer's and whose state is this one's. `dtype`: Newton-Schulz's;
    `group`: the process group of this pipeline stage's ranks (None: one rank); `clip`: MuonClip's, or None."""

    def __init__(
        self,
        matrices: list[tuple[torch.nn.Parameter, HiddenMatrix]],
        adamw: torch.optim.AdamW,
        *,
        lr: float,
        momentum: float,
        weight_decay: float,
        steps: int,
        dtype: torch.dtype,
        group=None,
        clip=None,
    ):
        muon_group = {
            "params": [p for p, _ in matrices],
            "lr": lr,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "nesterov": True,
            "use_muon": True,
        }
        super().__init__([muon_group], {"lr": lr})
        for adamw_group in adamw.param_groups:
            adamw_group["use_muon"] = False
            self.add_param_group(adamw_group)  # the same dict: AdamW reads the LR the schedule sets here
        self.adamw, self.matrices, self.dtype, self.clip = adamw, [m for _, m in matrices], dtype, clip
        self.orthogonalizer = Orthogonalizer(
            [p for p, _ in matrices], [(m.rows, m.cols) for m in self.matrices], steps, group
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # load_state_dict replaces the group dicts and the state: AdamW steps on this optimizer's current ones
        self.adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
        self.adamw.state = self.state
        self.adamw.step()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
        if self.clip is not None:
            self.clip.apply()
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
        params, updates = group["params"], []
        for param in params:
            grad = param.grad
            if grad is None:  # every rank of the stage alike: it still takes part in the exchange, with zeros
                updates.append(as_stack(torch.zeros_like(_local(param), dtype=self.dtype)))
                continue
            if isinstance(grad, DTensor) and grad.placements != param.placements:
                grad = grad.redistribute(placements=param.placements)
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param)
            buffer, grad = _local(state["momentum_buffer"]), _local(grad)
            buffer.lerp_(grad, 1 - momentum)
            updates.append(as_stack((grad.lerp(buffer, momentum) if group["nesterov"] else buffer).to(self.dtype)))
            _local(param).mul_(1 - lr * decay)  # decoupled decay; the update adds to it piece by piece below
        locals_ = [as_stack(_local(p)) for p in params]

        def apply(index: int, where: tuple[slice, ...], values: torch.Tensor) -> None:
            if params[index].grad is not None:
                locals_[index][where].add_(values, alpha=-lr * self.matrices[index].update_scale)

        self.orthogonalizer(updates, self.dtype, apply)

    @property
    def orthogonalized(self) -> int:
        """Matrices this rank has orthogonalized since it was built."""
        return self.orthogonalizer.orthogonalized
