"""Qwen3MoeForCausalLM: per-head query and key norms, a head width of its own, dense first blocks
(mlp_only_layers) and optionally renormalised top-k scores (norm_topk_prob)."""

from trillion.models.args import ModelArgs, MoEArgs
from trillion.models.hf_adapters.experts import QWEN_EXPERT_NAMES
from trillion.models.hf_adapters.llama_moe import LlamaMoE


class Qwen3Moe(LlamaMoE):
    model_type = "qwen3_moe"
    hf_class = "Qwen3MoeForCausalLM"
    qk_norm = True
    expert_names = QWEN_EXPERT_NAMES

    def hf_config(self, args: ModelArgs):
        from transformers import Qwen3MoeConfig

        moe = args.moe
        return Qwen3MoeConfig(
            intermediate_size=args.ffn_hidden,  # the dense blocks' width (mlp_only_layers)
            moe_intermediate_size=moe.expert_ffn_dim,
            num_experts=moe.n_experts,
            norm_topk_prob=moe.route_norm,
            decoder_sparse_step=1,
            mlp_only_layers=list(range(moe.n_dense_layers)),
            attention_bias=False,
            use_sliding_window=False,
            **self.common_config(args),
        )

    def moe_args(self, config: dict) -> MoEArgs:
        return MoEArgs(
            n_experts=self.n_experts(config),
            top_k=config["num_experts_per_tok"],
            expert_ffn_dim=config["moe_intermediate_size"],
            n_dense_layers=len(config.get("mlp_only_layers") or []),
            route_norm=bool(config.get("norm_topk_prob", False)),
            aux_loss_coef=config.get("router_aux_loss_coef", 0.0),
        )

    def sliding_window(self, config: dict) -> int | None:
        return config.get("sliding_window") if config.get("use_sliding_window") else None

    def unmapped(self, config: dict) -> list[str]:
        problems = super().unmapped(config)
        if config.get("decoder_sparse_step", 1) != 1:
            problems.append(f"decoder_sparse_step {config['decoder_sparse_step']} (MoE blocks must be consecutive)")
        dense = sorted(config.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))):
            problems.append(f"mlp_only_layers {dense} (only the first blocks may be dense)")
        if config.get("attention_bias"):
            problems.append("attention_bias true")
        return problems
