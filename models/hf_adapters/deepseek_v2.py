"""DeepseekV2ForCausalLM: softmax scores, greedy top-k, never renormalised, no balancing bias
(DeepSeek-V2-Lite)."""

import logging

import torch

from trillion.models.args import ModelArgs, MoEArgs
from trillion.models.hf_adapters.base import StateDict
from trillion.models.hf_adapters.deepseek import DeepSeek

log = logging.getLogger(__name__)


class DeepSeekV2(DeepSeek):
    model_type = "deepseek_v2"
    hf_class = "DeepseekV2ForCausalLM"
    score_func = "softmax"

    def cannot_express(self, args: ModelArgs) -> list[str]:
        problems, moe = super().cannot_express(args), args.moe
        if moe is not None and moe.route_norm:
            problems.append("moe.route_norm=true (DeepseekV2 never renormalises the chosen scores)")
        if moe is not None and moe.n_groups > 1:
            problems.append(f"moe.n_groups={moe.n_groups} (its group-limited routing ranks groups otherwise)")
        return problems

    def hf_config(self, args: ModelArgs):
        from transformers import DeepseekV2Config

        return DeepseekV2Config(topk_method="greedy", norm_topk_prob=False, **self.common_config(args))

    def bias_to_hf(self, index: str, bias: torch.Tensor) -> StateDict:
        if torch.count_nonzero(bias):
            log.warning("layers.%s: its nonzero expert_bias is dropped; DeepseekV2 routes without it", index)
        return {}

    def moe_args(self, config: dict) -> MoEArgs:
        return MoEArgs(**self.routed_experts(config), route_norm=False)

    def unmapped(self, config: dict) -> list[str]:
        problems = super().unmapped(config)
        if config.get("topk_method", "greedy") != "greedy":
            problems.append(f"topk_method {config['topk_method']!r} (greedy only)")
        return problems
