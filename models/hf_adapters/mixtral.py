"""MixtralForCausalLM: every block a mixture of experts, top-k scores always renormalised. Its Hub
checkpoints name the feed-forward block_sparse_moe and each expert's projections w1, w3, w2."""

from trillion.models.args import ModelArgs, MoEArgs
from trillion.models.hf_adapters.base import StateDict
from trillion.models.hf_adapters.llama_moe import LlamaMoE

HUB_BLOCK, MEMORY_BLOCK = ".block_sparse_moe.", ".mlp."  # the Hub's name of the feed-forward, and transformers'


class Mixtral(LlamaMoE):
    model_type = "mixtral"
    hf_class = "MixtralForCausalLM"
    qk_norm = False
    expert_names = ("w1", "w3", "w2")

    def cannot_express(self, args: ModelArgs) -> list[str]:
        moe = args.moe
        return [
            *super().cannot_express(args),
            *([f"moe.n_dense_layers={moe.n_dense_layers} (every block is MoE)"] if moe.n_dense_layers else []),
            *(["moe.route_norm=false (top-k scores always renormalised)"] if not moe.route_norm else []),
        ]

    def hf_config(self, args: ModelArgs):
        from transformers import MixtralConfig

        return MixtralConfig(
            intermediate_size=args.moe.expert_ffn_dim,
            num_local_experts=args.moe.n_experts,
            sliding_window=None,
            router_jitter_noise=0.0,
            **self.common_config(args),
        )

    def to_hf(self, state: StateDict, args: ModelArgs, layout: str) -> StateDict:
        out = super().to_hf(state, args, layout)
        if layout == "legacy":
            out = {k.replace(MEMORY_BLOCK, HUB_BLOCK, 1): v for k, v in out.items()}
        return out

    def from_hf(self, state: StateDict, args: ModelArgs) -> StateDict:
        return super().from_hf({k.replace(HUB_BLOCK, MEMORY_BLOCK, 1): v for k, v in state.items()}, args)

    def moe_args(self, config: dict) -> MoEArgs:
        return MoEArgs(
            n_experts=self.n_experts(config),
            top_k=config["num_experts_per_tok"],
            expert_ffn_dim=config["intermediate_size"],
            aux_loss_coef=config.get("router_aux_loss_coef", 0.0),
        )

    def sliding_window(self, config: dict) -> int | None:
        return config.get("sliding_window")
