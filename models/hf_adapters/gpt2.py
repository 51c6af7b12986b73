"""GPT2LMHeadModel: dense GeLU blocks, learned positions, LayerNorm with biases. Its Conv1D layers store
weights as (in, out), ours transposed, and its attention fuses q, k and v in one c_attn."""

import torch

from trillion.models.args import ModelArgs
from trillion.models.hf_adapters.base import HFAdapter, StateDict, head_width_problems

TOP_NAMES = {
    "tok_embeddings.weight": "transformer.wte.weight",
    "pos_embeddings.weight": "transformer.wpe.weight",
    "norm.weight": "transformer.ln_f.weight",
    "norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
}
NORMS = (("attention_norm", "ln_1"), ("ffn_norm", "ln_2"))
LINEARS = (("attention.wo", "attn.c_proj"), ("feed_forward.w1", "mlp.c_fc"), ("feed_forward.w2", "mlp.c_proj"))
BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal masks older transformers saved with the weights


class GPT2(HFAdapter):
    model_type = "gpt2"
    hf_class = "GPT2LMHeadModel"

    def claims(self, args: ModelArgs) -> bool:
        return args.mla is None and args.moe is None and args.mlp != "swiglu"

    def cannot_express(self, args: ModelArgs) -> list[str]:
        problems = [] if args.norm == "layernorm" else ["model.norm must be layernorm"]
        if args.positions != "learned":
            problems.append("model.positions must be learned")
        if not args.bias:
            problems.append("model.bias must be true")
        if args.kv_heads != args.n_heads:
            problems.append(f"model.n_kv_heads={args.n_kv_heads} (no grouped-query attention)")
        if args.qk_norm:
            problems.append("model.qk_norm (no query and key norms)")
        return problems + head_width_problems(args)

    def hf_config(self, args: ModelArgs):
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=args.vocab_size,
            n_positions=args.max_seq_len,
            n_embd=args.dim,
            n_layer=args.n_layers,
            n_head=args.n_heads,
            n_inner=args.ffn_hidden,
            activation_function="gelu_new",
            layer_norm_epsilon=args.norm_eps,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=args.tie_embeddings,
        )

    def to_hf(self, state: StateDict, args: ModelArgs, layout: str) -> StateDict:
        out = {TOP_NAMES[k]: v for k, v in state.items() if k in TOP_NAMES}
        for i in range(args.n_layers):
            layer = lambda part: state[f"layers.{i}.{part}"]  # noqa: E731
            prefix = f"transformer.h.{i}."
            for ours, theirs in NORMS:
                out[prefix + theirs + ".weight"] = layer(ours + ".weight")
                out[prefix + theirs + ".bias"] = layer(ours + ".bias")
            out[prefix + "attn.c_attn.weight"] = torch.cat([layer(f"attention.w{p}.weight") for p in "qkv"]).t()
            out[prefix + "attn.c_attn.bias"] = torch.cat([layer(f"attention.w{p}.bias") for p in "qkv"])
            for ours, theirs in LINEARS:
                out[prefix + theirs + ".weight"] = layer(ours + ".weight").t()
                out[prefix + theirs + ".bias"] = layer(ours + ".bias")
        return out

    def from_hf(self, state: StateDict, args: ModelArgs) -> StateDict:
        names = {theirs: ours for ours, theirs in TOP_NAMES.items()}
        out = {names[k]: state.pop(k) for k in list(state) if k in names}
        q_size, kv_size = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
        for i in range(args.n_layers):
            take = lambda part: state.pop(f"transformer.h.{i}.{part}")  # noqa: E731
            for ours, theirs in NORMS:
                out[f"layers.{i}.{ours}.weight"] = take(theirs + ".weight")
                out[f"layers.{i}.{ours}.bias"] = take(theirs + ".bias")
            for part, weight, bias in zip(
                "qkv",
                take("attn.c_attn.weight").t().split([q_size, kv_size, kv_size]),
                take("attn.c_attn.bias").split([q_size, kv_size, kv_size]),
            ):
                out[f"layers.{i}.attention.w{part}.weight"] = weight
                out[f"layers.{i}.attention.w{part}.bias"] = bias
            for ours, theirs in LINEARS:
                out[f"layers.{i}.{ours}.weight"] = take(theirs + ".weight").t()
                out[f"layers.{i}.{ours}.bias"] = take(theirs + ".bias")
        out.update({k: v for k, v in state.items() if not k.endswith(BUFFERS)})
        return out

    def args_from_config(self, config: dict) -> ModelArgs:
        return ModelArgs(
            n_layers=config["n_layer"],
            dim=config["n_embd"],
            n_heads=config["n_head"],
            ffn_dim=config.get("n_inner"),
            vocab_size=config["vocab_size"],
            max_seq_len=config["n_positions"],
            norm="layernorm",
            norm_eps=config["layer_norm_epsilon"],
            mlp="gelu",
            positions="learned",
            bias=True,
            tie_embeddings=config.get("tie_word_embeddings", False),
        )
