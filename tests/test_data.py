"""Data: packing, layout independence, exact resume, local datasets and tokenizer files."""

import base64
import json

import pytest
import torch

from trillion.trainer.config.schema import Data, Tokenizer
from trillion.trainer.data.loader import build_data_loader
from trillion.trainer.data.tokenizer import ByteTokenizer, build_tokenizer

DOCS = [f"document {i}: " + " ".join(["word"] * (i % 7 + 1)) for i in range(40)]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    return path


def loader(path, *, seq_len=16, global_batch=4, micro=2, rank=0, size=1, tokenizer=None, lanes=1):
    """lanes=1: one document after another, the packing itself (tests/test_data_lanes.py: several)."""
    return build_data_loader(
        Data(path=str(path), lanes=lanes),
        tokenizer or ByteTokenizer(),
        seed=0,
        seq_len=seq_len,
        global_batch_size=global_batch,
        micro_batch_size=micro,
        held_out=0.0,
        dp_rank=rank,
        dp_size=size,
    )


def stream_of(docs):
    tok = ByteTokenizer()
    return [t for d in docs for t in tok.encode(d) + [tok.eos_id]]


def test_windows_pack_documents_joined_by_eos(jsonl):
    batch = loader(jsonl, seq_len=16, global_batch=4, micro=4).next_batch()
    ((inputs, labels),) = batch
    assert inputs.shape == labels.shape == (4, 16)
    windows = torch.cat([inputs, labels[:, -1:]], dim=1)  # seq_len + 1 tokens per window
    assert torch.equal(labels[:, :-1], inputs[:, 1:])
    assert windows.flatten().tolist() == stream_of(DOCS)[: 4 * 17]


@pytest.mark.parametrize("lanes", [1, 3, 8])
def test_global_batch_is_the_same_whatever_the_data_parallel_degree(jsonl, lanes):
    single = loader(jsonl, global_batch=8, micro=2, lanes=lanes)
    ranks = [loader(jsonl, global_batch=8, micro=2, rank=r, size=4, lanes=lanes) for r in range(4)]
    for _ in range(5):
        whole = torch.cat([x for x, _ in single.next_batch()])
        split = torch.cat([x for r in ranks for x, _ in r.next_batch()])
        assert torch.equal(whole, split)


@pytest.mark.parametrize("lanes", [1, 3])
def test_resume_continues_exactly_across_epochs(jsonl, lanes):
    """40 short documents hold about 70 windows of 17: 30 batches of 4 wrap around (every lane) at
    least once. With 3 lanes the 11th batch ends inside a turn (44 windows: lane 2 is next)."""
    straight = loader(jsonl, lanes=lanes)
    expected = [straight.next_batch() for _ in range(30)]
    first = loader(jsonl, lanes=lanes)
    for _ in range(11):
        first.next_batch()
    resumed = loader(jsonl, lanes=lanes)
    resumed.load_state_dict(first.state_dict())
    for step in range(11, 30):
        for (x, y), (ex, ey) in zip(resumed.next_batch(), expected[step], strict=True):
            assert torch.equal(x, ex) and torch.equal(y, ey)
    epochs = resumed.state_dict()["epoch"]
    assert min(epochs) >= 1 if lanes > 1 else epochs >= 1


@pytest.mark.parametrize("kind", ["txt", "parquet"])
def test_other_local_formats(tmp_path, kind):
    if kind == "txt":
        path = tmp_path / "corpus.txt"
        path.write_text("\n\n".join(DOCS))
    else:
        import datasets

        path = tmp_path / "corpus.parquet"
        datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(path))
    ((x, _),) = loader(path, micro=4).next_batch()
    assert x[0].tolist() == stream_of(DOCS)[:16] and x[1].tolist() == stream_of(DOCS)[17:33]


def test_folder_of_files(tmp_path, jsonl):
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "b.jsonl").write_text(jsonl.read_text())
    (folder / "a.jsonl").write_text(json.dumps({"text": "first", "id": -1}) + "\n")
    ((x, _),) = loader(folder, micro=4).next_batch()
    assert x[0, :6].tolist() == stream_of(["first"])[:6]


def test_default_corpus_is_python_source():
    tok = ByteTokenizer()
    batch = build_data_loader(
        Data(), tok, seed=0, seq_len=512, global_batch_size=2, micro_batch_size=2, held_out=0.0
    ).next_batch()
    text = tok.decode(batch[0][0][0].tolist())
    assert any(keyword in text for keyword in ("def ", "import ", "class ", "return"))


def test_hf_tokenizer_json(tmp_path, jsonl):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = build_tokenizer(Tokenizer_config("hf", tmp_path / "tokenizer.json"))
    assert hf.eos_id == tok.token_to_id("<|endoftext|>")
    ((x, _),) = loader(jsonl, micro=4, tokenizer=hf).next_batch()
    assert (x == hf.eos_id).any()
    assert hf.decode(hf.encode(DOCS[3])).strip() == DOCS[3]


def test_tiktoken_ranks_file(tmp_path):
    ranks = tmp_path / "bytes.tiktoken"
    ranks.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    tok = build_tokenizer(Tokenizer_config("tiktoken", ranks))
    assert tok.vocab_size == 257 and tok.eos_id == 256
    assert tok.encode("hé") == list("hé".encode()) and tok.decode(tok.encode("hé")) == "hé"


def Tokenizer_config(kind, path):
    return Tokenizer(kind=kind, path=str(path))


def test_files_that_disagree_on_columns_are_a_clear_error(tmp_path, jsonl):
    from trillion.errors import ConfigError

    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    (folder / "b.jsonl").write_text(jsonl.read_text())
    with pytest.raises(ConfigError, match="data.path=.*columns"):
        loader(folder)
