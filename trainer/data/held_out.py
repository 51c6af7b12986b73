"""The held-out split: a document is held out for evaluation when a hash of its text falls in the
`eval.held_out` share. That depends on nothing but the text, so the same documents are withheld
whatever the seed, the order or the number of ranks, and training skips exactly them."""

import hashlib

from trillion.trainer.config.schema import Eval as EvalConfig


def held_out_fraction(cfg: EvalConfig) -> float:
    """The share of training documents held out: none when evaluation reads a separate set."""
    return 0.0 if cfg.path or cfg.name else cfg.held_out


def is_held_out(text: str, fraction: float) -> bool:
    """Whether this document (its text exactly as the loader reads it) belongs to the held-out split:
    the first 8 bytes of its BLAKE2b digest, read as a fraction of 2**64, fall below `fraction`.
    A pure function of the text, so identical documents always land on the same side."""
    if fraction <= 0.0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * 2.0**64
