"""Block parts as declarations: what every package needs to know about a model's parts, declared once per
part, torch-free (models/parts/spec.py has the vocabulary).

Each part has its module (models/transformer.py Attention and FeedForward, models/mla.py, models/moe.py,
models/mtp.py) and its declaration here (gqa.py, mla.py, mlp.py, moe.py, mtp.py, norm.py, root.py). A block is
its norms, one attention kind and one feed-forward (`block`); the attention kind is chosen by name from
ATTENTION_KINDS (ModelArgs.attention; empty: "mla" with latent attention arguments, else "gqa"), so a new
attention is one module plus its declaration, registered with `register_attention`. models/flops.py,
parallel/tensor_parallel.py and the planner read the declarations and name no part.

Settings: each part checks and applies the user's settings that concern it (`apply_settings`, with a typed
PartSettings: settings.py), and declares the parallel layouts it cannot train under (`layout_refusal`, which both
the trainer and the planner ask).
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from trillion.errors import ConfigError
from trillion.models.args import ModelArgs
from trillion.models.parts import gqa, mla, mlp, moe, mtp, norm, root
from trillion.models.parts.block import Block
from trillion.models.parts.root import Root
from trillion.models.parts.settings import AttentionSettings, PartSettings
from trillion.models.parts.spec import Divides, Part

__all__ = [
    "ATTENTION_KINDS",
    "AttentionKind",
    "AttentionSettings",
    "Block",
    "PartSettings",
    "Root",
    "block",
    "layer_block",
    "register_attention",
]


@dataclass(frozen=True)
class AttentionKind:
    """An attention: its declaration, its module (a class taking ModelArgs, or "module:Class", imported when
    first built so that the declarations stay torch-free) and its settings check (ModelArgs, settings) -> ModelArgs.
    The module's forward is (x, rope, cache=None) -> x, as models/transformer.py's Attention; one that
    `masks_documents` takes document_ids=(batch, seq) too (data.document_mask) and passes it to its attend."""

    declare: Callable[[ModelArgs], Part]
    module: str | Callable
    check_settings: Callable[[ModelArgs, PartSettings], ModelArgs] | None = None
    masks_documents: bool = False

    def build(self, args: ModelArgs):
        module = self.module
        if isinstance(module, str):
            path, name = module.split(":")
            module = getattr(importlib.import_module(path), name)
        return module(args)


ATTENTION_KINDS: dict[str, AttentionKind] = {
    "gqa": AttentionKind(gqa.declare, "trillion.models.attention:Attention", masks_documents=True),
    "mla": AttentionKind(mla.declare, "trillion.models.mla:MLAttention", mla.check_settings, masks_documents=True),
}


def register_attention(name: str, kind: AttentionKind) -> None:
    """Make `kind` choosable as ModelArgs(attention=name)."""
    ATTENTION_KINDS[name] = kind
    block.cache_clear()


def attention_name(args: ModelArgs) -> str:
    return args.attention or ("mla" if args.mla is not None else "gqa")


def attention_kind(args: ModelArgs) -> AttentionKind:
    name = attention_name(args)
    if name not in ATTENTION_KINDS:
        raise ConfigError(f"model attention {name!r} is not known. Use one of {', '.join(ATTENTION_KINDS)}.")
    return ATTENTION_KINDS[name]


@lru_cache(maxsize=1024)
def block(args: ModelArgs, routed: bool = False) -> Block:
    """A block's declaration: a dense one, or (`routed`) one whose feed-forward is the mixture of experts."""
    feed_forward = moe.declare(args) if routed else mlp.declare(args)
    return Block((norm.declare(args), attention_kind(args).declare(args), feed_forward))


def routed_layer(args: ModelArgs, index: int) -> bool:
    """Whether block `index` (a multi-token prediction block numbers on after the trunk's) has routed experts."""
    return args.is_moe_layer(index)


def layer_block(args: ModelArgs, index: int) -> Block:
    return block(args, routed_layer(args, index))


@lru_cache(maxsize=1024)
def first_routed_layer(args: ModelArgs) -> int:
    """The first block with routed experts (n_layers: none); cached, as the planner's search asks it of every layout."""
    return next((i for i in range(args.n_layers) if routed_layer(args, i)), args.n_layers)


def routed_experts(args: ModelArgs) -> int:
    """E of the model's routed layers (0: a dense model), what expert parallelism must divide."""
    return moe.declare(args).routing.n_experts if args.moe is not None else 0


def routing(args: ModelArgs):
    """The routed layers' router as declared (models/parts/spec.py Routing), or None for a dense model."""
    return moe.declare(args).routing if args.moe is not None else None


def ahead_modules(args: ModelArgs) -> tuple[int, Part | None]:
    """(how many multi-token prediction modules train beside the trunk, one module's parts besides its block)."""
    return args.mtp_modules, (mtp.declare(args) if args.mtp_modules else None)


def model_root(args: ModelArgs) -> Root:
    return root.declare(args)


def _declared_parts(args: ModelArgs) -> list[Part]:
    """Every distinct part the model builds, dense blocks' feed-forward included whether it builds one or not
    (the dense width stays checked against tp)."""
    parts = list(block(args).parts)
    if first_routed_layer(args) < args.n_layers:
        parts.append(moe.declare(args))
    count, ahead = ahead_modules(args)
    return parts + ([ahead] if count else [])


def tp_divides(args: ModelArgs) -> tuple[Divides, ...]:
    """The sizes tensor parallelism splits evenly: the parts', then the root's."""
    return tuple(d for p in _declared_parts(args) for d in p.tp_divides) + model_root(args).tp_divides


def layout_refusal(args: ModelArgs, layout) -> str:
    """Why a part cannot train under `layout` (anything with pp, cp, tp, ... degrees), or "": the trainer raises
    it (trainer/assemble.py), the planner never proposes the layout (parallel/planner/search.py)."""
    for part in _declared_parts(args):
        for refusal in part.refusals:
            refused = [(axis, why) for axis, why in refusal.axes if getattr(layout, axis) > 1]
            if refused:
                degrees = ", ".join(f"parallel.{axis}={getattr(layout, axis)}" for axis, _ in refused)
                return (
                    f"{refusal.setting} with {degrees} cannot train: {'; '.join(w for _, w in refused)}. {refusal.fix}"
                )
    return ""


def apply_settings(args: ModelArgs, settings: PartSettings) -> ModelArgs:
    """The preset with the user's part settings applied and checked by each part."""
    args = moe.apply_settings(args, settings.moe, settings.model_name)
    args = mtp.apply_settings(args, settings.mtp, settings.model_name)
    if settings.attention.document_mask and not attention_kind(args).masks_documents:
        masking = ", ".join(name for name, kind in ATTENTION_KINDS.items() if kind.masks_documents)
        raise ConfigError(
            f"data.document_mask=true, but the model's attention {attention_name(args)!r} cannot mask documents: its "
            f"module takes no document ids. Train with --data.document_mask=false, or with an attention that masks "
            f"them ({masking})."
        )
    check = attention_kind(args).check_settings
    return check(args, settings) if check is not None else args
