"""The evaluation set and loss in one process: held-out windows only, fixed, the mean token loss;
too little text is a clear error for a named set and no evaluation for the default share."""

import contextlib
import dataclasses
import json
import logging
import re

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.flags import TINY_BATCH, with_flags
from trillion.errors import ConfigError
from trillion.models import PRESETS, Transformer
from trillion.parallel.dims import ParallelDims
from trillion.trainer.config.schema import load_config
from trillion.trainer.data.loader import is_held_out
from trillion.trainer.data.tokenizer import ByteTokenizer
from trillion.trainer.evaluate import build_evaluator, eval_batch_size

DOCS = [f"<doc {i:03d}> " + "text " * (i % 9 + 3) for i in range(200)]
SMALL = with_flags(TINY_BATCH, "--training.seq_len=16")


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return path


def evaluator(corpus, *extra):
    config = load_config(None, [f"--data.path={corpus}", *SMALL, *extra])
    t = config.training
    return build_evaluator(
        config.eval,
        config.data,
        ByteTokenizer(),
        ParallelDims(world_size=1),
        seq_len=t.seq_len,
        global_batch_size=t.global_batch_size,
        micro_batch_size=2,
        device=torch.device("cpu"),
    )


def dealt(docs, lanes, window=17):
    """The evaluation set's windows as specified: document m to lane m mod L, each lane cut into
    whole windows, then the lanes' windows in turn, a lane leaving when it has none left."""
    tok = ByteTokenizer()
    cut = []
    for j in range(lanes):
        tokens = [t for d in docs[j::lanes] for t in tok.encode(d) + [tok.eos_id]]
        cut.append([tokens[i : i + window] for i in range(0, len(tokens) - window + 1, window)])
    return [lane[i] for i in range(max(map(len, cut))) for lane in cut if i < len(lane)]


@pytest.mark.parametrize("lanes", [1, 8])
def test_the_evaluation_set_is_the_held_out_documents_in_whole_batches(corpus, lanes):
    found = evaluator(corpus, "--eval.held_out=0.3", "--eval.steps=3", f"--data.lanes={lanes}")
    windows = torch.cat([torch.cat(batch) for batch in found.batches])
    assert windows.shape == (3 * 4, 17)
    held = [d for d in DOCS if is_held_out(d, 0.3)]
    assert windows.tolist() == dealt(held, lanes)[: 3 * 4]
    documents = {m for w in windows for m in re.findall(r"<doc \d{3}>", ByteTokenizer().decode(w.tolist()))}
    assert len(documents) == {1: 3, 8: 8}[lanes]  # the 12 windows open 3 documents in one lane, 8 dealt over eight
    # a separate set is read whole, and stops at its end rather than repeat a window
    whole = evaluator(corpus, f"--eval.path={corpus}", "--eval.steps=1000", f"--data.lanes={lanes}")
    assert len(whole.batches) == len(dealt(DOCS, lanes)) // 4
    assert torch.cat([torch.cat(b) for b in whole.batches]).tolist() == dealt(DOCS, lanes)[: len(whole.batches) * 4]


def test_too_little_text(corpus, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trillion"):
        assert evaluator(corpus, "--eval.held_out=0.000001") is None
    assert "no evaluation in this run" in caplog.text and "raise --eval.held_out" in caplog.text
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text(json.dumps({"text": "short"}) + "\n")
    with pytest.raises(ConfigError, match="tiny.jsonl holds less than one evaluation batch"):
        evaluator(corpus, f"--eval.path={tiny}")


def test_pipelined_evaluation_batches_are_training_batches():
    cfg = load_config(None, ["--eval.batch_size=8"]).eval
    assert eval_batch_size(cfg, 16, dp_size=2, micro_batch_size=4, pp=1) == 8
    with pytest.raises(ConfigError, match="under pipelining"):
        eval_batch_size(cfg, 16, dp_size=2, micro_batch_size=4, pp=2)
    with pytest.raises(ConfigError, match="multiple of 12"):
        eval_batch_size(cfg, 24, dp_size=3, micro_batch_size=4, pp=1)


def test_eval_loss_is_the_mean_token_loss_over_the_set(corpus):
    found = evaluator(corpus, "--eval.held_out=0.3", "--eval.steps=3")
    args = dataclasses.replace(PRESETS["debug"], n_layers=1, dim=32, n_heads=4, n_kv_heads=2, max_seq_len=16)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    result = found.evaluate(model, ParallelDims(world_size=1), contextlib.nullcontext())
    windows = torch.cat([torch.cat(batch) for batch in found.batches])
    with torch.no_grad():
        reference = F.cross_entropy(model(windows[:, :-1]).flatten(0, 1), windows[:, 1:].flatten()).item()
    assert result["eval_loss"] == pytest.approx(reference, rel=1e-6)
    assert result["eval_tokens"] == 3 * 4 * 16 and result["eval_ppl"] == pytest.approx(
        torch.tensor(reference).exp().item()
    )
