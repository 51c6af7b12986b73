"""The planner under document masking and at the attention kernels' real head dims: attention priced at the
share a corpus's document lengths leave (models/flops.py DocumentLengths, measured by `trillion prepare-data`),
against packing simulated window by window; `trillion plan --documents DIR` plans with it and its MFU counts
the masked work."""

import json
import logging

import numpy as np
import pytest

from trillion.models.flops import DocumentLengths
from trillion.models.presets import get_preset
from trillion.parallel.planner.block_cost import layer_passes
from trillion.parallel.planner.hardware import load_profile
from trillion.trainer.data.token_store import MANIFEST, TokenStore, write_store

H100 = load_profile("dgx-h100")
EOS = 200


def packed_share(lengths: np.ndarray, window: int) -> float:
    """Documents joined end to end and cut into windows: the sum of each window's document pieces squared over
    the windows' squares, counted window by window."""
    owner = np.repeat(np.arange(len(lengths)), lengths)
    windows = owner[: len(owner) // window * window].reshape(-1, window)
    pieces = sum(int((np.unique(row, return_counts=True)[1].astype(np.int64) ** 2).sum()) for row in windows)
    return pieces / (len(windows) * window**2)


@pytest.mark.parametrize("window", [256, 2048, 8192])
def test_the_expected_attention_share_matches_packing_window_by_window(window):
    lengths = np.random.default_rng(0).lognormal(6.0, 1.2, 4000).astype(np.int64) + 1  # median ~400, long tail
    expected = DocumentLengths.measure(lengths).attention_share(window)
    assert expected == pytest.approx(packed_share(lengths, window), rel=0.02)


def test_attention_time_follows_the_share():
    args = get_preset("debug")
    whole = layer_passes(args, H100, 2, 1024, 1, False)
    quarter = layer_passes(args, H100, 2, 1024, 1, False, attention_share=0.25)
    none = layer_passes(args, H100, 2, 1024, 1, False, attention_share=0.0)
    assert none.forward < quarter.forward < whole.forward
    assert quarter.forward - none.forward == pytest.approx(0.25 * (whole.forward - none.forward))


def store(path, lengths, recorded=True):
    tokens = np.arange(int(sum(lengths)), dtype=np.uint16) % EOS
    tokens[np.cumsum(lengths) - 1] = EOS  # each document ends with the end-of-document id, as a store opens only so
    write_store(
        path, [(tokens, np.asarray(lengths))], np.dtype(np.uint16), {"held_out": 0.0, "tokenizer": {"eos_id": EOS}}
    )
    if not recorded:  # as a store written before manifests recorded the distribution
        manifest = json.loads((path / MANIFEST).read_text())
        del manifest["document_lengths"]
        (path / MANIFEST).write_text(json.dumps(manifest))
    return path


def test_a_store_gives_its_document_lengths_and_an_older_store_says_it_measures_them(tmp_path, caplog):
    lengths = [5, 900, 30, 4000, 64] * 20
    new = TokenStore(store(tmp_path / "new", lengths)).document_lengths()
    with caplog.at_level(logging.INFO, logger="trillion"):
        old = TokenStore(store(tmp_path / "old", lengths, recorded=False)).document_lengths()
    assert "prepared before token stores recorded their document-length distribution" in caplog.text
    assert old == new and new.documents == 100 and new.tokens == sum(lengths)
    assert TokenStore(tmp_path / "new").document_ids(3, 9).tolist() == [0, 0, 1, 1, 1, 1]


def test_plan_with_documents_prices_masked_attention_and_writes_the_setting(tmp_path, capsys):
    from trillion.trainer.cli.main import main
    from trillion.trainer.config.schema import load_config

    documents = store(tmp_path / "store", [300] * 200)
    plan = ["plan", "--model", "llama3-8b", "--hardware", "dgx-h100", "--gpus", "8", "--global-batch", "64"]
    plan += ["--seq-len", "8192", "--tp", "1", "--pp", "1", "--cp", "1", "--micro-batch-size", "1", "--format", "json"]
    plan += ["--activation-checkpoint", "full"]
    assert main([*plan, "--config-out", ""]) == 0
    whole = json.loads(capsys.readouterr().out)["candidates"][0]
    assert main([*plan, "--documents", str(documents), "--config-out", str(tmp_path / "plan.toml")]) == 0
    masked = json.loads(capsys.readouterr().out)["candidates"][0]
    share = DocumentLengths.measure([300] * 200).attention_share(8192)
    assert masked["attention_share"] == pytest.approx(share) and share < 0.05
    assert masked["step_time_s"] < whole["step_time_s"]  # attention work skipped
    assert masked["mfu"] < masked["tokens_per_s"] / whole["tokens_per_s"] * whole["mfu"]  # MFU counts the masked work
    assert load_config(str(tmp_path / "plan.toml")).data.document_mask
