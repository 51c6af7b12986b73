"""DeepseekV3ForCausalLM: sigmoid scores, group-limited routing, and the balancing bias kept as
mlp.gate.e_score_correction_bias. DeepSeek-V3, Kimi K2 and Moonlight are published in its layout."""

import torch

from trillion.models.args import ModelArgs, MoEArgs
from trillion.models.hf_adapters.base import StateDict
from trillion.models.hf_adapters.deepseek import CORRECTION_BIAS, DeepSeek


class DeepSeekV3(DeepSeek):
    model_type = "deepseek_v3"
    aliases = ("kimi_k2",)  # Kimi K2's config.json names its own model_type over DeepSeek-V3's layout
    hf_class = "DeepseekV3ForCausalLM"
    score_func = "sigmoid"

    def hf_config(self, args: ModelArgs):
        from transformers import DeepseekV3Config

        moe = args.moe
        return DeepseekV3Config(
            n_group=moe.n_groups,
            topk_group=moe.topk_groups,
            norm_topk_prob=moe.route_norm,
            rope_interleave=True,
            num_nextn_predict_layers=0,
            **self.common_config(args),
        )

    def bias_to_hf(self, index: str, bias: torch.Tensor) -> StateDict:
        return {f"model.layers.{index}.{CORRECTION_BIAS}": bias}

    def to_hf(self, state: StateDict, args: ModelArgs, layout: str) -> StateDict:
        out = super().to_hf(state, args, layout)
        for i in range(args.n_layers):  # a router without our bias still has the family's (zeros)
            if args.is_moe_layer(i):
                out.setdefault(f"model.layers.{i}.{CORRECTION_BIAS}", torch.zeros(args.moe.n_experts))
        return out

    def moe_args(self, config: dict) -> MoEArgs:
        return MoEArgs(
            **self.routed_experts(config),
            route_norm=bool(config.get("norm_topk_prob", True)),
            n_groups=config.get("n_group") or 1,
            topk_groups=config.get("topk_group") or 1,
            bias_update_rate=1e-3,  # DeepSeek-V3's rate; the buffer holds e_score_correction_bias
        )
