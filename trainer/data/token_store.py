"""A token store: a corpus tokenized once (`trillion prepare-data`), read by memory map.

    DIR/tokens.bin      every document's tokens followed by the end-of-document id, one flat array
                        (uint16 when the vocabulary fits, else uint32)
    DIR/documents.npy   int64 offsets: document d is tokens[offsets[d]:offsets[d + 1]] (EOS included)
    DIR/chunks.sha256   the sha256 of each `chunk_bytes` piece of tokens.bin, 32 bytes each
    DIR/manifest.json   format, dtype, counts, the tokenizer's identity, the source, the held-out
                        share, the document-length distribution (models/flops.py DocumentLengths), sizes
                        and hashes
    DIR/held_out/       the documents held out for evaluation, a store of the same form

The manifest is written last and the directory published by one rename, so a store that exists is
whole. Opening one checks every file's size (a truncated store), the hashes of the small files and
of a sample of token chunks (the first, the last and a few more chosen by the reader's seed, so
the data-parallel ranks together check different ones): a few MiB per rank, so a rank's cost stays
its windows. Every chunk is checked by `trillion prepare-data --verify DIR`.

The document offsets are where each window's documents start (data.document_mask, data.reset_positions:
`document_ids`), without re-tokenizing; every store has them. Opening checks them whole (one per document
and one more, 0 to n_tokens, increasing) and against the tokens of the checked chunks (each document ending there
ends with the end-of-document id); --verify checks every document's end. A store written before the manifest
recorded the length distribution has it measured from them when asked (`document_lengths`, which says so).
"""

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from trillion.errors import ConfigError, RunAborted
from trillion.models.flops import DocumentLengths

log = logging.getLogger("trillion")
FORMAT, VERSION = "trillion-token-store", 1
CHUNK_BYTES = 1 << 20
SAMPLED_CHUNKS = 8  # checked at open besides the first and the last
TOKENS, DOCUMENTS, CHUNKS, MANIFEST = "tokens.bin", "documents.npy", "chunks.sha256", "manifest.json"
HELD_OUT = "held_out"  # the sub-store of the documents held out for evaluation


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def tokenizer_identity(tokenizer) -> dict:
    """What makes two tokenizers give the same ids: kind, the hash of its file, vocabulary, EOS."""
    return {
        "kind": tokenizer.kind,
        "source": tokenizer.source,
        "sha256": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
    }


def describe_tokenizer(identity: dict) -> str:
    where = f" {identity['source']}" if identity["source"] else ""
    digest = f", sha256 {identity['sha256'][:12]}" if identity["sha256"] else ""
    return f"{identity['kind']}{where} ({identity['vocab_size']} ids, EOS {identity['eos_id']}{digest})"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def write_store(out: Path, token_parts, dtype: np.dtype, manifest: dict) -> dict:
    """Write a store into the (empty, staging) folder `out` from `token_parts`, an iterable of
    (tokens, document lengths) arrays in order; returns the manifest, written last."""
    out.mkdir(parents=True, exist_ok=True)
    offsets, n_tokens, pending = [np.zeros(1, np.int64)], 0, b""
    with open(out / TOKENS, "wb") as tokens_file, open(out / CHUNKS, "wb") as chunks_file:
        for tokens, lengths in token_parts:
            data = np.ascontiguousarray(tokens, dtype=dtype).tobytes()
            tokens_file.write(data)
            offsets.append(n_tokens + np.cumsum(lengths, dtype=np.int64))
            n_tokens += len(tokens)
            pending += data
            whole = len(pending) - len(pending) % CHUNK_BYTES
            for start in range(0, whole, CHUNK_BYTES):
                chunks_file.write(hashlib.sha256(pending[start : start + CHUNK_BYTES]).digest())
            pending = pending[whole:]
        if pending:
            chunks_file.write(hashlib.sha256(pending).digest())
        for f in (tokens_file, chunks_file):
            f.flush()
            os.fsync(f.fileno())
    offsets = np.concatenate(offsets)
    np.save(out / DOCUMENTS, offsets)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype.name,
        "n_tokens": int(n_tokens),
        "n_documents": len(offsets) - 1,
        "chunk_bytes": CHUNK_BYTES,
        "document_lengths": DocumentLengths.measure(np.diff(offsets)).to_json(),
        **manifest,
        "files": {
            name: {"bytes": (out / name).stat().st_size, "sha256": file_sha256(out / name)}
            for name in (DOCUMENTS, CHUNKS)
        }
        | {TOKENS: {"bytes": (out / TOKENS).stat().st_size}},
    }
    staged = out / (MANIFEST + ".tmp")
    staged.write_text(json.dumps(manifest, indent=1))
    os.replace(staged, out / MANIFEST)
    return manifest


class TokenStore:
    """One store, opened for reading: `tokens(start, stop)` and `documents()`. `setting` names the
    config setting that pointed here, for the messages; `sample_seed` picks the chunks checked
    (None: none, for a caller that checks them all)."""

    def __init__(self, path: str | Path, setting: str = "data.prepared", sample_seed: int | None = 0):
        self.path, self.setting = Path(path), setting
        manifest_file = self.path / MANIFEST
        if not manifest_file.is_file():
            hint = (
                " (an interrupted prepare-data left its work in the .staging folder beside it: rerun the same "
                "command to finish)"
                if self.path.with_name(self.path.name + ".staging").is_dir()
                else ""
            )
            raise ConfigError(
                f"{setting}={str(self.path)!r} is not a token store: it has no {MANIFEST}{hint}. {self._write_one()}"
            )
        try:
            self.manifest = json.loads(manifest_file.read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"{setting}={str(self.path)!r}: {MANIFEST} is not valid JSON ({error}); the store was "
                "edited or damaged. Prepare it again with `trillion prepare-data`."
            ) from None
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != VERSION:
            raise ConfigError(
                f"{setting}={str(self.path)!r}: {MANIFEST} is not a version-{VERSION} token store "
                f"(format {self.manifest.get('format')!r}, version {self.manifest.get('version')!r}). "
                "Prepare it again with this version's `trillion prepare-data`."
            )
        self._check_files()
        self.dtype = np.dtype(self.manifest["dtype"])
        self.n_tokens = self.manifest["n_tokens"]
        self.chunk_tokens = self.manifest["chunk_bytes"] // self.dtype.itemsize
        self._chunk_hashes = (self.path / CHUNKS).read_bytes()
        self._offsets = None
        self.n_chunks = len(self._chunk_hashes) // 32
        self._tokens = (
            np.memmap(self.path / TOKENS, dtype=self.dtype, mode="r") if self.n_tokens else np.zeros(0, self.dtype)
        )
        self._check_offsets()
        if self.n_chunks and sample_seed is not None:
            self._check_sample(np.random.default_rng(sample_seed))

    def _write_one(self) -> str:
        """A prepare-data command that works here: it refuses an existing --out, so not this folder if it exists."""
        settings = "with the run's data and tokenizer settings"
        if not self.path.exists():
            return f"Write one with `trillion prepare-data --out {self.path}` {settings}."
        fresh = self.path.with_name(self.path.name + "-tokens")
        return (
            f"Write one into a new folder with `trillion prepare-data --out {fresh}` {settings} and set "
            f"{self.setting} to it (prepare-data does not write into an existing folder such as {self.path})."
        )

    def _check_sample(self, rng) -> None:
        sample = sorted({0, self.n_chunks - 1, *rng.choice(self.n_chunks, min(SAMPLED_CHUNKS, self.n_chunks), False)})
        if bad := self.damaged_chunks(sample):
            raise ConfigError(f"{self.describe_chunks(bad)}. Prepare it again with `trillion prepare-data`.")
        if problem := self.misplaced_ends(sample):
            raise ConfigError(problem)

    def _check_offsets(self) -> None:
        """The document offsets as a store writes them (their file's hash may have been updated with an edit):
        one per document and one more, from 0 to n_tokens, each document at least its end-of-document id long.
        Masking and positions read them: a wrong one would train silently wrong."""
        offsets = self.documents()
        expected = self.manifest["n_documents"] + 1
        problem = None
        if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or len(offsets) != expected:
            problem = f"holds {offsets.dtype} of shape {offsets.shape} where {expected} integer offsets belong"
        elif offsets[0] != 0 or offsets[-1] != self.n_tokens:
            problem = f"runs from {offsets[0]} to {offsets[-1]}, not from 0 to the {self.n_tokens} tokens"
        elif len(empty := np.flatnonzero(np.diff(offsets) <= 0)):
            d = int(empty[0])
            problem = (
                f"goes from {offsets[d]} back to {offsets[d + 1]} at document {d}"
                if offsets[d + 1] < offsets[d]
                else f"gives document {d} no tokens (offset {offsets[d]} twice)"
            )
        if problem:
            raise ConfigError(self._offsets_message(f"{DOCUMENTS} {problem}"))

    def misplaced_ends(self, chunks) -> str | None:
        """Whether every document that ends inside `chunks` (whose tokens match their hashes) ends with the
        end-of-document id: the offsets agree with the tokens they cut. None, or the message."""
        offsets, size, eos = self.documents(), self.chunk_tokens, self.tokenizer["eos_id"]
        for chunk in chunks:
            first, last = np.searchsorted(offsets, [chunk * size + 1, (chunk + 1) * size + 1])
            ends = np.asarray(offsets[first:last]) - 1  # the last token of each document ending in this chunk
            if len(wrong := ends[self._tokens[ends] != eos]):
                return self._offsets_message(
                    f"{DOCUMENTS} ends a document at token {int(wrong[0])} (chunk {chunk} of {TOKENS}), which is "
                    f"{int(self._tokens[wrong[0]])}, not the end-of-document id {eos}"
                )
        return None

    def _offsets_message(self, problem: str) -> str:
        return (
            f"{self.setting}={str(self.path)!r}: {problem}; the document offsets were edited or damaged (document "
            "masking and positions read them). Prepare the store again with `trillion prepare-data`."
        )

    def _check_files(self) -> None:
        for name, expected in self.manifest["files"].items():
            file = self.path / name
            size = file.stat().st_size if file.is_file() else None
            if size != expected["bytes"]:
                state = (
                    "is missing" if size is None else f"holds {size} bytes where the manifest says {expected['bytes']}"
                )
                raise ConfigError(
                    f"{self.setting}={str(self.path)!r}: {name} {state}; the store is truncated or was "
                    "edited. Prepare it again with `trillion prepare-data`."
                )
            if "sha256" in expected and file_sha256(file) != expected["sha256"]:
                raise ConfigError(
                    f"{self.setting}={str(self.path)!r}: {name} does not match the sha256 in the manifest; "
                    "the store was edited or damaged. Prepare it again with `trillion prepare-data`."
                )

    @property
    def tokenizer(self) -> dict:
        return self.manifest["tokenizer"]

    def check_tokenizer(self, tokenizer) -> None:
        """Refuse a store written by another tokenizer, naming both."""
        mine, theirs = tokenizer_identity(tokenizer), self.tokenizer
        if {k: mine[k] for k in ("kind", "sha256", "vocab_size", "eos_id")} != {
            k: theirs[k] for k in ("kind", "sha256", "vocab_size", "eos_id")
        }:
            raise ConfigError(
                f"{self.setting}={str(self.path)!r} was tokenized with {describe_tokenizer(theirs)}, but "
                f"this run's tokenizer is {describe_tokenizer(mine)}. Set the run's tokenizer.kind / "
                "tokenizer.path to the store's, or prepare the data again with this run's tokenizer."
            )

    def damaged_chunks(self, chunks) -> list[int]:
        """The chunks among `chunks` whose tokens do not match their hash."""
        size = self.chunk_tokens
        return [
            c
            for c in chunks
            if hashlib.sha256(self._tokens[c * size : (c + 1) * size].tobytes()).digest()
            != self._chunk_hashes[32 * c : 32 * c + 32]
        ]

    def describe_chunks(self, chunks: list[int]) -> str:
        ranges = ", ".join(
            f"{c * self.chunk_tokens} to {min((c + 1) * self.chunk_tokens, self.n_tokens)}" for c in chunks[:5]
        )
        more = f" and {len(chunks) - 5} more chunks" if len(chunks) > 5 else ""
        return (
            f"{self.setting}={str(self.path)!r}: tokens {ranges}{more} of {TOKENS} do not match their hash in "
            f"{CHUNKS}; the store was edited or damaged"
        )

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """tokens[start:stop] as int64, read from the memory map. Only a sample of chunks is checked at
        open, so each read is bounded by the store's vocabulary here, on the host before the batch reaches
        a device: one max over tokens already in memory, no device sync, and damage is named by its chunk
        instead of an IndexError (a device-side assert on a GPU) from the embedding."""
        window = self._tokens[start:stop]
        if len(window) and int(window.max()) >= self.tokenizer["vocab_size"]:
            self._out_of_vocabulary(start, window)
        return window.astype(np.int64)

    def _out_of_vocabulary(self, start: int, window: np.ndarray) -> None:
        at = start + int(np.argmax(window >= self.tokenizer["vocab_size"]))
        chunk = at // self.chunk_tokens
        raise RunAborted(
            f"{self.setting}={str(self.path)!r}: token {at} (chunk {chunk} of {TOKENS}) is {int(window.max())}, "
            f"outside the store's vocabulary of {self.tokenizer['vocab_size']} ids; the store was edited or "
            f"damaged. Check every chunk with `trillion prepare-data --verify {self.path}` and prepare it again."
        )

    def documents(self) -> np.ndarray:
        """Offsets of the documents (n_documents + 1), checked when the store was opened."""
        if self._offsets is None:
            self._offsets = np.load(self.path / DOCUMENTS, mmap_mode="r")
        return self._offsets

    def document_ids(self, start: int, stop: int) -> np.ndarray:
        """The document of each of tokens[start:stop], numbered as the store's documents (non-decreasing)."""
        return np.searchsorted(self.documents(), np.arange(start, stop), side="right") - 1

    def document_lengths(self) -> DocumentLengths:
        """The store's document-length distribution: from its manifest, or measured from its offsets."""
        if "document_lengths" in self.manifest:
            return DocumentLengths.from_json(self.manifest["document_lengths"])
        log.info(
            "%s=%s was prepared before token stores recorded their document-length distribution: measuring it from "
            "its %d document offsets",
            self.setting,
            self.path,
            self.manifest["n_documents"],
        )
        return DocumentLengths.measure(np.diff(self.documents()))
