"""Document masking end to end on one process: a packed window computes each of its documents as that document
alone would be computed (an independent reference: the documents run one by one), the packer and the token
stores give each window's document ids, the batch carries them, evaluation masks as a setting says, the FLOP
count follows the masked work, and the settings' errors."""

import dataclasses

import pytest
import torch

from tests.helpers.documentation import documentation_text
from trillion.errors import ConfigError
from trillion.models import Transformer, get_preset
from trillion.models.flops import model_flops_per_token
from trillion.parallel.forward_backward import MicroBatch
from trillion.trainer.data.documents import attention_share, positions_in_documents, window_micro_batches
from trillion.trainer.data.tokenizer import ByteTokenizer
from trillion.trainer.data.windows import LanedWindows


def small(name: str, **changes):
    args = get_preset(name)
    shape = dict(n_layers=2, dim=64, n_heads=4, vocab_size=128, max_seq_len=64)
    return dataclasses.replace(args, **shape, **changes)


def packed_and_alone(args, lengths):
    """(the packed window's logits with masking and positions restarting, each document's logits alone)."""
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(seed=3)
    tokens = torch.randint(0, args.vocab_size, (1, sum(lengths)))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    with torch.no_grad():
        packed = model(tokens, positions=positions_in_documents(ids), document_ids=ids)
        alone = torch.cat([model(piece) for piece in tokens.split(lengths, dim=1)], dim=1)
    return packed, alone


@pytest.mark.parametrize(
    "name, impl", [("debug", "sdpa"), ("debug-gpt", "eager"), ("debug-deepseek", "sdpa"), ("debug", "triton")]
)
def test_a_packed_window_computes_each_document_as_if_it_were_alone(name, impl):
    changes = {"mtp_modules": 0} if name == "debug-deepseek" else {}
    packed, alone = packed_and_alone(small(name, attention_impl=impl, **changes), [1, 17, 3, 40, 3])
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=2e-5)


def test_without_the_mask_a_packed_window_sees_the_documents_before():
    args = small("debug")
    packed, alone = packed_and_alone(args, [20, 44])
    assert (packed - alone).abs().max() < 2e-5
    model = Transformer(args)
    model.init_weights(seed=3)
    tokens = torch.randint(0, args.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0] * 20 + [1] * 44])
    with torch.no_grad():
        masked, plain = model(tokens, document_ids=ids), model(tokens)
    assert torch.equal(masked[:, :20], plain[:, :20]) and not torch.allclose(masked[:, 20:], plain[:, 20:])


class Texts:
    """Documents as a corpus reader gives them."""

    def __init__(self, texts):
        self.texts = texts

    def count(self):
        return len(self.texts)

    def iterate(self, start, stop=None, step=1):
        return iter(self.texts[start:stop:step])


@pytest.mark.parametrize("lanes", [1, 3])
def test_the_packer_records_where_each_document_starts_in_every_window(lanes):
    tokenizer = ByteTokenizer()
    texts = Texts([f"document {i}: " + "x" * (i * 7 % 23) for i in range(12)])
    windows = LanedWindows(texts, tokenizer, 17, lanes=lanes)
    tokens, ids = windows.next_windows_with_documents(9)
    after_eos = torch.zeros_like(tokens, dtype=torch.bool)
    after_eos[:, 1:] = tokens[:, :-1] == tokenizer.eos_id  # a document ends with EOS: the next one starts after
    assert torch.equal(ids[:, 1:] != ids[:, :-1], after_eos[:, 1:])
    assert (ids[:, 1:] >= ids[:, :-1]).all()
    fresh = LanedWindows(texts, tokenizer, 17, lanes=lanes)
    assert torch.equal(fresh.next_windows(9), tokens)  # the same stream with or without the ids


def test_the_batch_carries_the_inputs_document_ids_and_positions():
    windows = torch.arange(2 * 9).view(2, 9)
    ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 6]])
    (batch,) = window_micro_batches(windows, ids, 2, mask=True, reset=True)
    inputs, labels = batch
    assert (
        isinstance(batch, MicroBatch) and torch.equal(inputs, windows[:, :-1]) and torch.equal(labels, windows[:, 1:])
    )
    assert torch.equal(batch.document_ids, ids[:, :-1])
    assert batch.positions.tolist() == [[0, 1, 0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]]
    (plain,) = window_micro_batches(windows, ids, 2, mask=False, reset=False)
    assert type(plain) is tuple  # nothing to carry: the pair as it always was


def test_attention_share_is_the_documents_squares_over_the_windows():
    ids = torch.tensor([[0, 0, 0, 1], [3, 3, 3, 3]])
    assert attention_share(ids) == pytest.approx((9 + 1 + 16) / (2 * 16))
    args = small("debug")
    whole, masked = model_flops_per_token(args, 1024), model_flops_per_token(args, 1024, 0.25)
    no_attention = model_flops_per_token(args, 1024, 0.0)
    assert no_attention < masked < whole and masked - no_attention == pytest.approx(0.25 * (whole - no_attention))


def test_an_attention_that_cannot_mask_documents_is_refused_naming_the_fix():
    from trillion.models import parts
    from trillion.models.parts import (
        ATTENTION_KINDS,
        AttentionKind,
        AttentionSettings,
        PartSettings,
        register_attention,
    )

    def masking(on: bool) -> PartSettings:
        return PartSettings("debug", attention=AttentionSettings(document_mask=on))

    register_attention("blind", AttentionKind(parts.gqa.declare, "trillion.models.attention:Attention"))
    try:
        args = dataclasses.replace(small("debug"), attention="blind")
        with pytest.raises(
            ConfigError,
            match=r"data.document_mask=true.*'blind' cannot mask documents.*"
            r"--data.document_mask=false.*\(gqa, mla\)",
        ):
            parts.apply_settings(args, masking(True))
        assert parts.apply_settings(args, masking(False)) == args
    finally:
        del ATTENTION_KINDS["blind"]
        parts.block.cache_clear()


def test_trillion_train_masks_documents_and_counts_the_masked_work(tmp_path):
    """The data guide's `trillion train --data.document_mask=true`, in small: on the default corpus (each source file a
    document: most are longer than a window, so few windows hold a boundary) it trains and evaluates, masked in
    evaluation too; on short documents the logged attention share is below 1 and the FLOP count follows it."""
    import json

    from tests.helpers.runs import run

    masked = ["--data.document_mask=true", "--data.reset_positions=true", "--eval.interval=2", "--eval.steps=1"]
    result = run(tmp_path / "default", *masked, steps=2)
    assert result["attention_share"] <= 1.0 and "eval_loss" in result
    corpus = tmp_path / "short.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " + "ab" * (i % 9)}) + "\n" for i in range(400)))
    short = run(tmp_path / "short", *masked, f"--data.path={corpus}", "--metrics.peak_tflops=1", steps=2)
    plain = run(tmp_path / "plain", f"--data.path={corpus}", "--metrics.peak_tflops=1", steps=2)
    assert 0 < short["attention_share"] < 0.9 and plain["attention_share"] == 1.0
    assert short["tflops"] / short["tokens_per_s"] < plain["tflops"] / plain["tokens_per_s"]  # FLOPs per token


def test_evaluation_masks_as_its_setting_says():
    from trillion.trainer.config.schema import Data, Eval

    assert Eval().masks_documents(Data(document_mask=True)) and not Eval().masks_documents(Data())
    assert Eval(document_mask="masked").masks_documents(Data()) and not Eval(document_mask="unmasked").masks_documents(
        Data(document_mask=True)
    )


@pytest.mark.slow
def test_the_guide_s_masked_default_run_logs_the_held_out_losses_it_states(tmp_path):
    """`trillion train --training.steps=200 --data.document_mask=true` as a user types it: the held-out losses
    the data guide sets beside the unmasked default run's (to 0.05, for another CPU's rounding)."""
    import json
    import os
    import re
    import subprocess
    import sys

    out = tmp_path / "masked"
    command = ["train", "--training.steps=200", "--data.document_mask=true", f"--job.output_dir={out}"]
    result = subprocess.run(
        [sys.executable, "-m", "trillion", *command],
        capture_output=True,
        text=True,
        timeout=3600,
        env={**os.environ, "WANDB_MODE": "offline"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    losses = [record["eval_loss"] for record in map(json.loads, lines) if "eval_loss" in record]
    text = documentation_text()
    stated = re.search(
        r"`trillion train --training.steps=200 --data.document_mask=true`\): held-out loss (\d\.\d\d) at step 0, "
        r"(\d\.\d\d) at 50, (\d\.\d\d) at 100, (\d\.\d\d) at 150 and (\d\.\d\d) at step 200",
        text,
    )
    assert stated, "the documentation's sentence on the masked run moved"
    assert all(abs(float(s) - loss) < 0.05 for s, loss in zip(stated.groups(), losses)), (stated.groups(), losses)
