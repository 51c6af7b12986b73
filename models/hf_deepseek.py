"""Hugging Face `transformers` adapters for latent attention (models/hf.py dispatches here when ModelArgs.mla is
set): DeepseekV3ForCausalLM (sigmoid scores; DeepSeek-V3, Kimi K2 and Moonlight are published in its layout)
and DeepseekV2ForCausalLM (softmax scores not renormalised; DeepSeek-V2-Lite).

Names: the attention's wq, wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo are q_proj, q_a_proj, q_a_layernorm,
q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; shared experts mlp.shared_experts.*, the
router mlp.gate, DeepSeek-V3's balancing bias mlp.gate.e_score_correction_bias (our router.expert_bias).
Routed experts as models/hf_moe.py writes and reads them (per expert as on the Hub, or fused).

Rotary rows: the families rotate interleaved pairs (x0, x1), (x2, x3), ... of each head's rotary part
(DeepseekV3 with rope_interleave, the default; DeepseekV2 always) and we rotate halves. The rows of the
projections that make the rotary parts (wq or wq_b per head, the last qk_rope_head_dim rows of wkv_a) are
permuted on the way in (evens first, then odds) and back on the way out, so both compute the same
numbers. Multi-token prediction layers (a checkpoint's layers past num_hidden_layers) are not imported and
not exported: they serve training only.
"""

import dataclasses
import logging

import torch

from trillion.models.args import MLAArgs, ModelArgs, MoEArgs, YaRNArgs
from trillion.models.hf import llama_args_from_config, llama_names_to_ours
from trillion.models.hf_moe import EXPERT_BIAS, experts_from_hf, names_to_hf

log = logging.getLogger(__name__)

FAMILIES = ("deepseek_v3", "deepseek_v2")
CLASSES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}
LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wq_a": "self_attn.q_a_proj",
    "attention.q_norm": "self_attn.q_a_layernorm",
    "attention.wq_b": "self_attn.q_b_proj",
    "attention.wkv_a": "self_attn.kv_a_proj_with_mqa",
    "attention.kv_norm": "self_attn.kv_a_layernorm",
    "attention.wkv_b": "self_attn.kv_b_proj",
    "attention.wo": "self_attn.o_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",  # the first_k_dense_replace blocks
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "feed_forward.shared_experts.w3": "mlp.shared_experts.up_proj",
    "feed_forward.shared_experts.w2": "mlp.shared_experts.down_proj",
    "feed_forward.router.gate": "mlp.gate",
}
CORRECTION_BIAS = "mlp.gate.e_score_correction_bias"


def deepseek_family(args: ModelArgs) -> str:
    """The transformers model_type of a latent-attention model, checked: it can express `args`."""
    family = _family(args)
    check_expressible(args, family)
    return family


def _family(args: ModelArgs) -> str:
    """Sigmoid scores are DeepSeek-V3's, softmax DeepSeek-V2's."""
    return "deepseek_v3" if args.moe is not None and args.moe.score_func == "sigmoid" else "deepseek_v2"


def check_expressible(args: ModelArgs, family: str) -> None:
    """Raise ValueError naming every setting `family` cannot express (its model would compute otherwise)."""
    moe = args.moe
    problems = [
        *(["model.mlp must be swiglu"] if args.mlp != "swiglu" else []),
        *(["model.norm must be rmsnorm"] if args.norm != "rmsnorm" else []),
        *(["model.bias must be false"] if args.bias else []),
        *(["experts (moe) are required: the family's blocks past first_k_dense_replace are MoE"] if not moe else []),
    ]
    if moe is not None:
        problems += [f"moe.capacity_factor={moe.capacity_factor} (dropless only)"] if moe.capacity_factor > 0 else []
        problems += (
            ["moe.n_shared_experts=0 (its MoE blocks always have shared experts)"] if not moe.n_shared_experts else []
        )
    if moe is not None and family == "deepseek_v2":  # softmax, greedy top-k, never renormalised
        problems += ["moe.route_norm=true (DeepseekV2 never renormalises the chosen scores)"] if moe.route_norm else []
        if moe.n_groups > 1:
            problems.append(f"moe.n_groups={moe.n_groups} (its group-limited routing ranks groups otherwise)")
    if problems:
        raise ValueError(f"{CLASSES[family]} cannot express this model: {'; '.join(problems)}.")


def hf_deepseek_config(args: ModelArgs):
    """DeepseekV3Config or DeepseekV2Config for `args` (args.mla set), MTP off."""
    mla, moe, family = args.mla, args.moe, deepseek_family(args)
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.yarn is not None:
        yarn = args.yarn
        rope |= dict(rope_type="yarn", factor=yarn.factor, original_max_position_embeddings=yarn.original_max_seq_len)
        rope |= dict(beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow, mscale=yarn.mscale)
        rope |= dict(mscale_all_dim=yarn.mscale_all_dim)
    common = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden,
        moe_intermediate_size=moe.expert_ffn_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_heads,
        n_shared_experts=moe.n_shared_experts,
        n_routed_experts=moe.n_experts,
        routed_scaling_factor=moe.route_scale,
        kv_lora_rank=mla.kv_lora_rank,
        q_lora_rank=mla.q_lora_rank or None,
        qk_rope_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        qk_nope_head_dim=mla.qk_nope_head_dim,
        num_experts_per_tok=moe.top_k,
        first_k_dense_replace=moe.n_dense_layers,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        tie_word_embeddings=args.tie_embeddings,
        rope_parameters=rope,
        attention_bias=False,
    )
    if family == "deepseek_v2":
        from transformers import DeepseekV2Config

        return DeepseekV2Config(topk_method="greedy", norm_topk_prob=False, **common)
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        n_group=moe.n_groups,
        topk_group=moe.topk_groups,
        norm_topk_prob=moe.route_norm,
        rope_interleave=True,
        num_nextn_predict_layers=0,
        **common,
    )


def deepseek_to_hf(state: dict[str, torch.Tensor], args: ModelArgs, layout: str = "legacy") -> dict[str, torch.Tensor]:
    """Our names and layouts -> transformers', routed experts per expert ("legacy", the Hub's) or "fused"."""
    family = deepseek_family(args)

    def bias_to_hf(index: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if family == "deepseek_v3":
            return {f"model.layers.{index}.{CORRECTION_BIAS}": tensor}
        if torch.count_nonzero(tensor):
            log.warning("layers.%s: its nonzero expert_bias is dropped; DeepseekV2 routes without it", index)
        return {}

    out = names_to_hf(_rope_rows(state, args, to_interleaved=True), args, LAYER_NAMES, family, layout, bias_to_hf)
    if family == "deepseek_v3":  # a router without our bias still has the family's (zeros)
        for i in range(args.n_layers):
            if args.is_moe_layer(i):
                out.setdefault(f"model.layers.{i}.{CORRECTION_BIAS}", torch.zeros(args.moe.n_experts))
    return out


def deepseek_from_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """transformers' names (either expert layout) -> ours; layers past args.n_layers (MTP) are left out.
    Names that fit nothing are returned unchanged, for the caller's key check to name."""
    family = _family(args)  # no expressibility check: a run may start from these weights with its own routing
    mtp = {k for k in state if k.startswith("model.layers.") and int(k.split(".")[2]) >= args.n_layers}
    if mtp:
        log.info("%d tensors of layers past %d (multi-token prediction) are not imported", len(mtp), args.n_layers)
    state = {k: v for k, v in state.items() if k not in mtp}
    out = {}
    for i in range(args.n_layers):
        bias = state.pop(f"model.layers.{i}.{CORRECTION_BIAS}", None)
        if args.is_moe_layer(i):
            out.update(experts_from_hf(state, f"model.layers.{i}.mlp.", f"layers.{i}.feed_forward.", family, args))
            out.update(_bias_from_hf(bias, i, args))
    out.update(llama_names_to_ours(state, LAYER_NAMES))
    return _rope_rows(out, args, to_interleaved=False)


def _bias_from_hf(bias: torch.Tensor | None, index: int, args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our balancing bias from the checkpoint's correction bias (zeros without one); none if we keep none."""
    if args.moe.bias_update_rate > 0:
        return {
            f"layers.{index}.feed_forward.{EXPERT_BIAS}": bias if bias is not None else torch.zeros(args.moe.n_experts)
        }
    if bias is not None and torch.count_nonzero(bias):
        log.warning("layers.%d: the checkpoint's e_score_correction_bias is dropped (moe.bias_update_rate=0)", index)
    return {}


def _rope_rows(state: dict[str, torch.Tensor], args: ModelArgs, to_interleaved: bool) -> dict[str, torch.Tensor]:
    """`state` with the rotary rows of wq / wq_b (per head) and wkv_a reordered between our half-split layout
    and the families' interleaved pairs (see the module docstring)."""
    mla, rope = args.mla, args.mla.qk_rope_head_dim
    halves = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])  # ours[j] = theirs[halves[j]]
    order = torch.argsort(halves) if to_interleaved else halves
    out = dict(state)
    for name, tensor in state.items():
        if name.endswith(("attention.wq.weight", "attention.wq_b.weight")):
            heads = tensor.view(-1, mla.qk_head_dim, tensor.shape[-1])
            nope, rot = heads.split([mla.qk_nope_head_dim, rope], dim=1)
            out[name] = torch.cat([nope, rot[:, order]], dim=1).reshape(tensor.shape)
        elif name.endswith("attention.wkv_a.weight"):
            latent, rot = tensor.split([mla.kv_lora_rank, rope])
            out[name] = torch.cat([latent, rot[order]])
    return out


def args_from_deepseek_config(config: dict) -> ModelArgs:
    """ModelArgs of a DeepSeek-V2/V3 (or Kimi K2) config.json (the inverse of hf_deepseek_config, MTP off)."""
    _refuse_unmapped(config)
    v3 = config["model_type"] != "deepseek_v2"
    n_group = config.get("n_group") or 1
    moe = MoEArgs(
        n_experts=config["n_routed_experts"],
        top_k=config["num_experts_per_tok"],
        expert_ffn_dim=config["moe_intermediate_size"],
        n_shared_experts=config.get("n_shared_experts") or 0,
        n_dense_layers=config.get("first_k_dense_replace", 0),
        score_func="sigmoid" if v3 else "softmax",
        route_norm=bool(config.get("norm_topk_prob", v3)) if v3 else False,
        route_scale=config.get("routed_scaling_factor", 1.0),
        n_groups=n_group if v3 else 1,
        topk_groups=(config.get("topk_group") or 1) if v3 else 1,
        bias_update_rate=1e-3 if v3 else 0.0,  # DeepSeek-V3's rate; the buffer holds e_score_correction_bias
    )
    mla = MLAArgs(
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        q_lora_rank=config.get("q_lora_rank") or 0,
    )
    args = llama_args_from_config(config)
    return dataclasses.replace(args, n_kv_heads=None, mla=mla, moe=moe, yarn=_yarn_from_config(config))


def _rope_parameters(config: dict) -> dict:
    """transformers 5's rope_parameters, or the rope_scaling of the Hub's config.json files."""
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def _yarn_from_config(config: dict) -> YaRNArgs | None:
    rope = _rope_parameters(config)
    if rope.get("rope_type", rope.get("type", "default")) != "yarn":
        return None
    return YaRNArgs(
        factor=rope["factor"],
        original_max_seq_len=rope["original_max_position_embeddings"],
        beta_fast=rope.get("beta_fast") or 32.0,
        beta_slow=rope.get("beta_slow") or 1.0,
        mscale=rope.get("mscale") or 0.0,  # absent: no mscale ratio (transformers' rule), not a ratio to 1
        mscale_all_dim=rope.get("mscale_all_dim", 0.0),
    )


def _refuse_unmapped(config: dict) -> None:
    """ValueError naming what a config.json sets that this transformer cannot compute."""
    rope = _rope_parameters(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    problems = [f"rope of type {kind!r}"] if kind not in ("default", "yarn") else []
    if config.get("rope_interleave") is False:
        problems.append("rope_interleave false (imports permute the rotary rows as for interleaved pairs)")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config['hidden_act']!r}")
    if config.get("moe_layer_freq", 1) != 1:
        problems.append(f"moe_layer_freq {config['moe_layer_freq']} (MoE blocks must be consecutive)")
    if config.get("attention_bias"):
        problems.append("attention_bias true")
    if config["model_type"] == "deepseek_v2" and config.get("topk_method", "greedy") != "greedy":
        problems.append(f"topk_method {config['topk_method']!r} (greedy only)")
    scores = "softmax" if config["model_type"] == "deepseek_v2" else "sigmoid"  # what the family computes
    if config.get("scoring_func", scores) != scores:
        problems.append(f"scoring_func {config['scoring_func']!r}")
    if problems:
        raise ValueError(f"model_type {config['model_type']!r}: {'; '.join(problems)} do not map onto this transformer")
