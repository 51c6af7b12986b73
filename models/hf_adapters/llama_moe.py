"""What Mixtral and Qwen3-MoE share: Llama's blocks (plus Qwen3's per-head query and key norms) with
softmax-routed, dropless experts and no shared experts (experts.py moves the experts)."""

import abc
import dataclasses
import logging

import torch

from trillion.models.args import ModelArgs, MoEArgs
from trillion.models.hf_adapters import experts, llama_style
from trillion.models.hf_adapters.base import HFAdapter, StateDict, refuse_unmapped

log = logging.getLogger(__name__)

LAYER_NAMES = {
    **llama_style.LAYER_NAMES,  # its feed-forward: a dense block (Qwen3-MoE's mlp_only_layers)
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "feed_forward.router.gate": "mlp.gate",
}


class LlamaMoE(HFAdapter):
    qk_norm: bool  # whether the family's attention norms each query and key head (Qwen3-MoE's does)
    expert_names: tuple[str, str, str]  # the Hub checkpoints' names of our w1 (gate), w3 (up), w2 (down)

    def claims(self, args: ModelArgs) -> bool:
        return args.mla is None and args.moe is not None and args.qk_norm == self.qk_norm

    def cannot_express(self, args: ModelArgs) -> list[str]:
        moe = args.moe
        return [
            *llama_style.cannot_express(args),
            *(["model.bias must be false"] if args.bias else []),
            *([f"moe.n_shared_experts={moe.n_shared_experts} (no shared experts)"] if moe.n_shared_experts else []),
            *([f"moe.score_func={moe.score_func!r} (softmax only)"] if moe.score_func != "softmax" else []),
            *([f"moe.n_groups={moe.n_groups} (no group-limited routing)"] if moe.n_groups > 1 else []),
            *([f"moe.route_scale={moe.route_scale} (1.0 only)"] if moe.route_scale != 1.0 else []),
            *([f"moe.capacity_factor={moe.capacity_factor} (dropless only)"] if moe.capacity_factor > 0 else []),
        ]

    def common_config(self, args: ModelArgs) -> dict:
        """The config fields both families name alike."""
        return dict(
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
            num_experts_per_tok=args.moe.top_k,
            router_aux_loss_coef=args.moe.aux_loss_coef,
            output_router_logits=False,
        )

    def to_hf(self, state: StateDict, args: ModelArgs, layout: str) -> StateDict:
        def drop_bias(index: str, tensor: torch.Tensor) -> StateDict:  # neither family balances by a bias
            if torch.count_nonzero(tensor):
                log.warning("layers.%s: its nonzero expert_bias is dropped; the export routes without it", index)
            return {}

        return experts.moe_to_hf(state, args, LAYER_NAMES, self.expert_names, layout, drop_bias)

    def from_hf(self, state: StateDict, args: ModelArgs) -> StateDict:
        state, out = dict(state), {}
        for i in range(args.n_layers):
            if args.is_moe_layer(i):
                out.update(experts.experts_from_hf(state, i, self.expert_names, args.moe.n_experts))
        out.update(llama_style.names_to_ours(state, LAYER_NAMES))
        if args.moe.bias_update_rate > 0:  # our balancing bias starts from zero: the families have none
            for i in range(args.n_layers):
                if args.is_moe_layer(i):
                    out.setdefault(f"layers.{i}.feed_forward.{experts.EXPERT_BIAS}", torch.zeros(args.moe.n_experts))
        return out

    def args_from_config(self, config: dict) -> ModelArgs:
        refuse_unmapped(config["model_type"], self.unmapped(config))
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return dataclasses.replace(
            llama_style.args_from_config(config),
            explicit_head_dim=head_dim if head_dim != config["hidden_size"] // config["num_attention_heads"] else None,
            qk_norm=self.qk_norm,
            moe=self.moe_args(config),
        )

    @abc.abstractmethod
    def moe_args(self, config: dict) -> MoEArgs:
        """The experts of the family's config.json."""

    def unmapped(self, config: dict) -> list[str]:
        """What the family's config.json sets that this transformer cannot compute."""
        problems = [] if self.n_experts(config) else ["no experts (num_experts 0)"]
        for key in ("rope_parameters", "rope_scaling"):  # transformers 5's key, and older config.json files'
            rope = config.get(key) or {}
            if rope.get("rope_type", rope.get("type", "default")) != "default":
                problems.append(f"{key} of type {rope.get('rope_type', rope.get('type'))!r}")
        if config.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act {config['hidden_act']!r}")
        window = self.sliding_window(config)
        if window is not None and window < config["max_position_embeddings"]:
            problems.append(f"sliding_window {window}")
        return problems

    @staticmethod
    def n_experts(config: dict) -> int:
        return config.get("num_experts") or config.get("num_local_experts")

    @abc.abstractmethod
    def sliding_window(self, config: dict) -> int | None:
        """The attention window the config.json asks for, None for full attention."""
