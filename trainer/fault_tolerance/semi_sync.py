"""Semi-synchronous replica groups, for groups joined by slow links: each group trains on its own (its own share
of every batch, no traffic between groups) and every fault_tolerance.sync_steps steps the groups meet through
torchft: DiLoCo (arXiv 2311.08105: the groups' average change since the last meeting, the pseudo-gradient,
taken by an outer Nesterov SGD step from the weights of that meeting) or LocalSGD (the weights averaged).

torchft hooks the optimizer: the meeting runs after the optimizer step that ends each round, with its own
quorum and commit vote; a round that does not commit (a group died in it) is discarded, back to the weights
of the last meeting. A restarted group resumes from its own checkpoint and takes the others' weights, inner
optimizer state and DiLoCo's outer state at its first meeting; its step count and data position stay its own."""

import torch

from trillion.trainer.config.fault_sections import FaultTolerance


class SemiSynchronous:
    """torchft's DiLoCo or LocalSGD around `model` and its (inner) `optimizer`, active from construction to
    `close`."""

    def __init__(self, cfg: FaultTolerance, manager, model: torch.nn.Module, optimizer):
        from torchft import local_sgd

        if cfg.semi_sync_method == "diloco":
            params = [p for p in model.parameters() if p.requires_grad]
            momentum = cfg.outer_momentum
            outer = torch.optim.SGD(params, lr=cfg.outer_lr, momentum=momentum, nesterov=momentum > 0)
            self.method = local_sgd.DiLoCo(manager, [model], optimizer, outer, sync_every=cfg.sync_steps)
        else:
            self.method = local_sgd.LocalSGD(manager, model, optimizer, sync_every=cfg.sync_steps)
        self.method.__enter__()

    def close(self) -> None:
        self.method.__exit__(None, None, None)
