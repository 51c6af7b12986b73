"""Tokenizers: byte-level (needs no files), Hugging Face `tokenizer.json`, tiktoken BPE ranks."""

import base64
import hashlib
from pathlib import Path

from trillion.errors import ConfigError
from trillion.trainer.config.schema import Tokenizer as TokenizerConfig

# The pre-tokenization pattern of Llama 3 / cl100k, used for tiktoken ranks files.
TIKTOKEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; 256 ends a document."""

    vocab_size = 257
    eos_id = 256
    kind, source, fingerprint = "byte", "", ""  # what a token store records of its tokenizer

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: str, eos_token: str):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as error:  # the library raises a bare Exception with the parser's message
            raise ConfigError(
                f"tokenizer.path={path!r} does not load as a Hugging Face tokenizer ({_first_line(error)}). "
                "Give a Hugging Face tokenizer.json (what `save_pretrained` writes beside a model), or use "
                "--tokenizer.kind=byte, which needs no file."
            ) from None
        self.kind, self.source, self.fingerprint = "hf", path, _sha256(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        candidates = [eos_token] if eos_token else ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"]
        ids = [self._tok.token_to_id(c) for c in candidates if self._tok.token_to_id(c) is not None]
        if not ids:
            raise ConfigError(
                f"tokenizer.path={path!r} has no end-of-document token among {candidates}. "
                "Name it with --tokenizer.eos_token=..."
            )
        self.eos_id = ids[0]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


class TiktokenTokenizer:
    def __init__(self, path: str, eos_token: str):
        import tiktoken

        self.kind, self.source, self.fingerprint = "tiktoken", path, _sha256(path)
        ranks = _read_ranks(path)
        eos = eos_token or "<|endoftext|>"
        self.eos_id = len(ranks)
        try:
            self._enc = tiktoken.Encoding(
                Path(path).stem, pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks, special_tokens={eos: self.eos_id}
            )
        except Exception as error:  # ranks tiktoken refuses
            raise ConfigError(
                f"tokenizer.path={path!r} does not load as tiktoken BPE ranks ({_first_line(error)}). {RANKS_FIX}"
            ) from None
        self.vocab_size = self.eos_id + 1

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)


RANKS_FIX = "Give a .tiktoken ranks file (tokenizer.kind=tiktoken), or use --tokenizer.kind=byte, which needs no file."


def _read_ranks(path: str) -> dict[bytes, int]:
    """A .tiktoken file: one `<base64 token> <rank>` per line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"tokenizer.path={path!r} is not a text file (byte offset {error.start} is not UTF-8), so not tiktoken "
            f"BPE ranks. {RANKS_FIX}"
        ) from None
    ranks = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError:  # a bad rank, or base64 (binascii.Error is a ValueError)
            raise ConfigError(
                f"tokenizer.path={path!r}, line {number}, is not a BPE rank ({line.strip()[:40]!r}, where each line is "
                f"`<base64 token> <rank>`). {RANKS_FIX}"
            ) from None
    if not ranks:
        raise ConfigError(f"tokenizer.path={path!r} holds no BPE ranks: it is empty. {RANKS_FIX}")
    return ranks


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def build_tokenizer(cfg: TokenizerConfig):
    if cfg.kind == "byte":
        return ByteTokenizer()
    if cfg.kind not in ("hf", "tiktoken"):
        raise ConfigError(f"tokenizer.kind={cfg.kind!r} is not known. Use byte, hf or tiktoken.")
    if cfg.path and Path(cfg.path).is_dir():
        inside = Path(cfg.path) / "tokenizer.json"
        hint = f" (--tokenizer.path={inside}, here)" if cfg.kind == "hf" and inside.is_file() else ""
        raise ConfigError(
            f"tokenizer.path={cfg.path!r} is a folder. Give the tokenizer's file itself: the tokenizer.json (hf)"
            f"{hint} or the .tiktoken ranks file (tiktoken)."
        )
    if not cfg.path or not Path(cfg.path).is_file():
        raise ConfigError(
            f"tokenizer.path={cfg.path!r}: no such file. tokenizer.kind={cfg.kind} needs "
            + ("a tokenizer.json" if cfg.kind == "hf" else "a .tiktoken BPE ranks file")
            + " (or use --tokenizer.kind=byte, which needs none)."
        )
    return HFTokenizer(cfg.path, cfg.eos_token) if cfg.kind == "hf" else TiktokenTokenizer(cfg.path, cfg.eos_token)
