"""`trillion generate --checkpoint PATH --prompt TEXT`: continue a prompt with a trained model.

PATH is a run directory (its newest complete checkpoint), a checkpoint step directory or a Hugging
Face folder that `trillion export` wrote. The model runs whole in this one process (on the GPU
when there is one) with a KV cache, so each new token passes through the model once; the
continuation streams to stdout as it is sampled, and stops at the end-of-document token.
The prompt is encoded with the run's own tokenizer (its config.toml).
"""

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from trillion.errors import ConfigError
from trillion.models.kv_cache import KVCache
from trillion.trainer.cli.args import CommandParser
from trillion.trainer.config.schema import load_config

log = logging.getLogger("trillion")


@dataclasses.dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 128
    temperature: float = 0.8  # 0: greedy
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # 1: every token
    seed: int = 0


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser("generate", description=__doc__.split("\n")[0])
    p.add_argument(
        "--checkpoint",
        required=True,
        help="a run directory, a checkpoint step-NNNNNNNN directory, or an exported Hugging Face folder",
    )
    p.add_argument("--prompt", required=True, help="the text to continue")
    defaults = Sampling()
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=defaults.temperature, help="0 = greedy (the likeliest token)")
    p.add_argument("--top-k", type=int, default=defaults.top_k, help="sample among the k likeliest tokens (0 = all)")
    p.add_argument(
        "--top-p",
        type=float,
        default=defaults.top_p,
        help="sample among the likeliest tokens holding this much probability (1 = all)",
    )
    p.add_argument("--seed", type=int, default=defaults.seed, help="seed of the sampling")
    p.add_argument("--device", default="auto", help="auto (the GPU when there is one) | cpu | cuda")
    return p


def sampling_from(ns: argparse.Namespace) -> Sampling:
    if ns.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {ns.max_new_tokens}: give 1 or more.")
    if ns.temperature < 0:
        raise ConfigError(f"--temperature {ns.temperature}: give 0 (greedy) or more.")
    if ns.top_k < 0:
        raise ConfigError(f"--top-k {ns.top_k}: give 0 (every token) or more.")
    if not 0.0 < ns.top_p <= 1.0:
        raise ConfigError(f"--top-p {ns.top_p}: give a probability in (0, 1], e.g. 0.9 (1 = every token).")
    return Sampling(ns.max_new_tokens, ns.temperature, ns.top_k, ns.top_p, ns.seed)


def load_for_generation(path: Path, device: torch.device):
    """(model in eval mode on `device`, tokenizer) from a run, step or exported Hugging Face folder."""
    from trillion.trainer.checkpoint.export import RUN_CONFIG, load_checkpoint_model, resolve_checkpoint
    from trillion.trainer.checkpoint.folders import CONFIG_FILE
    from trillion.trainer.data.tokenizer import build_tokenizer

    if not path.exists():
        raise ConfigError(
            f"--checkpoint {path}: no such file or folder. Give a run's output_dir, a checkpoint "
            "step-NNNNNNNN directory or a folder `trillion export` wrote."
        )
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        model = _load_hf_folder(path)
        config_file = path / RUN_CONFIG
    else:
        step = resolve_checkpoint(path)
        model, config_file = load_checkpoint_model(step), step / CONFIG_FILE
    if config_file.is_file():
        tokenizer = build_tokenizer(load_config(str(config_file)).tokenizer)
    elif (path / "tokenizer.json").is_file():
        from trillion.trainer.data.tokenizer import HFTokenizer

        tokenizer = HFTokenizer(str(path / "tokenizer.json"), "")
    else:
        from trillion.trainer.data.tokenizer import ByteTokenizer

        log.info("%s holds no run config (%s) and no tokenizer.json: using the byte tokenizer", path, RUN_CONFIG)
        tokenizer = ByteTokenizer()
    return model.to(device).eval(), tokenizer


def _load_hf_folder(path: Path):
    from trillion.models import Transformer
    from trillion.models.hf import args_from_hf_config, family_classes
    from trillion.trainer.checkpoint.state import load_model_weights

    try:
        args = args_from_hf_config(json.loads((path / "config.json").read_text()))
    except (ValueError, KeyError) as error:
        raise ConfigError(
            f"--checkpoint {path}: its config.json does not describe a model of {family_classes()} "
            f"that this transformer computes ({error})."
        ) from None
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(0)  # fills the non-persistent rope table; the weights come from the folder
    load_model_weights(path, [model], args, "--checkpoint")
    return model


def encode_prompt(tokenizer, prompt: str, model, max_new_tokens: int) -> list[int]:
    """The prompt's ids, checked against the model; the context must leave room for one new token."""
    try:
        ids = tokenizer.encode(prompt)
    except Exception as error:  # tokenizers raise their own types on text they cannot encode
        raise ConfigError(f"--prompt could not be encoded by the run's tokenizer ({error}).") from None
    if not ids:
        raise ConfigError("--prompt encodes to no tokens: give some text to continue.")
    if max(ids) >= model.args.vocab_size:
        raise ConfigError(
            f"--prompt: the tokenizer gives id {max(ids)}, beyond the model's {model.args.vocab_size} "
            "ids; this tokenizer is not the one the model was trained with."
        )
    context = model.args.max_seq_len
    if len(ids) >= context:
        raise ConfigError(
            f"--prompt is {len(ids)} tokens; the model's context is {context} tokens, and the "
            "continuation needs room: shorten the prompt."
        )
    if len(ids) + max_new_tokens > context:
        log.info("stopping after %d new tokens, at the model's context of %d", context - len(ids), context)
    return ids


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """Greedy at temperature 0; else a draw from the temperature-scaled distribution, cut to top-k and top-p."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = logits.sort(descending=True)
        probs = ordered.softmax(-1)
        beyond = probs.cumsum(-1) - probs >= sampling.top_p  # tokens after the nucleus is already full
        logits = logits.index_fill(0, order[beyond], float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


@torch.no_grad()
def generate(model, prompt: list[int], sampling: Sampling, *, vocab_size: int, stop_id: int | None) -> Iterator[int]:
    """The continuation's ids, one at a time: the prompt fills the KV cache in one forward, then each
    new token takes one more. Ids at and beyond `vocab_size` (the model's padding rows, which no
    tokenizer id reaches) are never chosen; `stop_id` ends the continuation (and is yielded)."""
    device = model.output.weight.device
    steps = min(sampling.max_new_tokens, model.args.max_seq_len - len(prompt))
    cache = KVCache(model.args, 1, len(prompt) + steps, device, model.output.weight.dtype)
    generator = torch.Generator(device).manual_seed(sampling.seed)
    logits = model(torch.tensor([prompt], device=device), cache=cache)[0, -1]
    for index in range(steps):
        logits[vocab_size:] = float("-inf")
        token = next_token(logits, sampling, generator)
        yield token
        if token == stop_id or index == steps - 1:
            return
        logits = model(torch.tensor([[token]], device=device), cache=cache)[0, -1]


def stream_text(tokenizer, ids: Iterator[int], out=None) -> str:
    """Write the decoded continuation as it grows (to stdout by default); a token that ends
    mid-character (a byte of a multi-byte UTF-8 sequence) waits for the rest."""
    out = out or sys.stdout
    generated, shown = [], ""
    for token in ids:
        generated.append(token)
        text = tokenizer.decode(generated)
        if text.endswith("\ufffd"):
            continue
        out.write(text[len(shown) :])
        out.flush()
        shown = text
    text = tokenizer.decode(generated)
    out.write(text[len(shown) :] + "\n")
    out.flush()
    return text


def main(argv: list[str]) -> int:
    from trillion.trainer.launch.env import pick_device

    ns = build_parser().parse_args(argv)
    sampling = sampling_from(ns)
    model, tokenizer = load_for_generation(Path(ns.checkpoint), pick_device(ns.device, 0))
    prompt = encode_prompt(tokenizer, ns.prompt, model, sampling.max_new_tokens)
    ids = generate(
        model, prompt, sampling, vocab_size=min(tokenizer.vocab_size, model.args.vocab_size), stop_id=tokenizer.eos_id
    )
    stream_text(tokenizer, ids)
    return 0
