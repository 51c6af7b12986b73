"""Hugging Face `transformers` adapters: configs and parameter names for LlamaForCausalLM and
GPT2LMHeadModel, (models/hf_moe.py) MixtralForCausalLM and Qwen3MoeForCausalLM, and (models/hf_deepseek.py)
DeepseekV3ForCausalLM and DeepseekV2ForCausalLM, so weights move both ways without changing a value."""

import torch

from trillion.models.args import ModelArgs


def hf_config(args: ModelArgs):
    """The transformers config that describes the same network as `args` (ValueError naming what it cannot)."""
    if args.mla is not None:
        from trillion.models.hf_deepseek import hf_deepseek_config

        return hf_deepseek_config(args)
    if args.moe is not None:
        from trillion.models.hf_moe import hf_moe_config

        return hf_moe_config(args)
    if args.qk_norm:
        raise ValueError("model.qk_norm without experts: LlamaForCausalLM has no query and key norms")
    if args.mlp == "swiglu":
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


def to_hf_state_dict(
    state: dict[str, torch.Tensor], args: ModelArgs, layout: str = "legacy"
) -> dict[str, torch.Tensor]:
    """Our parameter names and layouts -> the transformers model's. `layout`, for a mixture of experts:
    "legacy" (one matrix per expert, as Hub checkpoints and save_pretrained have them) or "fused"
    (transformers' in-memory gate_up_proj / down_proj); from_pretrained loads either."""
    if args.mla is not None:
        from trillion.models.hf_deepseek import deepseek_to_hf

        return deepseek_to_hf(state, args, layout)
    if args.moe is not None:
        from trillion.models.hf_moe import moe_to_hf

        return moe_to_hf(state, args, layout)
    if args.qk_norm:
        raise ValueError("model.qk_norm without experts: LlamaForCausalLM has no query and key norms")
    return (_llama_from_ours if args.mlp == "swiglu" else _gpt2_from_ours)(state, args)


def from_hf_state_dict(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """The transformers model's parameter names and layouts -> ours (the inverse of to_hf_state_dict).

    A tied checkpoint stores no lm_head; our output then reads the embedding table. Names this
    family does not have are returned unchanged, so the caller's key check can name them. Experts may
    come in either layout (per expert or fused)."""
    if args.mla is not None:
        from trillion.models.hf_deepseek import deepseek_from_hf

        ours = deepseek_from_hf(dict(state), args)
    elif args.moe is not None:
        from trillion.models.hf_moe import moe_from_hf

        ours = moe_from_hf(dict(state), args)
    else:
        ours = (_llama_to_ours if args.mlp == "swiglu" else _gpt2_to_ours)(dict(state), args)
    if args.tie_embeddings:
        ours.setdefault("output.weight", ours["tok_embeddings.weight"])
    return ours


LLAMA_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LLAMA_LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _llama_from_ours(state, args):
    out = {}
    for name, tensor in state.items():
        if name in LLAMA_NAMES:
            out[LLAMA_NAMES[name]] = tensor
            continue
        _, index, rest = name.split(".", 2)
        module, _, leaf = rest.rpartition(".")
        out[f"model.layers.{index}.{LLAMA_LAYER_NAMES[module]}.{leaf}"] = tensor
    return out


def _llama_to_ours(state, args):
    return llama_names_to_ours(state, LLAMA_LAYER_NAMES)


def llama_names_to_ours(state, layer_names: dict[str, str]) -> dict:
    """Llama-style names -> ours, `layer_names` mapping our per-layer modules to theirs (Mixtral and
    Qwen3-MoE use it with their own); names it does not know are returned unchanged."""
    names = {theirs: ours for ours, theirs in LLAMA_NAMES.items()}
    per_layer = {theirs: ours for ours, theirs in layer_names.items()}
    out = {}
    for name, tensor in state.items():
        if name in names:
            out[names[name]] = tensor
        elif name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            module, _, leaf = rest.rpartition(".")
            out[f"layers.{index}.{per_layer.get(module, module)}.{leaf}"] = tensor
        else:
            out[name] = tensor
    return out


def _gpt2_from_ours(state, args):
    names = {
        "tok_embeddings.weight": "transformer.wte.weight",
        "pos_embeddings.weight": "transformer.wpe.weight",
        "norm.weight": "transformer.ln_f.weight",
        "norm.bias": "transformer.ln_f.bias",
        "output.weight": "lm_head.weight",
    }
    out = {names[k]: v for k, v in state.items() if k in names}
    for i in range(args.n_layers):
        layer = lambda part: state[f"layers.{i}.{part}"]  # noqa: E731
        prefix = f"transformer.h.{i}."
        # GPT-2's Conv1D stores weights as (in, out): ours transposed; q, k, v fused in one c_attn.
        for ours, theirs in (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")):
            out[prefix + theirs + ".weight"], out[prefix + theirs + ".bias"] = (
                layer(ours + ".weight"),
                layer(ours + ".bias"),
            )
        out[prefix + "attn.c_attn.weight"] = torch.cat([layer(f"attention.w{p}.weight") for p in "qkv"]).t()
        out[prefix + "attn.c_attn.bias"] = torch.cat([layer(f"attention.w{p}.bias") for p in "qkv"])
        for ours, theirs in (
            ("attention.wo", "attn.c_proj"),
            ("feed_forward.w1", "mlp.c_fc"),
            ("feed_forward.w2", "mlp.c_proj"),
        ):
            out[prefix + theirs + ".weight"] = layer(ours + ".weight").t()
            out[prefix + theirs + ".bias"] = layer(ours + ".bias")
    return out


GPT2_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal masks older transformers saved with the weights


def _gpt2_to_ours(state, args):
    names = {
        "transformer.wte.weight": "tok_embeddings.weight",
        "transformer.wpe.weight": "pos_embeddings.weight",
        "transformer.ln_f.weight": "norm.weight",
        "transformer.ln_f.bias": "norm.bias",
        "lm_head.weight": "output.weight",
    }
    out = {names[k]: state.pop(k) for k in list(state) if k in names}
    q_size, kv_size = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    for i in range(args.n_layers):
        prefix = f"transformer.h.{i}."
        take = lambda part: state.pop(prefix + part)  # noqa: E731
        for ours, theirs in (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")):
            out[f"layers.{i}.{ours}.weight"], out[f"layers.{i}.{ours}.bias"] = (
                take(theirs + ".weight"),
                take(theirs + ".bias"),
            )
        # Conv1D keeps (in, out): transpose back, and split the fused q, k, v.
        for part, weight, bias in zip(
            "qkv",
            take("attn.c_attn.weight").t().split([q_size, kv_size, kv_size]),
            take("attn.c_attn.bias").split([q_size, kv_size, kv_size]),
        ):
            out[f"layers.{i}.attention.w{part}.weight"], out[f"layers.{i}.attention.w{part}.bias"] = weight, bias
        for ours, theirs in (
            ("attention.wo", "attn.c_proj"),
            ("feed_forward.w1", "mlp.c_fc"),
            ("feed_forward.w2", "mlp.c_proj"),
        ):
            out[f"layers.{i}.{ours}.weight"] = take(theirs + ".weight").t()
            out[f"layers.{i}.{ours}.bias"] = take(theirs + ".bias")
    out.update({k: v for k, v in state.items() if not k.endswith(GPT2_BUFFERS)})
    return out


def llama_args_from_config(config: dict) -> ModelArgs:
    """The Llama-style part of a config.json (Mixtral and Qwen3-MoE add their experts to it)."""
    rope = config.get("rope_parameters") or {}
    return ModelArgs(
        n_layers=config["num_hidden_layers"],
        dim=config["hidden_size"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads"),
        ffn_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        max_seq_len=config["max_position_embeddings"],
        norm="rmsnorm",
        norm_eps=config["rms_norm_eps"],
        mlp="swiglu",
        positions="rope",
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        bias=config.get("attention_bias", False),
        tie_embeddings=config.get("tie_word_embeddings", False),
    )


def args_from_hf_config(config: dict) -> ModelArgs:
    """The ModelArgs of a transformers config.json (the inverse of hf_config), for a folder with no run config."""
    if config.get("model_type") in ("deepseek_v3", "deepseek_v2", "kimi_k2"):  # Kimi K2: DeepSeek-V3's layout
        from trillion.models.hf_deepseek import args_from_deepseek_config

        return args_from_deepseek_config(config)
    if config.get("model_type") in ("mixtral", "qwen3_moe"):
        from trillion.models.hf_moe import args_from_moe_config

        return args_from_moe_config(config)
    if config.get("model_type") == "llama":
        return llama_args_from_config(config)
    if config.get("model_type") == "gpt2":
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
    raise ValueError(
        f"model_type {config.get('model_type')!r}: only llama, gpt2, mixtral, qwen3_moe, deepseek_v2, deepseek_v3 "
        "and kimi_k2 map onto this transformer"
    )
