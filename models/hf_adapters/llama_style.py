"""The Llama-style names and config.json fields that Llama, Mixtral, Qwen3-MoE and the DeepSeek families
share: model.embed_tokens, model.layers.{i}.<module>, model.norm, lm_head, and the attention's sizes."""

from trillion.models.args import ModelArgs
from trillion.models.hf_adapters.base import StateDict

TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Our per-block modules and theirs, as Llama names them; each family extends the map with its own parts.
LAYER_NAMES = {
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


def names_to_hf(state: StateDict, layer_names: dict[str, str]) -> StateDict:
    """Ours -> Llama-style names, `layer_names` mapping our per-block modules to the family's."""
    out = {}
    for name, tensor in state.items():
        if name in TOP_NAMES:
            out[TOP_NAMES[name]] = tensor
            continue
        _, index, rest = name.split(".", 2)
        module, _, leaf = rest.rpartition(".")
        out[f"model.layers.{index}.{layer_names[module]}.{leaf}"] = tensor
    return out


def names_to_ours(state: StateDict, layer_names: dict[str, str]) -> StateDict:
    """Llama-style names -> ours, `layer_names` mapping our per-block modules to the family's; names it does
    not know are returned unchanged."""
    names = {theirs: ours for ours, theirs in TOP_NAMES.items()}
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


def cannot_express(args: ModelArgs) -> list[str]:
    """What every Llama-style family computes otherwise: a feed-forward other than SwiGLU, norms other than
    RMSNorm, positions other than rotary."""
    return [
        *(["model.mlp must be swiglu"] if args.mlp != "swiglu" else []),
        *(["model.norm must be rmsnorm"] if args.norm != "rmsnorm" else []),
        *(["model.positions must be rope"] if args.positions != "rope" else []),
    ]


def args_from_config(config: dict) -> ModelArgs:
    """The Llama-style part of a config.json (the families with experts or latent attention add theirs)."""
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
