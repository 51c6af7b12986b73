"""The held-out split: chosen by a hash of each document's text, withheld from training exactly."""

import json
import random

import pytest
import torch

from trillion.trainer.config.schema import Data, Eval
from trillion.trainer.data.loader import build_data_loader, default_corpus_files, held_out_fraction, is_held_out
from trillion.trainer.data.tokenizer import ByteTokenizer

# Each document carries a unique marker; a few are repeated verbatim (duplicates go to one side).
DOCS = [f"<doc {i:03d}> " + "lorem ipsum " * (i % 5 + 1) for i in range(120)] + ["same text"] * 3


def stream_of(docs):
    tok = ByteTokenizer()
    return [t for d in docs for t in tok.encode(d) + [tok.eos_id]]


def test_the_hash_is_pinned():
    """Prepared token stores (trillion prepare-data) exclude the same documents by this function:
    changing it would silently move documents between the splits of existing stores."""
    assert [is_held_out(f"document {i}", 0.5) for i in range(8)] == [True, True, True, False, False, False, True, True]
    assert not is_held_out("anything", 0.0) and is_held_out("anything", 1.0)


def test_share_held_out_matches_the_fraction():
    rng = random.Random(1)
    texts = ["".join(rng.choices("abcdefgh ", k=40)) for _ in range(20000)]
    assert sum(is_held_out(t, 0.1) for t in texts) / len(texts) == pytest.approx(0.1, abs=0.01)


def test_separate_eval_set_holds_nothing_back():
    assert held_out_fraction(Eval(held_out=0.05)) == 0.05
    assert held_out_fraction(Eval(held_out=0.05, path="val.jsonl")) == 0.0
    assert held_out_fraction(Eval(held_out=0.05, name="org/dataset")) == 0.0


@pytest.mark.parametrize("dp_size,lanes", [(1, 1), (2, 1), (1, 8), (2, 3)])
def test_no_held_out_document_reaches_a_training_batch(tmp_path, dp_size, lanes):
    """A whole epoch of training batches, gathered over the data-parallel ranks and split into the
    lanes they interleave (window k: lane k mod L), is exactly each lane's kept documents in order:
    every held-out document is missing, every other one is there."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    fraction = 0.3
    held = [d for d in DOCS if is_held_out(d, fraction)]
    kept = [d for d in DOCS if not is_held_out(d, fraction)]
    assert 20 < len(held) < 60 and kept  # both sides populated, so the test can fail either way
    loaders = [
        build_data_loader(
            Data(path=str(path), lanes=lanes),
            ByteTokenizer(),
            seed=0,
            seq_len=31,
            global_batch_size=4,
            micro_batch_size=2,
            held_out=fraction,
            dp_rank=r,
            dp_size=dp_size,
        )
        for r in range(dp_size)
    ]
    expected = [stream_of([d for d in DOCS[j::lanes] if not is_held_out(d, fraction)]) for j in range(lanes)]
    windows = []
    while min(len(windows[j::lanes]) for j in range(lanes)) * 32 < max(map(len, expected)):
        windows += [w for loader in loaders for x, y in loader.next_batch() for w in torch.cat([x, y[:, -1:]], dim=1)]
    seen = []
    for j in range(lanes):
        tokens = torch.cat(windows[j::lanes]).tolist()
        assert tokens[: len(expected[j])] == expected[j], j
        seen += tokens[: len(expected[j])]
    assert sorted(seen) == sorted(stream_of(kept))  # the lanes together: every kept document once
    text = ByteTokenizer().decode(seen)
    assert not [d for d in held if d.split(">")[0] + ">" in text]


def test_default_corpus_split_is_seed_independent():
    """Same held-out files whatever the seed (the seed only orders the corpus), about 1% of them."""

    def held(seed):
        return {
            str(p)
            for p in default_corpus_files(seed)
            if is_held_out(p.read_text(encoding="utf-8", errors="replace"), Eval().held_out)
        }

    first, second = held(0), held(1)
    assert first == second
    assert 0.003 < len(first) / len(default_corpus_files(0)) < 0.03


def test_changing_the_split_refuses_to_resume(tmp_path):
    from trillion.errors import ConfigError
    from trillion.trainer.checkpoint.resume_check import check_resume_config, settings
    from trillion.trainer.config.schema import load_config, to_toml

    current = settings(to_toml(load_config()))

    saved = {"eval.held_out": 0.01, "eval.path": "", "eval.name": "", "eval.interval": 50, "data.lanes": 8}
    check_resume_config({**saved, "eval.interval": 10}, current, tmp_path)  # how often: no new run
    with pytest.raises(ConfigError, match=r"eval.held_out was 0.02 there .* \(which documents training skips\)"):
        check_resume_config({**saved, "eval.held_out": 0.02}, current, tmp_path)
