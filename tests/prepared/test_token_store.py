"""Token stores: what prepare-data writes, how ranks read it, the checks, the blend."""

import base64
import json
import logging

import numpy as np
import pytest
import torch

from trillion.errors import ConfigError, RunAborted
from trillion.trainer.cli import prepare_data as prepare_data_cli
from trillion.trainer.config.schema import Data, load_config
from trillion.trainer.data import prepare as prepare_data
from trillion.trainer.data import token_store
from trillion.trainer.data.loader import build_data_loader, is_held_out
from trillion.trainer.data.prepared import WindowPermutation, parse_prepared, read_held_out_windows
from trillion.trainer.data.token_store import TokenStore
from trillion.trainer.data.tokenizer import ByteTokenizer, build_tokenizer


def docs_of(corpus):
    return [json.loads(line)["text"] for line in corpus.read_text().splitlines()]


def loader(data: Data, *, seq_len=32, global_batch=8, micro=2, rank=0, size=1, seed=0, tokenizer=None, held_out=0.01):
    return build_data_loader(
        data,
        tokenizer or ByteTokenizer(),
        seed=seed,
        seq_len=seq_len,
        global_batch_size=global_batch,
        micro_batch_size=micro,
        held_out=held_out,
        dp_rank=rank,
        dp_size=size,
    )


def windows(batch) -> torch.Tensor:
    return torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in batch])


def test_store_holds_the_documents_joined_by_eos(corpus, store):
    tok = ByteTokenizer()
    kept = [d for d in docs_of(corpus) if not is_held_out(d, 0.01)]  # the default eval.held_out
    expected = [t for d in kept for t in tok.encode(d) + [tok.eos_id]]
    opened = TokenStore(store)
    assert opened.dtype == np.uint16 and opened.n_tokens == len(expected)
    assert opened.tokens(0, opened.n_tokens).tolist() == expected
    offsets = opened.documents()
    assert len(offsets) == len(kept) + 1 and opened.tokens(offsets[1] - 1, offsets[1])[0] == tok.eos_id
    assert token_store.token_dtype(128_256) == np.uint32


def test_unshuffled_store_gives_the_on_the_fly_batches(corpus, store):
    """The on-the-fly loader (independent code) packs the same stream: the first epoch agrees (read
    in one lane: data.lanes=1)."""
    on_the_fly = loader(Data(path=str(corpus), lanes=1))
    prepared = loader(Data(prepared=str(store), shuffle=False))
    for _ in range(20):
        assert torch.equal(windows(prepared.next_batch()), windows(on_the_fly.next_batch()))


@pytest.mark.parametrize("size", [2, 4, 8])
def test_global_batch_is_the_same_whatever_the_data_parallel_degree(store, size):
    data = Data(prepared=str(store))
    single = loader(data, seq_len=512)  # ~200 windows: 30 batches of 8 cross an epoch
    ranks = [loader(data, seq_len=512, rank=r, size=size) for r in range(size)]
    for _ in range(30):
        assert torch.equal(windows(single.next_batch()), torch.cat([windows(r.next_batch()) for r in ranks]))


def test_an_epoch_is_a_permutation_of_the_windows_and_epochs_differ(store):
    one = loader(Data(prepared=str(store)), seq_len=512, global_batch=1, micro=1)
    per_epoch = TokenStore(store).n_tokens // 513
    epochs = [[tuple(windows(one.next_batch())[0].tolist()) for _ in range(per_epoch)] for _ in range(2)]
    in_order = [tuple(TokenStore(store).tokens(k * 513, (k + 1) * 513).tolist()) for k in range(per_epoch)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == sorted(in_order)
    assert epochs[0] != in_order and epochs[1] != epochs[0]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 4097])
def test_window_permutation_is_a_seeded_bijection(n):
    index = np.arange(n)
    first, again, other = (WindowPermutation(n, seed)(index) for seed in ((0, 0, 0), (0, 0, 0), (1, 0, 0)))
    assert sorted(first.tolist()) == list(range(n)) and np.array_equal(first, again)
    if n > 3:
        assert not np.array_equal(first, index) and not np.array_equal(first, other)


def test_resume_and_reshard_continue_exactly(store):
    data = Data(prepared=f"{store}:1,{store}:1")  # a blend too: per-source positions are part of the state
    straight = loader(data, seq_len=512)
    expected = [windows(straight.next_batch()) for _ in range(25)]
    first = loader(data, seq_len=512)
    for _ in range(9):
        first.next_batch()
    state = first.state_dict()
    resumed = [loader(data, seq_len=512, rank=r, size=4) for r in range(4)]  # another layout
    for r in resumed:
        r.load_state_dict(state)
    for step in range(9, 25):
        assert torch.equal(torch.cat([windows(r.next_batch()) for r in resumed]), expected[step])


def test_blend_shares_follow_the_weights(tmp_path, corpus, store, caplog):
    """Two stores 0.7 / 0.3: over 500 batches each source's share of the tokens is within 1% of its weight."""
    other_corpus, second = tmp_path / "non_ascii.jsonl", tmp_path / "second.tokens"
    # the second source's text is all non-ASCII (two UTF-8 bytes >= 0x80 a character), so a window tells its source
    other_corpus.write_text(
        "".join(json.dumps({"text": "".join(chr(0x100 + ord(c) % 256) for c in d)}) + "\n" for d in docs_of(corpus))
    )
    prepare_data.prepare(load_config(None, [f"--data.path={other_corpus}"]), second, workers=1)
    with caplog.at_level(logging.INFO, logger="trillion"):
        blend = loader(Data(prepared=f"{store}:0.7,{second}:0.3"), seq_len=64, global_batch=16, micro=16)
    assert "weight 70.0% of the samples" in caplog.text and "weight 30.0% of the samples" in caplog.text
    counts = np.zeros(2)
    for _ in range(500):
        for window in windows(blend.next_batch()):
            counts[int(bool((window >= 0x80).all()))] += len(window)
    assert abs(counts[0] / counts.sum() - 0.7) < 0.01 and abs(counts[1] / counts.sum() - 0.3) < 0.01
    assert blend.shares() == pytest.approx([0.7, 0.3], abs=1e-3)
    with caplog.at_level(logging.INFO, logger="trillion"):
        blend.state_dict()  # at every checkpoint
    assert "8000 samples so far, shares stdlib.tokens 70.00%, second.tokens 30.00%" in caplog.text


def test_a_store_of_another_tokenizer_is_refused_naming_both(tmp_path, store):
    ranks = tmp_path / "bytes.tiktoken"
    ranks.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    from trillion.trainer.config.schema import Tokenizer

    other = build_tokenizer(Tokenizer(kind="tiktoken", path=str(ranks)))
    with pytest.raises(
        ConfigError, match=r"tokenized with byte \(257 ids.*this run's tokenizer is tiktoken .*bytes.tiktoken"
    ):
        loader(Data(prepared=str(store)), tokenizer=other)


def _copy(store, tmp_path):
    import shutil

    return shutil.copytree(store, tmp_path / "copy.tokens")


def test_truncated_or_edited_stores_are_detected(tmp_path, store):
    copy = _copy(store, tmp_path)
    size = (copy / "tokens.bin").stat().st_size
    with open(copy / "tokens.bin", "r+b") as f:
        f.truncate(size - 2)
    with pytest.raises(ConfigError, match="tokens.bin holds .* bytes where the manifest says .*truncated"):
        TokenStore(copy)
    with open(copy / "tokens.bin", "r+b") as f:  # the right size again, one token changed
        f.seek(size - 2)
        f.write(b"\x01\x00")
    with pytest.raises(ConfigError, match="do not match their hash"):  # sizes right: the last chunk is always checked
        TokenStore(copy)
    with open(copy / "tokens.bin", "r+b") as f:
        f.seek(size - 2)
        f.write(b"\x00\x01")
    (copy / "documents.npy").write_bytes((copy / "documents.npy").read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(ConfigError, match="documents.npy does not match the sha256"):
        TokenStore(copy)


def test_verify_finds_an_edit_in_any_chunk(tmp_path, corpus, monkeypatch, caplog):
    monkeypatch.setattr(token_store, "CHUNK_BYTES", 4096)  # 2048 tokens a chunk: many chunks
    out = tmp_path / "small-chunks.tokens"
    prepare_data.prepare(load_config(None, [f"--data.path={corpus}"]), out, workers=1)
    with caplog.at_level(logging.INFO, logger="trillion"):
        assert prepare_data_cli.main(["--verify", str(out)]) == 0
    assert "match their hashes" in caplog.text
    with open(out / "tokens.bin", "r+b") as f:
        f.seek(4096 * 3 + 10)
        f.write(b"\x07\x00")
    with pytest.raises(RunAborted, match="tokens 6144 to 8192 of tokens.bin do not match"):
        prepare_data_cli.main(["--verify", str(out)])


def test_interrupted_prepare_resumes_and_never_leaves_out_half_written(tmp_path, corpus, store, monkeypatch, caplog):
    out = tmp_path / "resumed.tokens"
    calls, tokenize = [], prepare_data._tokenize_shard

    def dies_on_the_third(index):
        calls.append(index)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return tokenize(index)

    monkeypatch.setattr(prepare_data, "_tokenize_shard", dies_on_the_third)
    config = load_config(None, [f"--data.path={corpus}"])
    with pytest.raises(KeyboardInterrupt):
        prepare_data.prepare(config, out, workers=1)
    assert not out.exists()
    with pytest.raises(ConfigError, match="no manifest.json .*rerun the same command"):
        TokenStore(out)
    monkeypatch.setattr(prepare_data, "_tokenize_shard", tokenize)
    with caplog.at_level(logging.INFO, logger="trillion"):
        prepare_data.prepare(config, out, workers=1)
    assert "2 of 7 shards already tokenized" in caplog.text
    assert (out / "tokens.bin").read_bytes() == (store / "tokens.bin").read_bytes()  # = 2 workers, uninterrupted
    assert not out.with_name(out.name + ".staging").exists()
    with pytest.raises(ConfigError, match="already exists and holds a token store"):
        prepare_data.prepare(config, out, workers=1)


@pytest.mark.parametrize(
    "spec, message", [("a:0", "positive weight"), ("a:-1", "positive weight"), ("/nowhere", "not a token store")]
)
def test_bad_prepared_settings_are_refused(spec, message):
    with pytest.raises(ConfigError, match=message):
        loader(Data(prepared=spec))


def test_prepared_with_a_path_is_refused(store, corpus):
    with pytest.raises(ConfigError, match="data.prepared=.*data.path are both set"):
        loader(Data(prepared=str(store), path=str(corpus)))
    assert parse_prepared(f"{store}:0.25,{store}") == [(str(store), 0.25), (str(store), 1.0)]


def test_held_out_documents_are_excluded_exactly_and_readable_for_evaluation(tmp_path, corpus):
    """eval.held_out=0.3: the store holds exactly the documents is_held_out rejects, held_out/ the others."""
    out, tok = tmp_path / "split.tokens", ByteTokenizer()
    prepare_data.prepare(load_config(None, [f"--data.path={corpus}", "--eval.held_out=0.3"]), out, workers=1)
    held = [d for d in docs_of(corpus) if is_held_out(d, 0.3)]
    kept = [d for d in docs_of(corpus) if not is_held_out(d, 0.3)]
    assert held and kept
    for path, docs in ((out, kept), (out / "held_out", held)):
        opened = TokenStore(path)
        offsets = opened.documents()
        texts = [tok.decode(opened.tokens(a, b - 1).tolist()) for a, b in zip(offsets[:-1], offsets[1:])]
        assert texts == docs
    stream = [t for d in held for t in tok.encode(d) + [tok.eos_id]]
    assert read_held_out_windows(Data(prepared=str(out), lanes=1), tok, 31, 3)[0].flatten().tolist() == stream[:96]
    # dealt over lanes, the evaluation set from the store is the on-the-fly one (same documents, same order)
    from trillion.trainer.config.schema import Eval
    from trillion.trainer.evaluate import read_eval_windows

    dealt, dealt_ids = read_eval_windows(Eval(held_out=0.3, steps=3), Data(prepared=str(out), lanes=3), tok, 31, 4)
    assert dealt.shape == (12, 32) and not torch.equal(dealt.flatten(), torch.tensor(stream[: 12 * 32]))
    read = read_eval_windows(Eval(held_out=0.3, steps=3), Data(path=str(corpus), lanes=3), tok, 31, 4)
    assert torch.equal(dealt, read[0]) and torch.equal(dealt_ids, read[1])  # the same documents, the same ids
    on_the_fly = loader(Data(path=str(corpus), lanes=1), held_out=0.3)  # the loader's own split agrees
    prepared = loader(Data(prepared=str(out), shuffle=False), held_out=0.3)
    assert torch.equal(windows(prepared.next_batch()), windows(on_the_fly.next_batch()))
    with pytest.raises(ConfigError, match=r"holding out eval.held_out=0.3 .* this run holds out 0.01"):
        loader(Data(prepared=str(out)))
