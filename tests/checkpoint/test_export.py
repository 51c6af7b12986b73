"""`trillion export` writes what transformers loads with our logits, for both families, and
`--checkpoint.initial_load` takes that folder (or a step directory) back, bit for bit."""

import pytest
import torch

from tests.helpers.fault_record import report
from tests.helpers.runs import FAMILIES, run, trained_and_exported
from trillion.trainer.checkpoint.export import load_checkpoint_model
from trillion.trainer.checkpoint.state import ModelParts, load_model_weights
from trillion.trainer.cli.main import main

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_loads_in_transformers_with_the_same_logits_and_imports_back(family, tmp_path, capsys):
    source, out = trained_and_exported(tmp_path, family)
    assert "model.safetensors" in capsys.readouterr().out

    ours = load_checkpoint_model(source / "checkpoints" / "step-00000002").eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, ours.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, atol=2e-5, rtol=1e-4)

    # import: the HF folder and the step directory give exactly the trained weights
    for path in (out, source / "checkpoints" / "step-00000002"):
        fresh = load_checkpoint_model(source / "checkpoints" / "step-00000002")
        with torch.no_grad():
            for param in fresh.parameters():
                param.zero_()
        load_model_weights(path, [fresh], fresh.args, "--checkpoint.initial_load")
        expected = ModelParts([ours]).state_dict()
        for name, tensor in ModelParts([fresh]).state_dict().items():
            assert torch.equal(tensor, expected[name]), (path, name)


def test_training_starts_from_exported_weights(tmp_path):
    source = tmp_path / "source"
    run(source, steps=2)
    assert main(["export", "--checkpoint", str(source / "checkpoints"), "--format", "hf", str(tmp_path / "hf")]) == 0
    started = tmp_path / "started"  # lr 0: the first step leaves the loaded weights as they are
    run(started, f"--checkpoint.initial_load={tmp_path / 'hf'}", "--optimizer.lr=0", steps=1)
    trained = ModelParts([load_checkpoint_model(source / "checkpoints" / "step-00000002")]).state_dict()
    loaded = ModelParts([load_checkpoint_model(started / "checkpoints" / "step-00000001")]).state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in trained.items())


def test_export_errors_name_the_fix(tmp_path, capsys):
    assert main(["export", "--checkpoint", str(tmp_path), "--format", "hf", str(tmp_path / "out")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert main(["export", "--checkpoint", str(tmp_path), "--format", "gguf", str(tmp_path / "out")]) == 2
    assert "--format 'gguf'" in capsys.readouterr().err


class Forced:
    """A logits processor that makes `generate` choose `tokens` in turn, whatever the weights say."""

    def __init__(self, prompt_length: int, tokens: list[int]):
        self.prompt_length, self.tokens = prompt_length, tokens

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, -float("inf"))
        forced[:, self.tokens[input_ids.shape[1] - self.prompt_length]] = 0.0
        return forced


@pytest.mark.parametrize("family", list(FAMILIES))
def test_exported_generate_stops_at_the_runs_end_of_document_id(family, tmp_path):
    """The byte tokenizer ends each document with 256; transformers' config defaults (bos 0 / eos 1, or 2) would
    stop generation on a byte instead (GPT-2's 50256 is outside this vocabulary)."""
    _, out = trained_and_exported(tmp_path, family)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert (model.config.bos_token_id, model.config.eos_token_id) == (256, 256)
    prompt = torch.tensor([[104, 105]])
    chosen = [0, 1, 2, 256, 97, 98]  # bytes 0-2 (the defaults' ids), then the end of a document
    output = model.generate(
        prompt,
        max_new_tokens=len(chosen),
        do_sample=False,
        logits_processor=transformers.LogitsProcessorList([Forced(prompt.shape[1], chosen)]),
    )
    assert output[0, prompt.shape[1] :].tolist() == [0, 1, 2, 256]  # on past the bytes, stopped at the end
    if family == "llama":
        report(
            "export's end-of-document id",
            "config.json of the exported folder: bos_token_id 256, eos_token_id 256 (the byte tokenizer's end of "
            "document); transformers' generate stops there and not on bytes 0-2",
            None,
            None,
            None,
            "a 2-step run exported, generate forced through bytes 0, 1, 2, then 256 (before: eos_token_id 1 or 2 from "
            "transformers' defaults, and generate stopped on that byte)",
        )
