"""Hugging Face `transformers` interop: the registry of family adapters (models/hf_adapters/, one per
transformers model_type) and the four ways through it, so weights move both ways without changing a value.

Export picks the one adapter that claims a ModelArgs (`adapter_for_args`), refusing by name what its family
cannot express; import picks it by config.json's model_type (`adapter_for_config`). A new family is one
module in models/hf_adapters/ with an HFAdapter subclass, and one entry in ADAPTERS."""

from trillion.models.args import ModelArgs
from trillion.models.hf_adapters.base import HFAdapter, StateDict
from trillion.models.hf_adapters.deepseek_v2 import DeepSeekV2
from trillion.models.hf_adapters.deepseek_v3 import DeepSeekV3
from trillion.models.hf_adapters.gpt2 import GPT2
from trillion.models.hf_adapters.llama import Llama
from trillion.models.hf_adapters.mixtral import Mixtral
from trillion.models.hf_adapters.qwen3_moe import Qwen3Moe

ADAPTERS: tuple[HFAdapter, ...] = (Llama(), GPT2(), Mixtral(), Qwen3Moe(), DeepSeekV3(), DeepSeekV2())
BY_MODEL_TYPE: dict[str, HFAdapter] = {name: a for a in ADAPTERS for name in (a.model_type, *a.aliases)}


def _listed(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1]


def family_classes() -> str:
    """The transformers classes export writes, for messages: "LlamaForCausalLM, ... or DeepseekV2ForCausalLM"."""
    return _listed([adapter.hf_class for adapter in ADAPTERS])


def model_types() -> str:
    """The config.json model_types import reads, for messages: "llama, gpt2, ... or deepseek_v2"."""
    return _listed(list(BY_MODEL_TYPE))


def adapter_for_args(args: ModelArgs) -> HFAdapter:
    """The family whose shape `args` has (the adapters' claims part every ModelArgs: exactly one claims it)."""
    return next(adapter for adapter in ADAPTERS if adapter.claims(args))


def adapter_for_config(config: dict) -> HFAdapter:
    """The family of a config.json, by its model_type (ValueError naming those that map)."""
    model_type = config.get("model_type")
    if model_type not in BY_MODEL_TYPE:
        raise ValueError(f"model_type {model_type!r}: only {model_types()} map onto this transformer")
    return BY_MODEL_TYPE[model_type]


def _export_adapter(args: ModelArgs) -> HFAdapter:
    adapter = adapter_for_args(args)
    adapter.check(args)
    return adapter


def hf_config(args: ModelArgs):
    """The transformers config that describes the same network as `args` (ValueError naming what it cannot)."""
    return _export_adapter(args).hf_config(args)


def to_hf_state_dict(state: StateDict, args: ModelArgs, layout: str = "legacy") -> StateDict:
    """Our parameter names and layouts -> the transformers model's. `layout`, for a mixture of experts:
    "legacy" (one matrix per expert, as Hub checkpoints and save_pretrained have them) or "fused"
    (transformers' in-memory gate_up_proj / down_proj); from_pretrained loads either."""
    return _export_adapter(args).to_hf(state, args, layout)


def from_hf_state_dict(state: StateDict, args: ModelArgs) -> StateDict:
    """The transformers model's parameter names and layouts -> ours (the inverse of to_hf_state_dict).

    A tied checkpoint stores no lm_head; our output then reads the embedding table. Names this
    family does not have are returned unchanged, so the caller's key check can name them. Experts may
    come in either layout (per expert or fused)."""
    ours = adapter_for_args(args).from_hf(dict(state), args)
    if args.tie_embeddings:
        ours.setdefault("output.weight", ours["tok_embeddings.weight"])
    return ours


def args_from_hf_config(config: dict) -> ModelArgs:
    """The ModelArgs of a transformers config.json (the inverse of hf_config), for a folder with no run config."""
    return adapter_for_config(config).args_from_config(config)
