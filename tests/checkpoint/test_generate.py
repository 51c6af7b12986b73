"""`trillion generate`: the KV cache gives the logits of a full forward; greedy tokens equal transformers'
greedy generation of the exported model for both families; sampling is seeded; errors name the fix."""

import dataclasses
import io

import pytest
import torch

from tests.helpers.runs import FAMILIES, run, trained_and_exported
from trillion.models import PRESETS, Transformer
from trillion.models.kv_cache import KVCache
from trillion.trainer.cli.generate import Sampling, generate, load_for_generation, next_token, stream_text
from trillion.trainer.cli.main import main
from trillion.trainer.data.tokenizer import ByteTokenizer

transformers = pytest.importorskip("transformers")

PROMPT = "def fib(n):\n    "


@pytest.mark.parametrize("name", ["debug", "debug-gpt"])
def test_kv_cache_gives_the_full_forward_logits(name):
    args = dataclasses.replace(PRESETS[name], n_layers=2, dim=64, n_heads=4, max_seq_len=64)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(3)
    tokens = torch.randint(0, args.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(args, 2, 20)
        pieces = [model(tokens[:, :12], cache=cache)] + [
            model(tokens[:, i : i + 1], cache=cache) for i in range(12, 20)
        ]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_generation_stops_at_the_end_of_document_token_and_the_context():
    args = dataclasses.replace(PRESETS["debug"], n_layers=1, dim=32, n_heads=4, n_kv_heads=2, max_seq_len=16)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    prompt, greedy = list(range(40, 52)), Sampling(max_new_tokens=10, temperature=0)
    tokens = list(generate(model, prompt, greedy, vocab_size=257, stop_id=None))
    assert len(tokens) == 4  # 12 + 4 = the context of 16
    assert list(generate(model, prompt, greedy, vocab_size=257, stop_id=tokens[0])) == tokens[:1]
    assert max(tokens) < 257  # the model's padding ids (257-319) are never chosen


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_transformers_generate_on_the_exported_model(family, tmp_path, capsys):
    source, out = trained_and_exported(tmp_path, family)
    tokenizer = ByteTokenizer()
    prompt = tokenizer.encode(PROMPT)
    greedy = Sampling(max_new_tokens=24, temperature=0)

    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    vocab = theirs.config.vocab_size
    expected = theirs.generate(
        torch.tensor([prompt]),
        max_new_tokens=24,
        do_sample=False,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.eos_id,
        suppress_tokens=list(range(tokenizer.vocab_size, vocab)),
    )[0, len(prompt) :].tolist()
    assert len(set(expected)) > 1  # a continuation that can tell a wrong position apart

    for path in (source, source / "checkpoints" / "step-00000002", out):  # run, step and exported folder
        model, loaded_tokenizer = load_for_generation(path, torch.device("cpu"))
        assert isinstance(loaded_tokenizer, ByteTokenizer)
        got = list(generate(model, prompt, greedy, vocab_size=tokenizer.vocab_size, stop_id=tokenizer.eos_id))
        assert got == expected, path

    capsys.readouterr()
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(source),
                "--prompt",
                PROMPT,
                "--max-new-tokens",
                "24",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == tokenizer.decode(expected) + "\n"


def test_sampling_is_seeded_and_cut_by_top_k_and_top_p():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, -1.0, -3.0])

    def draws(sampling):
        generator = torch.Generator().manual_seed(sampling.seed)
        return [next_token(logits.clone(), sampling, generator) for _ in range(300)]

    wide = draws(Sampling(temperature=1.0, seed=1))
    assert wide == draws(Sampling(temperature=1.0, seed=1)) and wide != draws(Sampling(temperature=1.0, seed=2))
    assert len(set(wide)) >= 5
    assert set(draws(Sampling(temperature=1.0, top_k=2))) == {0, 1}
    # softmax of the logits: 0.43, 0.26, 0.16, ...; the nucleus of 0.6 holds the first two
    assert set(draws(Sampling(temperature=1.0, top_p=0.6))) == {0, 1}
    assert set(draws(Sampling(temperature=0.05))) == {0}
    assert next_token(logits, Sampling(temperature=0), torch.Generator()) == 0


def test_streaming_waits_for_whole_characters():
    tokenizer = ByteTokenizer()
    out = io.StringIO()
    text = stream_text(tokenizer, iter(tokenizer.encode("héllo ✓") + [tokenizer.eos_id]), out)
    assert text == out.getvalue()[:-1] == "héllo ✓"
    assert "\ufffd" not in out.getvalue()


def test_generate_errors_name_the_fix(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x"]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    source = tmp_path / "source"
    run(source, "--model.n_layers=1", steps=1)
    assert main(["generate", "--checkpoint", str(source), "--prompt", ""]) == 2
    assert "--prompt encodes to no tokens" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(source), "--prompt", "x" * 1024]) == 2
    assert "context is 1024 tokens" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(source), "--prompt", "x", "--top-p", "0"]) == 2
    assert "--top-p" in capsys.readouterr().err
