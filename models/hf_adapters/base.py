"""What a Hugging Face family adapter provides: the transformers model it stands for, the ModelArgs it is
chosen for, what of those it cannot express, and both directions of config and weights.

models/hf.py holds one instance per family, keyed by `model_type`; torchtitan's per-model
state_dict_adapter.py is the pattern. Weights move by name and layout only, never changing a value."""

import abc

import torch

from trillion.models.args import ModelArgs

StateDict = dict[str, torch.Tensor]


class HFAdapter(abc.ABC):
    model_type: str  # transformers' name of the family (config.json's model_type): the registry's key
    aliases: tuple[str, ...] = ()  # other model_types published in this family's layout (imported as it)
    hf_class: str  # the class AutoModelForCausalLM builds for the family

    @abc.abstractmethod
    def claims(self, args: ModelArgs) -> bool:
        """Whether `args` has this family's shape; the adapters' claims part every ModelArgs between them."""

    def cannot_express(self, args: ModelArgs) -> list[str]:
        """Each setting of `args` the family's model would compute otherwise, naming the fix."""
        return []

    def check(self, args: ModelArgs) -> None:
        """ValueError naming every setting the family cannot express; exports call it first."""
        if problems := self.cannot_express(args):
            raise ValueError(f"{self.hf_class} cannot express this model: {'; '.join(problems)}.")

    @abc.abstractmethod
    def hf_config(self, args: ModelArgs):
        """The transformers config of the same network (`args` checked)."""

    @abc.abstractmethod
    def to_hf(self, state: StateDict, args: ModelArgs, layout: str) -> StateDict:
        """Our names and layouts -> the family's (`layout`: how a mixture of experts is written)."""

    @abc.abstractmethod
    def from_hf(self, state: StateDict, args: ModelArgs) -> StateDict:
        """The family's names (any layout it is published in) -> ours; names it does not know are returned
        unchanged, so the caller's key check can name them. No expressibility check: a run may start from
        these weights with routing settings of its own."""

    @abc.abstractmethod
    def args_from_config(self, config: dict) -> ModelArgs:
        """The ModelArgs of the family's config.json (the inverse of hf_config), refusing what it cannot map."""


def head_width_problems(args: ModelArgs) -> list[str]:
    """For the families whose config has no head width of its own: heads must be dim / n_heads wide."""
    if args.head_dim == args.dim // args.n_heads:
        return []
    return [f"model.explicit_head_dim={args.explicit_head_dim} (its heads are dim / n_heads wide)"]


def refuse_unmapped(model_type: str, problems: list[str]) -> None:
    """ValueError naming what a config.json sets that this transformer cannot compute."""
    if problems:
        raise ValueError(f"model_type {model_type!r}: {'; '.join(problems)} do not map onto this transformer")
