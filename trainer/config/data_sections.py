"""The sections of the text trained and evaluated on: [data], [tokenizer], [eval]."""

from dataclasses import dataclass

from trillion.errors import ConfigError
from trillion.trainer.config.checks import ExistingPath, Flag, OneOf, Range, Text
from trillion.trainer.config.fields import NONNEGATIVE, POSITIVE, doc


@dataclass
class Data:
    path: str = doc(
        "",
        "Local file or folder (json, jsonl, txt, parquet). Empty with no `name`: the embedded default corpus (this "
        "Python's standard-library sources).",
        ExistingPath(
            "Point it at a json, jsonl, txt or parquet file or a folder of them, or leave it empty for the default "
            "corpus."
        ),
    )
    name: str = doc("", "Hugging Face hub dataset name (needs a network), e.g. allenai/c4.", Text())
    config_name: str = doc("", "Hub dataset configuration (the second argument of load_dataset), e.g. en.", Text())
    split: str = doc("train", "Dataset split.", Text(nonempty=True))
    text_field: str = doc("text", "Column holding the document text.", Text(nonempty=True))
    streaming: bool = doc(
        False, "Stream the dataset instead of loading it whole (hub datasets, large local ones).", Flag()
    )
    prepared: str = doc(
        "",
        "Train from token stores written by `trillion prepare-data --out DIR` (same data and tokenizer settings): "
        "DIR, or DIR:weight,DIR:weight,... blended by weight. Instead of data.path / data.name.",
        Text(),
    )
    shuffle: bool = doc(
        True, "data.prepared: a seeded permutation of the windows in every epoch; false keeps file order.", Flag()
    )
    lanes: int = doc(
        8,
        "Documents read side by side (data.path / data.name and the default corpus): lane j packs documents j, j+L, "
        "j+2L, ... of the seeded order into its own stream and window k of the run comes from lane k mod L, so "
        "consecutive windows come from different documents (at most the number of documents; 1 = one document after "
        "another). The evaluation set deals its documents over as many lanes.",
        POSITIVE,
    )
    document_mask: bool = doc(
        False,
        "Attention stays within each document packed into a window: a token sees only earlier tokens of its own "
        "document (the batch carries each window's document ids; the attention kernels skip the other documents' "
        "tiles). Token stores give their recorded document boundaries.",
        Flag(),
    )
    reset_positions: bool = doc(
        False, "Positions (rotary or learned) restart at 0 where each document starts within a window.", Flag()
    )


@dataclass
class Tokenizer:
    kind: str = doc(
        "byte",
        "byte (no files: UTF-8 bytes + EOS) | hf (a tokenizer.json) | tiktoken (a BPE ranks file).",
        OneOf(("byte", "hf", "tiktoken")),
    )
    path: str = doc(
        "",
        "tokenizer.json for hf, the .tiktoken ranks file for tiktoken.",
        ExistingPath(
            "Give the tokenizer.json (hf) or .tiktoken file (tiktoken), or use --tokenizer.kind=byte, which needs no "
            "files."
        ),
    )
    eos_token: str = doc(
        "", "End-of-document token text (hf, tiktoken); empty: the tokenizer's own EOS, or <|endoftext|>.", Text()
    )

    def check_relations(self) -> None:
        if self.kind != "byte" and not self.path:
            raise ConfigError(
                f"tokenizer.kind={self.kind} needs tokenizer.path (its tokenizer.json or .tiktoken file). "
                "Give --tokenizer.path, or use --tokenizer.kind=byte, which needs no files."
            )


@dataclass
class Eval:
    interval: int = doc(
        50, "Evaluate the held-out loss every N steps, before the first step and after the last (0 = off).", NONNEGATIVE
    )
    steps: int = doc(
        16,
        "Batches per evaluation: the same first eval.steps x eval.batch_size windows of the held-out set every time.",
        NONNEGATIVE,
    )
    batch_size: int = doc(
        0,
        "Sequences per evaluation batch, summed over data-parallel ranks (0 = training.global_batch_size).",
        NONNEGATIVE,
    )
    held_out: float = doc(
        0.01,
        "Share of the training documents held out for evaluation (and never trained on), chosen by a hash of each "
        "document's text: the same documents whatever the seed, order or ranks. Unused with eval.path or eval.name.",
        Range(0, 1, open_high=True),
    )
    path: str = doc(
        "",
        "A separate evaluation set: local file or folder (json, jsonl, txt, parquet), read with data.text_field. Then "
        "no training document is held out.",
        ExistingPath("Point it at a json, jsonl, txt or parquet file or a folder of them, or leave it empty."),
    )
    name: str = doc(
        "", "A separate evaluation set on the Hugging Face hub (needs a network), with data.config_name.", Text()
    )
    split: str = doc(
        "", "Split of eval.path or eval.name (empty: train for local files, validation for hub datasets).", Text()
    )
    document_mask: str = doc(
        "auto",
        "Attention within each document during evaluation: auto (as data.document_mask) | masked | unmasked.",
        OneOf(("auto", "masked", "unmasked")),
    )

    def masks_documents(self, data: Data) -> bool:
        """Whether evaluation masks documents, given the run's data settings."""
        return data.document_mask if self.document_mask == "auto" else self.document_mask == "masked"

    def check_relations(self) -> None:
        if self.path and self.name:
            raise ConfigError(
                f"eval.path={self.path!r} and eval.name={self.name!r} both name an evaluation set; keep one."
            )
        if self.interval and not self.steps:
            raise ConfigError(
                f"eval.interval={self.interval} evaluates on eval.steps=0 batches; give --eval.steps=16 "
                "(or --eval.interval=0 to turn evaluation off)."
            )
        if self.interval and not (self.path or self.name or self.held_out):
            raise ConfigError(
                f"eval.interval={self.interval} needs text to evaluate on: hold some documents out "
                "(--eval.held_out=0.01) or give a separate set (--eval.path=FILE), or set --eval.interval=0."
            )
