"""torch.compile of each transformer block: the blocks share one shape, so one compiled graph
serves all of them, and the first step's compile cost does not grow with depth."""
from torch import nn


def apply_compile(model: nn.Module, tp_enabled: bool = False) -> None:
    for block in model.layers.values():
        block.compile()
