"""LlamaForCausalLM: dense SwiGLU blocks, grouped-query attention, rotary positions, RMSNorm."""

from trillion.models.args import ModelArgs
from trillion.models.hf_adapters import llama_style
from trillion.models.hf_adapters.base import HFAdapter, StateDict, head_width_problems


class Llama(HFAdapter):
    model_type = "llama"
    hf_class = "LlamaForCausalLM"

    def claims(self, args: ModelArgs) -> bool:
        return args.mla is None and args.moe is None and args.mlp == "swiglu"

    def cannot_express(self, args: ModelArgs) -> list[str]:
        return [
            *llama_style.cannot_express(args),
            *(["model.qk_norm without experts (no query and key norms)"] if args.qk_norm else []),
            *head_width_problems(args),
            *(["model.yarn (plain rotary frequencies only)"] if args.yarn is not None else []),
        ]

    def hf_config(self, args: ModelArgs):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=args.vocab_size,
            hidden_size=args.dim,
            intermediate_size=args.ffn_hidden,
            num_hidden_layers=args.n_layers,
            num_attention_heads=args.n_heads,
            num_key_value_heads=args.kv_heads,
            max_position_embeddings=args.max_seq_len,
            rms_norm_eps=args.norm_eps,
            tie_word_embeddings=args.tie_embeddings,
            rope_theta=args.rope_theta,
            attention_bias=args.bias,
            mlp_bias=args.bias,
        )

    def to_hf(self, state: StateDict, args: ModelArgs, layout: str) -> StateDict:
        return llama_style.names_to_hf(state, llama_style.LAYER_NAMES)

    def from_hf(self, state: StateDict, args: ModelArgs) -> StateDict:
        return llama_style.names_to_ours(state, llama_style.LAYER_NAMES)

    def args_from_config(self, config: dict) -> ModelArgs:
        return llama_style.args_from_config(config)
