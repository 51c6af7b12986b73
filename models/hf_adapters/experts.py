"""Routed experts between our layout and the families' (Mixtral, Qwen3-MoE, DeepSeek-V2/V3).

Two expert layouts exist on the transformers side. In memory (transformers 5) each layer's experts are
fused: `mlp.experts.gate_up_proj` (E, 2 * hidden, dim), gate rows first, and `mlp.experts.down_proj`
(E, dim, hidden); the router is `mlp.gate.weight`. Hub checkpoints keep the per-expert ("legacy")
layout, `mlp.experts.{e}.<gate>/<up>/<down>.weight` under each family's projection names.
`from_pretrained` converts the legacy layout (conversion_mapping.py) and takes the fused one as it is;
`save_pretrained` writes the legacy one (save_original_format=True). So export writes "legacy" by
default, what other tools read; import takes either. Our experts are x @ w[e], so each HF matrix is ours
transposed."""

from collections.abc import Callable

import torch

from trillion.models.args import ModelArgs
from trillion.models.hf_adapters import llama_style
from trillion.models.hf_adapters.base import StateDict

LAYOUTS = ("legacy", "fused")
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")  # the family's names of our w1, w3, w2
EXPERT_BIAS = "router.expert_bias"
OUR_EXPERTS = ("w1", "w3", "w2")


def moe_to_hf(
    state: StateDict,
    args: ModelArgs,
    layer_names: dict[str, str],
    expert_names: tuple[str, str, str],
    layout: str,
    expert_bias_to_hf: Callable[[str, torch.Tensor], StateDict],
) -> StateDict:
    """A family with experts' export: each block's modules by `layer_names`, the routed experts under
    `expert_names` in `layout`, the balancing bias as the family keeps it (`expert_bias_to_hf(index, bias)`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {', '.join(LAYOUTS)}")
    out, named = {}, {}
    for name, tensor in state.items():
        if name.endswith(EXPERT_BIAS):
            out.update(expert_bias_to_hf(name.split(".")[1], tensor))
        elif ".feed_forward.experts." not in name:  # the experts below, all three projections together
            named[name] = tensor
    out.update(llama_style.names_to_hf(named, layer_names))
    for i in range(args.n_layers):
        if f"layers.{i}.feed_forward.experts.w1" in state:
            w1, w3, w2 = (state[f"layers.{i}.feed_forward.experts.{w}"] for w in OUR_EXPERTS)
            out.update(experts_to_hf(f"model.layers.{i}.mlp.", (w1, w3, w2), expert_names, layout))
    return out


def experts_to_hf(prefix: str, ours: tuple, expert_names: tuple[str, str, str], layout: str) -> StateDict:
    w1, w3, w2 = ours
    if layout == "fused":
        return {
            prefix + "experts.gate_up_proj": torch.cat([w1, w3], dim=2).transpose(1, 2).contiguous(),
            prefix + "experts.down_proj": w2.transpose(1, 2).contiguous(),
        }
    out = {}
    for leaf, weight in zip(expert_names, ours):
        for e in range(weight.shape[0]):
            out[f"{prefix}experts.{e}.{leaf}.weight"] = weight[e].t().contiguous()
    return out


def experts_from_hf(state: dict, i: int, expert_names: tuple[str, str, str], n_experts: int) -> StateDict:
    """Pop block `i`'s experts from `state` (fused or per expert) as our w1, w3, w2; {} if not all there."""
    prefix, ours = f"model.layers.{i}.mlp.", f"layers.{i}.feed_forward."
    fused = (prefix + "experts.gate_up_proj", prefix + "experts.down_proj")
    if all(name in state for name in fused):
        gate_up, down = (state.pop(name) for name in fused)
        w1, w3 = gate_up.transpose(1, 2).chunk(2, dim=2)
        return {ours + "experts.w1": w1, ours + "experts.w3": w3, ours + "experts.w2": down.transpose(1, 2)}
    names = [[f"{prefix}experts.{e}.{leaf}.weight" for e in range(n_experts)] for leaf in expert_names]
    if not all(name in state for group in names for name in group):
        return {}
    stacked = [torch.stack([state.pop(name).t() for name in group]) for group in names]
    return {ours + f"experts.{w}": tensor for w, tensor in zip(OUR_EXPERTS, stacked)}
