"""An id outside the vocabulary in a chunk the open-time sample does not check is caught when a
batch reads it: a one-paragraph exit naming the store, the chunk and `prepare-data --verify`, not an
IndexError from the embedding (a device-side assert on a GPU)."""

import numpy as np

from tests.helpers import flags
from tests.helpers.fault_record import report
from trillion.trainer.cli.main import main
from trillion.trainer.config.schema import load_config
from trillion.trainer.data import prepare as prepare_data
from trillion.trainer.data import token_store

CHUNK_TOKENS = 256
WINDOW_TOKENS = 4 * 33  # flags.TINY: four windows of seq_len + 1 a step, read in file order


def test_an_out_of_vocabulary_id_in_an_unchecked_chunk_exits_naming_it(tmp_path, corpus, monkeypatch, capsys):
    monkeypatch.setattr(token_store, "CHUNK_BYTES", 2 * CHUNK_TOKENS)  # uint16 tokens: many small chunks
    out = tmp_path / "small-chunks.tokens"
    prepare_data.prepare(load_config(None, [f"--data.path={corpus}"]), out, workers=1)
    store = token_store.TokenStore(out)
    sampled = np.random.default_rng(0).choice(store.n_chunks, token_store.SAMPLED_CHUNKS, replace=False)
    chunk = min(set(range(1, store.n_chunks - 1)) - set(sampled.tolist()))  # not checked when the run opens it
    at = chunk * CHUNK_TOKENS + 5
    tokens = np.memmap(out / "tokens.bin", dtype=np.uint16, mode="r+")
    tokens[at] = 60_000  # a byte-level store: ids below 300
    tokens.flush()
    del tokens
    steps = at // WINDOW_TOKENS + 3
    status = main(
        [
            "train",
            *flags.TINY,
            f"--training.steps={steps}",
            "--data.shuffle=false",
            f"--data.prepared={out}",
            f"--job.output_dir={tmp_path / 'run'}",
        ]
    )
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err and "IndexError" not in err
    message = next(line for line in err.splitlines() if "outside the store's vocabulary" in line)
    assert f"chunk {chunk} of tokens.bin" in message and str(out) in message
    assert f"prepare-data --verify {out}" in message
    report(
        "an out-of-vocabulary id in an unchecked token-store chunk",
        message.replace(str(tmp_path), "<dir>"),
        None,
        None,
        None,
        "the batch that reads it stops the run, exit 1",
    )
