"""Data: documents (sources.py) packed into windows (windows.py) and batched (loader.py), token stores written
once (prepare.py, token_store.py) and memory-mapped (prepared.py), tokenizers, the corpus fingerprint."""

from trillion.trainer.data.held_out import held_out_fraction, is_held_out
from trillion.trainer.data.loader import build_data_loader
from trillion.trainer.data.sources import build_documents
from trillion.trainer.data.tokenizer import ByteTokenizer, build_tokenizer

__all__ = [
    "ByteTokenizer",
    "build_data_loader",
    "build_documents",
    "build_tokenizer",
    "held_out_fraction",
    "is_held_out",
]
