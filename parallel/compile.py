"""torch.compile of each transformer block: the blocks share one shape, so one compiled graph
serves all of them, and the first step's compile cost does not grow with depth.

Composition with tensor parallelism (measured with torch 2.13, parity-tested in
tests/distributed): a compiled block must receive and return DTensors. When the tensor-parallel
plan handed plain local tensors across the block boundary, the compiled backward returned a plain
gradient into DTensor's eager redistribute (a crash: 'Tensor' object has no attribute
'_local_tensor') or, under FSDP, a wrong gradient for the embedding. tensor_parallel.py therefore
keeps the residual stream a DTensor between blocks; with that, per-block compile matches eager in
every layout tested, so no layout needs the whole-model fallback.

The blocks are compiled in place (`Module.compile`), so parameter names do not change, and
FSDP's hooks, registered afterwards on the same modules, stay outside the compiled graphs.
"""

from torch import nn


def apply_compile(model: nn.Module, backend: str = "inductor") -> None:
    for block in model.layers.values():
        block.compile(backend=backend)
