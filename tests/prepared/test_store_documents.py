"""Token stores under document masking: each window's document ids come from the store's document offsets (no
re-tokenizing) and agree with what the on-the-fly packer records for the same stream; `trillion prepare-data`
measures the document-length distribution, keeps it in the manifest and prints it in its summary."""

import torch

from tests.prepared.conftest import store_summaries
from tests.prepared.test_token_store import loader
from trillion.models.flops import DocumentLengths
from trillion.trainer.config.schema import Data
from trillion.trainer.data.token_store import TokenStore


def boundaries_and_positions(batch) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([mb.document_ids for mb in batch])
    return ids[:, 1:] != ids[:, :-1], torch.cat([mb.positions for mb in batch])


def test_store_windows_carry_the_document_starts_the_packer_records(corpus, store):
    documents = {"document_mask": True, "reset_positions": True}
    on_the_fly = loader(Data(path=str(corpus), lanes=1, **documents), seq_len=512)
    prepared = loader(Data(prepared=str(store), shuffle=False, **documents), seq_len=512)
    starts = 0
    for _ in range(10):  # 40k tokens: documents of 2 to 8 kB end in them
        from_store, packed = (
            boundaries_and_positions(prepared.next_batch()),
            boundaries_and_positions(on_the_fly.next_batch()),
        )
        assert torch.equal(from_store[0], packed[0]) and torch.equal(from_store[1], packed[1])
        starts += int(from_store[0].sum())
    assert starts > 0  # the windows hold document boundaries to agree on


def test_prepare_data_measures_and_prints_the_document_lengths(store):
    opened = TokenStore(store)
    lengths = DocumentLengths.from_json(opened.manifest["document_lengths"])
    offsets = opened.documents()
    assert lengths == DocumentLengths.measure(offsets[1:] - offsets[:-1]) and lengths.documents == len(offsets) - 1
    (summary,) = store_summaries
    assert f"document lengths: {lengths.documents} documents, mean" in summary and "2048: " in summary
