"""`trillion prepare-data` (trainer/cli/prepare_data.py): tokenize a corpus once, in parallel, into a
token store (trainer/data/token_store.py) that `trillion train --data.prepared=DIR` reads by memory map.

It reads any source `trillion train` reads (data.path, data.name, or the embedded default corpus)
with the same tokenizer settings. The documents are cut into shards of consecutive documents;
worker processes tokenize shards and each finished shard is published in DIR.staging/ by a rename,
so an interrupted run, started again with the same command, tokenizes only the shards left. The
shards are then joined, in document order, into the store, whose manifest is written last, and
the store becomes DIR by one rename: DIR never exists half-written.

The documents of the evaluation split (`is_held_out` with eval.held_out, as the on-the-fly loader
decides) are left out of the store exactly and kept in DIR/held_out/, a store of its own, which
evaluation reads (`prepared_loader.read_held_out_windows`).
"""

import ctypes
import dataclasses
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from trillion.errors import ConfigError, Interrupted, RunAborted
from trillion.models.flops import DocumentLengths
from trillion.trainer.config.checks import creatable_problem
from trillion.trainer.data.held_out import held_out_fraction, is_held_out
from trillion.trainer.data.sources import build_documents
from trillion.trainer.data.token_store import (
    HELD_OUT,
    MANIFEST,
    TokenStore,
    token_dtype,
    tokenizer_identity,
    write_store,
)
from trillion.trainer.data.tokenizer import build_tokenizer

log = logging.getLogger("trillion")
SHARDS_PER_WORKER = 8  # enough shards to balance the workers and resume at a fine grain
MAX_SHARD_DOCUMENTS = 10_000


def source_of(data, seed: int) -> dict:
    """What the store was made from, for its manifest (the default corpus's order depends on the seed)."""
    if data.path or data.name:
        return {k: getattr(data, k) for k in ("path", "name", "config_name", "split", "text_field")}
    return {"default_corpus": "the Python standard library's sources", "seed": seed}


def prepare(config, out: Path, workers: int) -> dict:
    """Write the store; returns its manifest with the run's `seconds` and `workers` added."""
    start = time.perf_counter()
    data = dataclasses.replace(config.data, streaming=False)  # shards need the number of documents
    if data.prepared:
        raise ConfigError(
            "data.prepared names stores to train from; prepare-data reads data.path or data.name (or "
            "the default corpus). Drop --data.prepared."
        )
    check_out(out)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: --workers sets the parallelism
    tokenizer = build_tokenizer(config.tokenizer)
    documents = build_documents(data, config.job.seed)
    shard_documents = max(1, min(MAX_SHARD_DOCUMENTS, -(-len(documents) // (workers * SHARDS_PER_WORKER))))
    held_out = held_out_fraction(config.eval)
    plan = {
        "source": source_of(data, config.job.seed),
        "tokenizer": tokenizer_identity(tokenizer),
        "held_out": held_out,
        "n_source_documents": len(documents),
        "shard_documents": shard_documents,
    }
    staging = _staging(out, plan)
    shards = range(-(-len(documents) // shard_documents))
    todo = [i for i in shards if not _shard_file(staging, i).is_file()]
    if len(todo) < len(shards):
        log.info(
            "prepare-data: resuming %s, %d of %d shards already tokenized",
            staging,
            len(shards) - len(todo),
            len(shards),
        )
    _tokenize_shards((documents, tokenizer, held_out, staging, shard_documents), shards, todo, workers)
    store, dtype = staging / "store", token_dtype(tokenizer.vocab_size)
    shutil.rmtree(store, ignore_errors=True)  # a join interrupted earlier
    if held_out:  # inside the store, written before its manifest: published with it
        write_store(
            store / HELD_OUT,
            (_load_shard(staging, i, "held_out_") for i in shards),
            dtype,
            {**plan, "split": "held_out"},
        )
    with _Progress(len(shards), 0, "join shards") as progress:  # one sequential copy: long for large corpora
        manifest = write_store(store, _joined(staging, shards, progress), dtype, {**plan, "split": "train"})
    if manifest["n_documents"] == 0:
        source = getattr(documents, "source", "The dataset")
        raise ConfigError(
            f"{source} holds no text: every document is empty (or held out for evaluation, see eval.held_out). "
            "Check data.path or data.name and data.text_field."
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(store, out)
    shutil.rmtree(staging)
    seconds = time.perf_counter() - start
    log.info(
        "prepare-data: %s holds %d tokens of %d documents (%s), %.1f s with %d workers: %.0f tokens/s",
        out,
        manifest["n_tokens"],
        manifest["n_documents"],
        manifest["dtype"],
        seconds,
        workers,
        manifest["n_tokens"] / seconds,
    )
    # what the planner prices document-masked attention with (trillion plan --documents DIR)
    log.info("prepare-data: document lengths: %s", DocumentLengths.from_json(manifest["document_lengths"]).describe())
    return {**manifest, "seconds": seconds, "workers": workers}


def check_out(out: Path) -> None:
    """--out must not exist, and its folder must take the store and its .staging sibling: checked
    before any work, so a bad --out costs no tokenizing. Nothing is created here."""
    if out.exists():
        what = "is a file" if out.is_file() else "holds a token store" if (out / MANIFEST).is_file() else "holds files"
        raise ConfigError(f"--out {out} already exists and {what}. Remove it or give another --out.")
    if problem := creatable_problem(out):
        raise ConfigError(
            f"--out {out} cannot be created: {problem}. Give an --out in a folder this user can create and write."
        )


def _tokenize_shards(job: tuple, shards: range, todo: list[int], workers: int) -> None:
    """Tokenize the shards not yet in staging, in `workers` processes; each finished shard is kept."""
    staging = job[3]
    with _Progress(len(shards), len(shards) - len(todo), "tokenize shards") as progress:
        try:
            if workers == 1:
                _init_worker(*job)
                for i in todo:
                    progress.advance(_tokenize_shard(i))
            else:
                # fork: workers start in milliseconds, without re-importing torch, and inherit the opened
                # documents and tokenizer; the parent has run no tokenizer or torch threads (tokenizers'
                # parallelism is off), which is what makes fork safe
                context = multiprocessing.get_context("fork")
                with context.Pool(workers, initializer=_init_pool_worker, initargs=(os.getpid(), *job)) as pool:
                    for tokens in pool.imap_unordered(_tokenize_shard, todo):
                        progress.advance(tokens)
        except KeyboardInterrupt:  # the pool's exit has stopped the workers; finished shards are kept
            raise Interrupted(
                f"interrupted (Ctrl-C) with {progress.done} of {len(shards)} shards tokenized, kept in {staging}: "
                "the same command resumes from them."
            ) from None


def verify(path: Path) -> None:
    """Check every chunk of the store and its held-out part, with progress; RunAborted names the damaged ones."""
    for where in (path, path / HELD_OUT):
        if where != path and not where.is_dir():
            continue
        store = TokenStore(where, setting="--verify", sample_seed=None)
        bad = []
        with _Progress(store.n_chunks, 0, "verify chunks") as progress:
            for chunk in range(store.n_chunks):
                bad += store.damaged_chunks([chunk])
                progress.advance(min(store.chunk_tokens, store.n_tokens - chunk * store.chunk_tokens))
        if bad:
            raise RunAborted(f"{store.describe_chunks(bad)}. Prepare it again with `trillion prepare-data`.")
        if problem := store.misplaced_ends(range(store.n_chunks)):
            raise RunAborted(problem)
        log.info(
            "prepare-data --verify: %s, all %d chunks (%d tokens) match their hashes and every document ends with "
            "the end-of-document id",
            where,
            store.n_chunks,
            store.n_tokens,
        )


def _staging(out: Path, plan: dict) -> Path:
    """DIR.staging/, kept from an interrupted run of the same plan, started afresh otherwise."""
    staging = out.with_name(out.name + ".staging")
    plan_file = staging / "plan.json"
    if staging.exists() and (not plan_file.is_file() or json.loads(plan_file.read_text()) != plan):
        log.info("prepare-data: %s was left by a run with other settings; starting afresh", staging)
        shutil.rmtree(staging)
    if not staging.exists():
        staging.mkdir(parents=True)
        plan_file.write_text(json.dumps(plan, indent=1))
    return staging


def _shard_file(staging: Path, index: int) -> Path:
    return staging / f"shard-{index:06d}.npz"


def _load_shard(staging: Path, index: int, split: str = "") -> tuple[np.ndarray, np.ndarray]:
    with np.load(_shard_file(staging, index)) as shard:
        return shard[split + "tokens"], shard[split + "lengths"]


def _joined(staging: Path, shards: range, progress):
    for index in shards:
        tokens, lengths = _load_shard(staging, index)
        yield tokens, lengths
        progress.advance(len(tokens))


_WORKER = {}


def _init_pool_worker(parent: int, *job) -> None:
    """A pool worker: Ctrl-C (sent to the whole process group) is the parent's to handle, which then
    stops the pool; and a worker whose parent is killed ends at once, quietly, instead of finishing its
    shard and failing to send the result (a BrokenPipeError traceback per worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _exit_with_parent(parent)
    _init_worker(*job)


def _exit_with_parent(parent: int) -> None:
    """SIGTERM (its default action: the process ends, no traceback) when `parent` dies: the kernel's
    PR_SET_PDEATHSIG on Linux, a watching thread elsewhere."""
    if sys.platform.startswith("linux"):
        try:
            set_death_signal = ctypes.c_int(1), ctypes.c_ulong(signal.SIGTERM)  # PR_SET_PDEATHSIG, the signal
            if ctypes.CDLL(None, use_errno=True).prctl(*set_death_signal, *[ctypes.c_ulong(0)] * 3) == 0:
                if os.getppid() != parent:  # it died before the call
                    os._exit(0)
                return
        except (OSError, AttributeError):
            pass
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(0)


def _init_worker(documents, tokenizer, held_out, staging, shard_documents) -> None:
    _WORKER.update(
        documents=documents,
        tokenizer=tokenizer,
        held_out=held_out,
        staging=staging,
        shard_documents=shard_documents,
        dtype=token_dtype(tokenizer.vocab_size),
    )


def _tokenize_shard(index: int) -> int:
    """Tokenize one shard and publish it: the training documents and, apart, the held-out ones (by
    `is_held_out` of the text as the loader reads it); empty documents dropped, as the loader does."""
    w = _WORKER
    tokenizer, size = w["tokenizer"], w["shard_documents"]
    splits = {"": ([], []), "held_out_": ([], [])}
    for text in w["documents"].iterate(index * size, min((index + 1) * size, len(w["documents"]))):
        ids = tokenizer.encode(text)
        if ids:
            ids.append(tokenizer.eos_id)
            pieces, lengths = splits["held_out_" if is_held_out(text, w["held_out"]) else ""]
            pieces.append(np.asarray(ids, dtype=w["dtype"]))
            lengths.append(len(ids))
    arrays = {}
    for split, (pieces, lengths) in splits.items():
        arrays[split + "tokens"] = np.concatenate(pieces) if pieces else np.zeros(0, w["dtype"])
        arrays[split + "lengths"] = np.asarray(lengths, dtype=np.int64)
    final = _shard_file(w["staging"], index)
    staged = final.with_suffix(".tmp.npz")
    np.savez(staged, **arrays)
    os.replace(staged, final)
    return len(arrays["tokens"]) + len(arrays["held_out_tokens"])


class _Progress:
    """A live bar on a terminal; a log line every tenth of the work elsewhere."""

    def __init__(self, total: int, done: int, what: str):
        self.total, self.done, self.tokens, self.start, self.what = total, done, 0, time.perf_counter(), what
        self.logged_tenths = done * 10 // max(total, 1)
        self.bar = None
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn(what),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeRemainingColumn(),
            )
            self.task = self.bar.add_task("tokenize", total=total, completed=done, rate="")

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def advance(self, tokens: int) -> None:
        self.done, self.tokens = self.done + 1, self.tokens + tokens
        rate = f"{self.tokens / (time.perf_counter() - self.start):,.0f} tokens/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done, rate=rate)
        elif self.done * 10 // self.total > self.logged_tenths:
            self.logged_tenths = self.done * 10 // self.total
            log.info("prepare-data: %s %d/%d, %s", self.what, self.done, self.total, rate)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
