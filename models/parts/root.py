"""The model's parts outside its blocks (models/transformer.py Transformer), declared: the token embedding and
GPT's learned position table (vocabulary- and position-parallel: tp splits their rows), the final norm and the
output head (column-wise over the vocabulary; tied to the token table when the preset ties them)."""

from dataclasses import dataclass

from trillion.models.args import ModelArgs
from trillion.models.parts.norm import model_norm
from trillion.models.parts.spec import COLUMN, Divides, Linear, Norm, Table


@dataclass(frozen=True)
class Root:
    tables: tuple[Table, ...]  # on the first pipeline stage
    norm: Norm  # the final norm, on the last stage
    output: Linear  # on the last stage; its weight is the token table's when tied
    tied: bool
    tp_divides: tuple[Divides, ...]

    @property
    def embedding_numel(self) -> int:
        return sum(t.rows * t.dim for t in self.tables)


def declare(args: ModelArgs) -> Root:
    learned = args.positions == "learned"
    tables = (Table("tok_embeddings", args.vocab_size, args.dim),)
    divides = (Divides("model.vocab_size", args.vocab_size, "vocabulary (pad it to a multiple of tp)"),)
    if learned:
        tables += (Table("pos_embeddings", args.max_seq_len, args.dim),)
        divides += (Divides("model max_seq_len", args.max_seq_len, "learned position table"),)
    output = Linear("output", args.dim, args.vocab_size, COLUMN)
    return Root(tables, model_norm(args, "norm"), output, args.tie_embeddings, divides)
