"""Data: documents and packed windows read on the fly (loader.py), token stores written once (prepare.py,
token_store.py) and read by memory map (prepared.py), tokenizers, and the corpus fingerprint a resume checks."""

from trillion.trainer.data.loader import build_data_loader, build_documents, held_out_fraction, is_held_out
from trillion.trainer.data.tokenizer import ByteTokenizer, build_tokenizer

__all__ = [
    "ByteTokenizer",
    "build_data_loader",
    "build_documents",
    "build_tokenizer",
    "held_out_fraction",
    "is_held_out",
]
