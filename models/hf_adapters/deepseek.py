"""What DeepSeek-V3 and DeepSeek-V2 share: multi-head latent attention, shared and routed experts after
the first_k_dense_replace dense blocks, and rotary rows in interleaved pairs.

Names: the attention's wq, wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo are q_proj, q_a_proj, q_a_layernorm,
q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; shared experts mlp.shared_experts.*, the
router mlp.gate. Routed experts as experts.py writes and reads them (per expert as on the Hub, or fused).

Rotary rows: the families rotate interleaved pairs (x0, x1), (x2, x3), ... of each head's rotary part
(DeepseekV3 with rope_interleave, the default; DeepseekV2 always) and we rotate halves. The rows of the
projections that make the rotary parts (wq or wq_b per head, the last qk_rope_head_dim rows of wkv_a) are
permuted on the way in (evens first, then odds) and back on the way out, so both compute the same
numbers. Multi-token prediction layers (a checkpoint's layers past num_hidden_layers) are not imported and
not exported: they serve training only."""

import abc
import dataclasses
import logging

import torch

from trillion.models.args import MLAArgs, ModelArgs, MoEArgs, YaRNArgs
from trillion.models.hf_adapters import experts, llama_style
from trillion.models.hf_adapters.base import HFAdapter, StateDict, refuse_unmapped

log = logging.getLogger(__name__)

LAYER_NAMES = {
    **llama_style.LAYER_NAMES,  # its feed-forward: the first_k_dense_replace blocks
    "attention.wq_a": "self_attn.q_a_proj",
    "attention.q_norm": "self_attn.q_a_layernorm",
    "attention.wq_b": "self_attn.q_b_proj",
    "attention.wkv_a": "self_attn.kv_a_proj_with_mqa",
    "attention.kv_norm": "self_attn.kv_a_layernorm",
    "attention.wkv_b": "self_attn.kv_b_proj",
    "feed_forward.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "feed_forward.shared_experts.w3": "mlp.shared_experts.up_proj",
    "feed_forward.shared_experts.w2": "mlp.shared_experts.down_proj",
    "feed_forward.router.gate": "mlp.gate",
}
CORRECTION_BIAS = "mlp.gate.e_score_correction_bias"  # DeepSeek-V3's balancing bias (our router.expert_bias)


class DeepSeek(HFAdapter):
    score_func: str  # how the family scores experts: only DeepSeek-V3 computes sigmoid scores

    def claims(self, args: ModelArgs) -> bool:
        sigmoid = args.moe is not None and args.moe.score_func == "sigmoid"
        return args.mla is not None and sigmoid == (self.score_func == "sigmoid")

    def cannot_express(self, args: ModelArgs) -> list[str]:
        moe, problems = args.moe, llama_style.cannot_express(args)
        if args.bias:
            problems.append("model.bias must be false")
        if moe is None:
            return [*problems, "experts (moe) are required: the family's blocks past first_k_dense_replace are MoE"]
        if moe.capacity_factor > 0:
            problems.append(f"moe.capacity_factor={moe.capacity_factor} (dropless only)")
        if not moe.n_shared_experts:
            problems.append("moe.n_shared_experts=0 (its MoE blocks always have shared experts)")
        return problems

    def common_config(self, args: ModelArgs) -> dict:
        """The config fields both families name alike, multi-token prediction off."""
        mla, moe = args.mla, args.moe
        return dict(
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
            rope_parameters=_rope_parameters_of(args),
            attention_bias=False,
        )

    @abc.abstractmethod
    def bias_to_hf(self, index: str, bias: torch.Tensor) -> StateDict:
        """Block `index`'s balancing bias as the family keeps it (or drops it)."""

    def to_hf(self, state: StateDict, args: ModelArgs, layout: str) -> StateDict:
        rows = _rope_rows(state, args, to_interleaved=True)
        return experts.moe_to_hf(rows, args, LAYER_NAMES, experts.QWEN_EXPERT_NAMES, layout, self.bias_to_hf)

    def from_hf(self, state: StateDict, args: ModelArgs) -> StateDict:
        """Layers past args.n_layers (multi-token prediction) are left out."""
        mtp = {k for k in state if k.startswith("model.layers.") and int(k.split(".")[2]) >= args.n_layers}
        if mtp:
            log.info("%d tensors of layers past %d (multi-token prediction) are not imported", len(mtp), args.n_layers)
        state = {k: v for k, v in state.items() if k not in mtp}
        out = {}
        for i in range(args.n_layers):
            bias = state.pop(f"model.layers.{i}.{CORRECTION_BIAS}", None)
            if args.is_moe_layer(i):
                out.update(experts.experts_from_hf(state, i, experts.QWEN_EXPERT_NAMES, args.moe.n_experts))
                out.update(_bias_from_hf(bias, i, args))
        out.update(llama_style.names_to_ours(state, LAYER_NAMES))
        return _rope_rows(out, args, to_interleaved=False)

    def args_from_config(self, config: dict) -> ModelArgs:
        refuse_unmapped(config["model_type"], self.unmapped(config))
        mla = MLAArgs(
            kv_lora_rank=config["kv_lora_rank"],
            qk_nope_head_dim=config["qk_nope_head_dim"],
            qk_rope_head_dim=config["qk_rope_head_dim"],
            v_head_dim=config["v_head_dim"],
            q_lora_rank=config.get("q_lora_rank") or 0,
        )
        args = llama_style.args_from_config(config)
        moe, yarn = self.moe_args(config), _yarn_from_config(config)
        return dataclasses.replace(args, n_kv_heads=None, mla=mla, moe=moe, yarn=yarn)

    def routed_experts(self, config: dict) -> dict:
        """The MoEArgs fields both families' config.json give alike."""
        return dict(
            n_experts=config["n_routed_experts"],
            top_k=config["num_experts_per_tok"],
            expert_ffn_dim=config["moe_intermediate_size"],
            n_shared_experts=config.get("n_shared_experts") or 0,
            n_dense_layers=config.get("first_k_dense_replace", 0),
            score_func=self.score_func,
            route_scale=config.get("routed_scaling_factor", 1.0),
        )

    @abc.abstractmethod
    def moe_args(self, config: dict) -> MoEArgs:
        """The experts of the family's config.json."""

    def unmapped(self, config: dict) -> list[str]:
        """What the family's config.json sets that this transformer cannot compute."""
        rope = rope_parameters(config)
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
        if config.get("scoring_func", self.score_func) != self.score_func:
            problems.append(f"scoring_func {config['scoring_func']!r}")
        return problems


def _bias_from_hf(bias: torch.Tensor | None, index: int, args: ModelArgs) -> StateDict:
    """Our balancing bias from the checkpoint's correction bias (zeros without one); none if we keep none."""
    if args.moe.bias_update_rate > 0:
        ours = bias if bias is not None else torch.zeros(args.moe.n_experts)
        return {f"layers.{index}.feed_forward.{experts.EXPERT_BIAS}": ours}
    if bias is not None and torch.count_nonzero(bias):
        log.warning("layers.%d: the checkpoint's e_score_correction_bias is dropped (moe.bias_update_rate=0)", index)
    return {}


def _rope_rows(state: StateDict, args: ModelArgs, to_interleaved: bool) -> StateDict:
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


def _rope_parameters_of(args: ModelArgs) -> dict:
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.yarn is not None:
        yarn = args.yarn
        rope |= dict(rope_type="yarn", factor=yarn.factor, original_max_position_embeddings=yarn.original_max_seq_len)
        rope |= dict(beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow, mscale=yarn.mscale)
        rope |= dict(mscale_all_dim=yarn.mscale_all_dim)
    return rope


def rope_parameters(config: dict) -> dict:
    """transformers 5's rope_parameters, or the rope_scaling of the Hub's config.json files."""
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def _yarn_from_config(config: dict) -> YaRNArgs | None:
    rope = rope_parameters(config)
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
