"""Layout independence on the default corpus itself (the shuffled standard-library sources, not a
jsonl file, where no shuffle happens): global batch i holds the same windows for 1 and 2
data-parallel ranks, so nothing in the order may depend on the layout."""

import torch

from trillion.trainer.config.schema import Data
from trillion.trainer.data.loader import build_data_loader
from trillion.trainer.data.tokenizer import ByteTokenizer


def global_batches(dp_size: int, count: int = 2) -> list[torch.Tensor]:
    loaders = [
        build_data_loader(
            Data(),
            ByteTokenizer(),
            seed=3,
            seq_len=16,
            global_batch_size=4,
            micro_batch_size=1,
            held_out=0.0,
            dp_rank=rank,
            dp_size=dp_size,
        )
        for rank in range(dp_size)
    ]
    batches = []
    for _ in range(count):  # each rank's micro-batches of inputs, in rank order: the global batch
        batches.append(torch.cat([x for loader in loaders for x, _ in loader.next_batch()]))
    return batches


def test_default_corpus_batches_do_not_depend_on_the_data_parallel_size():
    one = global_batches(1)
    for dp_size in (2,):
        assert all(torch.equal(a, b) for a, b in zip(one, global_batches(dp_size), strict=True)), dp_size
    other_seed = build_data_loader(
        Data(), ByteTokenizer(), seed=4, seq_len=16, global_batch_size=4, micro_batch_size=4, held_out=0.0
    ).next_batch()[0][0]
    assert not torch.equal(one[0], other_seed)  # the seed does shuffle it
