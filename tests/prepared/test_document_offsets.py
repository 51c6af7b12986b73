"""A token store's document offsets are checked on open, even when an edit updated their checksum in the
manifest: one per document from 0 to the store's tokens, increasing, and every document that ends in a checked
chunk ending with the end-of-document id; `prepare-data --verify` checks the ends in every chunk. A wrong offset
would otherwise mask documents and restart positions silently wrong."""

import json
import re
import shutil

import numpy as np
import pytest

from tests.helpers import flags
from tests.helpers.fault_record import report
from trillion.errors import RunAborted
from trillion.trainer.cli import prepare_data as prepare_data_cli
from trillion.trainer.cli.main import main
from trillion.trainer.config.schema import load_config
from trillion.trainer.data import prepare as prepare_data
from trillion.trainer.data import token_store
from trillion.trainer.data.token_store import DOCUMENTS, MANIFEST, TokenStore, file_sha256


def rewrite_offsets(store, edit) -> np.ndarray:
    """documents.npy edited by `edit` (offsets -> offsets), its size and sha256 in the manifest updated to match,
    as a careful hand edit would leave it."""
    offsets = edit(np.load(store / DOCUMENTS).copy())
    np.save(store / DOCUMENTS, offsets)
    manifest = json.loads((store / MANIFEST).read_text())
    manifest["files"][DOCUMENTS] = {
        "bytes": (store / DOCUMENTS).stat().st_size,
        "sha256": file_sha256(store / DOCUMENTS),
    }
    (store / MANIFEST).write_text(json.dumps(manifest))
    return offsets


def swap(offsets, d):
    offsets[d], offsets[d + 1] = offsets[d + 1], offsets[d]
    return offsets


def past_the_end(offsets):
    offsets[-1] += 100
    return offsets


def off_by_one(offsets):
    offsets[1] += 1  # the first document's end, in chunk 0, which every open checks
    return offsets


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda o: swap(o, 3), "goes from .* back to .* at document 3"),
        (past_the_end, "runs from 0 to .*, not from 0 to the .* tokens"),
        (lambda o: o[:-1], "where .* integer offsets belong"),
        (off_by_one, "ends a document at token .* \\(chunk 0 of tokens.bin\\), which is .*, not the end-of-document"),
    ],
)
def test_edited_offsets_with_their_checksum_updated_exit_2_naming_the_file(edit, named, tmp_path, store, capsys):
    copy = shutil.copytree(store, tmp_path / "edited.tokens")
    rewrite_offsets(copy, edit)
    run = tmp_path / "run"
    status = main(["train", *flags.TINY, "--training.steps=2", f"--data.prepared={copy}", f"--job.output_dir={run}"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    message = next(line for line in err.splitlines() if DOCUMENTS in line)
    assert f"data.prepared={str(copy)!r}: {DOCUMENTS}" in message and "prepare-data" in message
    assert re.search(named, message), message
    assert not (run / "metrics.jsonl").exists()  # refused before any work
    if edit is past_the_end:
        report(
            "edited document offsets (checksum updated)",
            message.replace(str(tmp_path), "<dir>") + " (exit 2)",
            None,
            None,
            None,
            "the last offset of documents.npy moved past the store's tokens and its size and sha256 in the manifest "
            "updated (before: the run trained with exit 0, masking silently wrong)",
        )


def test_verify_finds_a_document_end_moved_in_any_chunk(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr(token_store, "CHUNK_BYTES", 4096)  # 2048 tokens a chunk: many, most not sampled on open
    out = tmp_path / "small-chunks.tokens"
    prepare_data.prepare(load_config(None, [f"--data.path={corpus}"]), out, workers=1)
    assert prepare_data_cli.main(["--verify", str(out)]) == 0
    offsets, chunks = np.load(out / DOCUMENTS), TokenStore(out).n_chunks
    rng = np.random.default_rng(0)  # the chunks an open checks (sample_seed 0), as TokenStore draws them
    sampled = {0, chunks - 1, *rng.choice(chunks, token_store.SAMPLED_CHUNKS, False).tolist()}
    d = next(d for d in range(1, len(offsets) - 1) if (offsets[d] - 2) // 2048 not in sampled)
    chunk = (offsets[d] - 2) // 2048  # where document d - 1 will end: one token earlier, not on its EOS

    def earlier(o):
        o[d] -= 1
        return o

    rewrite_offsets(out, earlier)
    TokenStore(out)  # opening checks the offsets' shape and order, and the ends in the sampled chunks only
    with pytest.raises(RunAborted, match=rf"{DOCUMENTS} ends a document at token {offsets[d] - 2} \(chunk {chunk} "):
        prepare_data_cli.main(["--verify", str(out)])
