"""The held-out split does not follow the seed, seen through the data loader and the evaluation set:
at two job.seed values the training loader (build_data_loader) reads exactly the documents that are
not held out (is_held_out), the evaluation set (evaluate.read_eval_windows) exactly those that are,
and so the same documents on each side at both seeds. On the default corpus the seed orders the
documents, and the two seeds are checked to read them in different orders, so the test sees the seed
at work; a local file is read in its own order whatever the seed. Every document carries a unique
marker, found again in the decoded windows. At seed 0 the training order is the evaluation's own
(evaluate.EVAL_ORDER_SEED), which is why one seed could not tell a seeded split from a fixed one.
"""

import dataclasses
import json
import random
import re
import types

import pytest
import torch

from trillion.trainer.config.schema import Data, Eval
from trillion.trainer.data import sources
from trillion.trainer.data.loader import build_data_loader, is_held_out
from trillion.trainer.data.tokenizer import ByteTokenizer
from trillion.trainer.evaluate import EVAL_ORDER_SEED, read_eval_windows

SEEDS = (EVAL_ORDER_SEED, 7)
FRACTION, LANES, SEQ_LEN = 0.25, 3, 31
MARKER = re.compile(r"<doc \d{3}>")
_rng = random.Random(3)
DOCS = [
    f"<doc {i:03d}> " + " ".join(_rng.choices(["alpha", "beta", "gamma", "delta", "x", "y"], k=_rng.randint(3, 12)))
    for i in range(150)
]
HELD = {MARKER.match(d).group() for d in DOCS if is_held_out(d, FRACTION)}
KEPT = {MARKER.match(d).group() for d in DOCS} - HELD


def _markers_in_order(text: str) -> list[str]:
    found = []
    for marker in MARKER.findall(text):
        if marker not in found:
            found.append(marker)
    return found


def training_order(data: Data, seed: int) -> list[str]:
    """The documents the training loader reads over at least one whole epoch of every lane, by their
    markers: lane after lane (window k comes from lane k mod L), each in its order of first appearance."""
    tokenizer = ByteTokenizer()
    train = build_data_loader(
        data, tokenizer, seed=seed, seq_len=SEQ_LEN, global_batch_size=4, micro_batch_size=2, held_out=FRACTION
    )
    tokens = sum(len(tokenizer.encode(d)) + 1 for d in DOCS)
    windows = []
    while len(windows) < LANES * (tokens // (SEQ_LEN + 1) + 2):  # the longest lane holds fewer tokens than all
        windows += [w for x, y in train.next_batch() for w in torch.cat([x, y[:, -1:]], dim=1)]
    order = []
    for lane in range(LANES):
        order += _markers_in_order(tokenizer.decode(torch.cat(windows[lane::LANES]).tolist()))
    return order


def evaluation_documents(data: Data) -> set[str]:
    """The documents of the evaluation set, read whole: one lane and 8-token windows, so the dropped end
    of the last window (under 8 tokens) cannot hold a whole marker of a document longer than that."""
    tokenizer = ByteTokenizer()
    windows, _ = read_eval_windows(
        Eval(held_out=FRACTION, steps=10_000), dataclasses.replace(data, lanes=1), tokenizer, 7, 1
    )
    return set(MARKER.findall(tokenizer.decode(windows.flatten().tolist())))


@pytest.fixture
def local_file(tmp_path) -> Data:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return Data(path=str(path), lanes=LANES)


@pytest.fixture
def default_corpus(tmp_path, monkeypatch) -> Data:
    """The default corpus (data.path empty: the standard library's sources, shuffled by the seed),
    read from a stand-in standard library of one file per document."""
    root = tmp_path / "stdlib"
    for i, text in enumerate(DOCS):
        (root / f"pkg{i % 4}").mkdir(parents=True, exist_ok=True)
        (root / f"pkg{i % 4}" / f"mod{i:03d}.py").write_text(text, encoding="utf-8")
    monkeypatch.setattr(sources, "sysconfig", types.SimpleNamespace(get_paths=lambda: {"stdlib": str(root)}))
    return Data(lanes=LANES)


def _check_split_at_both_seeds(data: Data) -> dict[int, list[str]]:
    assert 20 < len(HELD) < 60 and KEPT  # both sides populated, so the checks can fail either way
    held_out = evaluation_documents(data)
    assert held_out == HELD, "the evaluation set is not the held-out documents"
    orders = {}
    for seed in SEEDS:
        orders[seed] = training_order(data, seed)
        seen = set(orders[seed])
        assert not seen & held_out, f"seed {seed}: training read held-out documents {sorted(seen & held_out)}"
        assert seen == KEPT, f"seed {seed}: training skipped documents that are not held out {sorted(KEPT - seen)}"
    return orders


def test_the_default_corpus_holds_out_the_same_documents_at_every_seed(default_corpus):
    orders = _check_split_at_both_seeds(default_corpus)
    assert orders[SEEDS[0]] != orders[SEEDS[1]], "the seeds read the same order: the test would not see a seed"


def test_a_local_file_holds_out_the_same_documents_at_every_seed(local_file):
    _check_split_at_both_seeds(local_file)
