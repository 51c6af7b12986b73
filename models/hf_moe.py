"""Hugging Face `transformers` adapters for the mixtures of experts: MixtralForCausalLM and
Qwen3MoeForCausalLM (models/hf.py dispatches here when ModelArgs.moe is set: QK-norm means Qwen3-MoE).

Two expert layouts exist on the transformers side. In memory (transformers 5) each layer's experts are
fused: `mlp.experts.gate_up_proj` (E, 2 * hidden, dim), gate rows first, and `mlp.experts.down_proj`
(E, dim, hidden); the router is `mlp.gate.weight`. Hub checkpoints keep the per-expert ("legacy")
layout: Mixtral `block_sparse_moe.experts.{e}.w1/w2/w3.weight` and `block_sparse_moe.gate.weight`,
Qwen3-MoE `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`. `from_pretrained` converts the
legacy layout (conversion_mapping.py) and takes the fused one as it is; `save_pretrained` writes the
legacy one (save_original_format=True). So export writes "legacy" by default, what other tools read;
import takes either. Our experts are x @ w[e], so each HF matrix is ours transposed.
"""

import dataclasses
import logging
from collections.abc import Callable

import torch

from trillion.models.args import ModelArgs, MoEArgs
from trillion.models.hf import llama_args_from_config, llama_names_to_ours

log = logging.getLogger(__name__)

LAYOUTS = ("legacy", "fused")
# Names outside the feed-forward: Llama's (models/hf.py) plus the per-head query and key norms.
MOE_LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",  # a dense block (Qwen3-MoE's mlp_only_layers)
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.router.gate": "mlp.gate",
}
# Per-expert projection names in each family's Hub checkpoints: (w1 = gate, w3 = up, w2 = down); DeepSeek's
# (models/hf_deepseek.py) are Qwen3-MoE's.
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
EXPERT_NAMES = {
    "mixtral": ("w1", "w3", "w2"),
    "qwen3_moe": QWEN_EXPERT_NAMES,
    "deepseek_v3": QWEN_EXPERT_NAMES,
    "deepseek_v2": QWEN_EXPERT_NAMES,
}
EXPERT_BIAS = "router.expert_bias"


def moe_family(args: ModelArgs) -> str:
    """The transformers model_type for a mixture of experts: QK-norm is Qwen3-MoE, else Mixtral."""
    family = "qwen3_moe" if args.qk_norm else "mixtral"
    check_expressible(args, family)
    return family


def check_expressible(args: ModelArgs, family: str) -> None:
    """Raise ValueError naming every setting `family` cannot express (its model would compute otherwise)."""
    moe, name = args.moe, {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[family]
    problems = [
        *(["model.mlp must be swiglu"] if args.mlp != "swiglu" else []),
        *(["model.norm must be rmsnorm"] if args.norm != "rmsnorm" else []),
        *(["model.positions must be rope"] if args.positions != "rope" else []),
        *(["model.bias must be false"] if args.bias else []),
        *([f"moe.n_shared_experts={moe.n_shared_experts} (no shared experts)"] if moe.n_shared_experts else []),
        *([f"moe.score_func={moe.score_func!r} (softmax only)"] if moe.score_func != "softmax" else []),
        *([f"moe.n_groups={moe.n_groups} (no group-limited routing)"] if moe.n_groups > 1 else []),
        *([f"moe.route_scale={moe.route_scale} (1.0 only)"] if moe.route_scale != 1.0 else []),
        *([f"moe.capacity_factor={moe.capacity_factor} (dropless only)"] if moe.capacity_factor > 0 else []),
    ]
    if family == "mixtral":
        problems += [f"moe.n_dense_layers={moe.n_dense_layers} (every block is MoE)"] if moe.n_dense_layers else []
        problems += ["moe.route_norm=false (top-k scores always renormalised)"] if not moe.route_norm else []
    if problems:
        raise ValueError(f"{name} cannot express this model: {'; '.join(problems)}.")


def hf_moe_config(args: ModelArgs):
    """MixtralConfig or Qwen3MoeConfig for `args` (args.moe set)."""
    moe, family = args.moe, moe_family(args)
    common = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        tie_word_embeddings=args.tie_embeddings,
        rope_theta=args.rope_theta,
        num_experts_per_tok=moe.top_k,
        router_aux_loss_coef=moe.aux_loss_coef,
        output_router_logits=False,
    )
    if family == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(
            intermediate_size=moe.expert_ffn_dim,
            num_local_experts=moe.n_experts,
            sliding_window=None,
            router_jitter_noise=0.0,
            **common,
        )
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        intermediate_size=args.ffn_hidden,  # the dense blocks' width (mlp_only_layers)
        moe_intermediate_size=moe.expert_ffn_dim,
        num_experts=moe.n_experts,
        norm_topk_prob=moe.route_norm,
        decoder_sparse_step=1,
        mlp_only_layers=list(range(moe.n_dense_layers)),
        attention_bias=False,
        use_sliding_window=False,
        **common,
    )


def moe_to_hf(state: dict[str, torch.Tensor], args: ModelArgs, layout: str = "legacy") -> dict[str, torch.Tensor]:
    """Our names and layouts -> transformers', experts per expert ("legacy", the Hub's) or "fused"."""
    family = moe_family(args)

    def drop_bias(index: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:  # neither family balances by a bias
        if torch.count_nonzero(tensor):
            log.warning("layers.%s: its nonzero expert_bias is dropped; the export routes without it", index)
        return {}

    out = names_to_hf(state, args, MOE_LAYER_NAMES, family, layout, drop_bias)
    if family == "mixtral" and layout == "legacy":
        out = {k.replace(".mlp.", ".block_sparse_moe.", 1): v for k, v in out.items()}
    return out


def names_to_hf(
    state: dict[str, torch.Tensor],
    args: ModelArgs,
    layer_names: dict[str, str],
    family: str,
    layout: str,
    expert_bias_to_hf: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """Every MoE family's export: the top-level names, each block's modules by `layer_names`, the routed experts
    by `experts_to_hf`, and the balancing bias as the family keeps it (`expert_bias_to_hf(layer index, bias)`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {', '.join(LAYOUTS)}")
    top = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    top["output.weight"] = "lm_head.weight"
    out = {}
    for name, tensor in state.items():
        if name in top:
            out[top[name]] = tensor
            continue
        _, index, rest = name.split(".", 2)
        if rest.endswith(EXPERT_BIAS):
            out.update(expert_bias_to_hf(index, tensor))
        elif not rest.startswith("feed_forward.experts."):  # the experts below, all three projections together
            module, _, leaf = rest.rpartition(".")
            out[f"model.layers.{index}.{layer_names[module]}.{leaf}"] = tensor
    for i in range(args.n_layers):
        if f"layers.{i}.feed_forward.experts.w1" in state:
            w1, w3, w2 = (state[f"layers.{i}.feed_forward.experts.{w}"] for w in ("w1", "w3", "w2"))
            out.update(experts_to_hf(f"model.layers.{i}.mlp.", w1, w3, w2, family, layout))
    return out


def experts_to_hf(prefix: str, w1, w3, w2, family: str, layout: str) -> dict[str, torch.Tensor]:
    if layout == "fused":
        return {
            prefix + "experts.gate_up_proj": torch.cat([w1, w3], dim=2).transpose(1, 2).contiguous(),
            prefix + "experts.down_proj": w2.transpose(1, 2).contiguous(),
        }
    out = {}
    for leaf, weight in zip(EXPERT_NAMES[family], (w1, w3, w2)):
        for e in range(weight.shape[0]):
            out[f"{prefix}experts.{e}.{leaf}.weight"] = weight[e].t().contiguous()
    return out


def moe_from_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """transformers' names (either expert layout) -> ours. Names that fit nothing are returned unchanged.
    No expressibility check: routing settings (capacity, scores) may differ from the source's for a run
    that starts from its weights, and a part it lacks (shared experts) shows in the caller's key check."""
    family = "qwen3_moe" if args.qk_norm else "mixtral"
    state = {k.replace(".block_sparse_moe.", ".mlp.", 1): v for k, v in state.items()}
    out = {}
    for i in range(args.n_layers):
        if args.is_moe_layer(i):
            out.update(experts_from_hf(state, f"model.layers.{i}.mlp.", f"layers.{i}.feed_forward.", family, args))
    out.update(llama_names_to_ours(state, MOE_LAYER_NAMES))
    if args.moe.bias_update_rate > 0:  # our balancing bias starts from zero: the families have none
        for i in range(args.n_layers):
            if args.is_moe_layer(i):
                out.setdefault(f"layers.{i}.feed_forward.{EXPERT_BIAS}", torch.zeros(args.moe.n_experts))
    return out


def experts_from_hf(state: dict, prefix: str, ours: str, family: str, args: ModelArgs) -> dict[str, torch.Tensor]:
    """Pop one layer's experts from `state` (fused or per expert) as our w1, w3, w2; {} if not all there."""
    fused = (prefix + "experts.gate_up_proj", prefix + "experts.down_proj")
    if all(name in state for name in fused):
        gate_up, down = (state.pop(name) for name in fused)
        w1, w3 = gate_up.transpose(1, 2).chunk(2, dim=2)
        return {ours + "experts.w1": w1, ours + "experts.w3": w3, ours + "experts.w2": down.transpose(1, 2)}
    names = [[f"{prefix}experts.{e}.{leaf}.weight" for e in range(args.moe.n_experts)] for leaf in EXPERT_NAMES[family]]
    if not all(name in state for group in names for name in group):
        return {}
    stacked = [torch.stack([state.pop(name).t() for name in group]) for group in names]
    return {ours + f"experts.{w}": tensor for w, tensor in zip(("w1", "w3", "w2"), stacked)}


def args_from_moe_config(config: dict) -> ModelArgs:
    """ModelArgs of a Mixtral or Qwen3-MoE config.json (the inverse of hf_moe_config)."""
    family = config["model_type"]
    n_experts = config.get("num_experts") or config.get("num_local_experts")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    _refuse_unmapped(config, family)
    qwen = family == "qwen3_moe"
    moe = MoEArgs(
        n_experts=n_experts,
        top_k=config["num_experts_per_tok"],
        expert_ffn_dim=config["moe_intermediate_size" if qwen else "intermediate_size"],
        n_dense_layers=len(config.get("mlp_only_layers") or []) if qwen else 0,
        route_norm=bool(config.get("norm_topk_prob", False)) if qwen else True,
        aux_loss_coef=config.get("router_aux_loss_coef", 0.0),
    )
    return dataclasses.replace(
        llama_args_from_config(config),
        explicit_head_dim=head_dim if head_dim != config["hidden_size"] // config["num_attention_heads"] else None,
        qk_norm=qwen,
        moe=moe,
    )


def _refuse_unmapped(config: dict, family: str) -> None:
    """ValueError naming what a config.json sets that this transformer cannot compute."""
    problems = []
    if not (config.get("num_experts") or config.get("num_local_experts")):
        problems.append("no experts (num_experts 0)")
    for key in ("rope_parameters", "rope_scaling"):  # transformers 5's key, and older config.json files'
        rope = config.get(key) or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            problems.append(f"{key} of type {rope.get('rope_type', rope.get('type'))!r}")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config['hidden_act']!r}")
    window = config.get("sliding_window") if family == "mixtral" or config.get("use_sliding_window") else None
    if window is not None and window < config["max_position_embeddings"]:
        problems.append(f"sliding_window {window}")
    if family == "qwen3_moe":
        if config.get("decoder_sparse_step", 1) != 1:
            problems.append(f"decoder_sparse_step {config['decoder_sparse_step']} (MoE blocks must be consecutive)")
        dense = sorted(config.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))):
            problems.append(f"mlp_only_layers {dense} (only the first blocks may be dense)")
        if config.get("attention_bias"):
            problems.append("attention_bias true")
    if problems:
        raise ValueError(f"model_type {family!r}: {'; '.join(problems)} do not map onto this transformer")
