"""A model parallelized in one process as the trainer would (parallel/parallelize.py with a layout's settings: a
checkpointing mode, float8, ...), materialized on the CPU with a seed's weights: for tests that compare what one
setting changes in a forward and backward."""

import torch

from trillion.models import Transformer
from trillion.models.args import ModelArgs
from trillion.parallel.dims import ParallelDims
from trillion.parallel.parallelize import parallelize


def parallelized_model(args: ModelArgs, seed: int = 3, **layout) -> Transformer:
    """`args`' model under `layout` (Layout's fields, ParallelDims.of), on the CPU with `seed`'s weights."""
    with torch.device("meta"):
        model = Transformer(args)
    parallelize(model, ParallelDims.of(**layout))
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model
