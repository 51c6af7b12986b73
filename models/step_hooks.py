"""Step hooks: what a model part asks of every training step besides its forward and backward.

A part whose layers keep state across steps (the mixture of experts: its auxiliary losses' weight,
its balancing bias, its load statistics) registers a finder here, in its own module
(`@register_step_hooks`). The trainer asks `find_step_hooks(model)` once, when the model is
assembled, and each step calls what it found: `before_step` before the forward, `after_step` after
the optimizer step, `statistics` on a logged step. A model without such parts finds none, so its
loop calls nothing. The finder is registered when its module is imported, and a model holding one
of its layers has imported it.
"""

from collections.abc import Callable

import torch
from torch import nn


class StepHooks:
    """One part's share of a step; each method does nothing unless the part needs it."""

    def before_step(self, token_scale: torch.Tensor) -> None:
        """Before the forward: `token_scale` is one target token's weight in the step's loss (1 / the
        step's target tokens, summed over the ranks holding other tokens, times a gradient scaler's
        scale), a tensor on the device."""

    def after_step(self, sum_over_ranks: Callable[[torch.Tensor], object]) -> None:
        """After the optimizer step: `sum_over_ranks(tensor)` sums a tensor in place over the ranks
        that hold other tokens of the same layers (data-parallel x cp, and the tp ranks where each routes its own
        tokens through the layers). Nothing is read on the host."""

    def statistics(self) -> dict:
        """A logged step's metrics (read on the host), by metric name."""
        return {}


_FINDERS: list[Callable[[nn.Module], list[StepHooks]]] = []


def register_step_hooks(finder: Callable[[nn.Module], list[StepHooks]]):
    """Register `finder(model) -> [StepHooks, ...]` (empty when the model holds none of the part's layers)."""
    _FINDERS.append(finder)
    return finder


def find_step_hooks(model: nn.Module) -> tuple[StepHooks, ...]:
    """The hooks of every registered part in `model` (a whole model or this rank's pipeline stages)."""
    return tuple(hooks for finder in _FINDERS for hooks in finder(model))
