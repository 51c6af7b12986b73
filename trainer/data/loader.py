"""The training stream: packed windows (windows.py) of documents (sources.py), minus the held-out
ones (held_out.py), or token stores (prepared.py) -> this rank's micro-batches.

Layout independence (docs/ARCHITECTURE.md): global batch i is windows [i*G, (i+1)*G) of one token
stream, whatever the parallel layout; data-parallel rank r of D takes the r-th contiguous slice of
G/D windows. Every rank packs the whole stream, which keeps that guarantee simple and exact; the
price is tokenizing D times, which is small next to a training step.

The names of the files beside it are importable from here too, as they were when this file held them.
"""

import os

from trillion.trainer.config.schema import Data as DataConfig
from trillion.trainer.data.documents import window_micro_batches
from trillion.trainer.data.held_out import held_out_fraction, is_held_out
from trillion.trainer.data.prepared import build_prepared_loader
from trillion.trainer.data.sources import HFDocuments, build_documents, default_corpus_files
from trillion.trainer.data.windows import LanedWindows, dealt_windows, lane_count, token_documents

__all__ = [
    "DataLoader",
    "HFDocuments",
    "build_data_loader",
    "build_documents",
    "dealt_windows",
    "default_corpus_files",
    "held_out_fraction",
    "is_held_out",
    "token_documents",
]


class DataLoader:
    """Yields, per optimizer step, this data-parallel rank's micro-batches as (inputs, labels), with their
    document ids or positions (forward_backward.MicroBatch) under data.document_mask or data.reset_positions."""

    def __init__(
        self,
        windows: LanedWindows,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        *,
        mask: bool = False,
        reset: bool = False,
    ):
        self.windows = windows
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.local = global_batch_size // dp_size
        self.dp_rank = dp_rank
        self.mask, self.reset = mask, reset

    def next_batch(self) -> list:
        mine = slice(self.dp_rank * self.local, (self.dp_rank + 1) * self.local)
        if self.mask or self.reset:
            batch, ids = self.windows.next_windows_with_documents(self.global_batch_size)
            ids = ids[mine]
        else:
            batch, ids = self.windows.next_windows(self.global_batch_size), None
        return window_micro_batches(batch[mine], ids, self.micro_batch_size, mask=self.mask, reset=self.reset)

    def state_dict(self) -> dict:
        return self.windows.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.windows.load_state_dict(state)


def build_data_loader(
    cfg: DataConfig,
    tokenizer,
    *,
    seed: int,
    seq_len: int,
    global_batch_size: int,
    micro_batch_size: int,
    held_out: float,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> DataLoader:
    """The training stream; `held_out` (held_out_fraction of the eval section) is the share it skips."""
    if cfg.prepared:
        return build_prepared_loader(
            cfg,
            tokenizer,
            seed=seed,
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            held_out=held_out,
            dp_rank=dp_rank,
            dp_size=dp_size,
        )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    documents = build_documents(cfg, seed)
    windows = LanedWindows(
        documents,
        tokenizer,
        seq_len + 1,
        keep=lambda text: not is_held_out(text, held_out),
        lanes=lane_count(documents, cfg.lanes),
        setting=cfg.lanes,
    )
    return DataLoader(
        windows,
        global_batch_size,
        micro_batch_size,
        dp_rank,
        dp_size,
        mask=cfg.document_mask,
        reset=cfg.reset_positions,
    )
