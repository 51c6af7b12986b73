"""The sections of the model and how it runs: [model], [moe], [kernels], [compile], [float8]."""

from dataclasses import dataclass

from trillion.parallel.float8_recipes import (
    FLOAT8_ALL_GATHER,
    FLOAT8_EXPERTS,
    FLOAT8_RECIPES,
    float8_cache,
    float8_combine_gradient,
    float8_dispatch,
    trainable_recipe,
)
from trillion.trainer.config.checks import Flag, OneOf, Range
from trillion.trainer.config.fields import (
    KEEP,
    PRESET_VALUE,
    attention_impls,
    doc,
    grouped_gemm_impls,
    norm_impls,
    permutation_impls,
    preset_names,
)


@dataclass
class Model:
    name: str = doc(
        "debug",
        "A preset of models/presets.py, by name.",
        OneOf(preset_names),
    )
    n_layers: int = doc(0, "Override the preset's layer count (0 = keep).", Range(1, also=KEEP))
    dim: int = doc(0, "Override the preset's hidden size (0 = keep).", Range(1, also=KEEP))
    n_heads: int = doc(0, "Override the preset's query heads (0 = keep).", Range(1, also=KEEP))
    n_kv_heads: int = doc(0, "Override the preset's key/value heads (0 = keep).", Range(1, also=KEEP))
    ffn_dim: int = doc(0, "Override the preset's MLP width (0 = keep).", Range(1, also=KEEP))
    vocab_size: int = doc(
        0, "Override the preset's vocabulary size (0 = keep); must hold the tokenizer's ids.", Range(1, also=KEEP)
    )
    max_seq_len: int = doc(
        0,
        "Override the preset's longest sequence (0 = keep), e.g. 131072 for Llama 3.1's long-context training; sizes "
        "the rotary cache or learned position table.",
        Range(1, also=KEEP),
    )
    n_experts: int = doc(0, "Override an MoE preset's routed experts (0 = keep).", Range(1, also=KEEP))
    top_k: int = doc(0, "Override an MoE preset's experts per token (0 = keep).", Range(1, also=KEEP))
    mtp_modules: int = doc(
        -1,
        "DeepSeek-V3's multi-token prediction: modules trained beside the model, module k predicting the token k + 1 "
        "after the next from the previous depth's hidden state and token k's embedding, sharing the embedding and "
        "output head (-1 = the preset's, 0 = off). Training only: evaluation, generation and export use the main "
        "head. Every layout but the V-shaped pipeline schedules: a pipeline runs the modules on its last stage "
        "with a copy of the embedding.",
        Range(0, also={-1: "keep the preset's"}),
    )
    mtp_loss_weight: float = doc(
        -1.0,
        "Weight of the multi-token prediction modules' mean loss in the training loss (-1 = the preset's, or "
        "DeepSeek-V3's 0.3 where the preset has no MTP).",
        Range(0, open_low=True, also={-1.0: "keep the preset's"}),
    )


@dataclass
class Moe:
    aux_loss_coef: float = doc(
        -1.0,
        "Weight of the Switch/Mixtral load-balancing loss E * sum_e f_e P_e in the training loss (0 = off, -1 = the "
        "preset's).",
        Range(0, also=PRESET_VALUE),
    )
    seq_aux_loss_coef: float = doc(
        -1.0,
        "Weight (alpha) of DeepSeek-V3's sequence-wise balance loss in the training loss: per sequence, sum_e f_e P_e "
        "with f_e = E / (top_k x seq_len) x the sequence's tokens choosing e and P_e the sequence's mean of the scores "
        "normalised to sum to one; averaged over sequences (DeepSeek-V3: 1e-4; 0 = off, -1 = the preset's).",
        Range(0, also=PRESET_VALUE),
    )
    bias_update_rate: float = doc(
        -1.0,
        "DeepSeek-V3's auxiliary-loss-free balancing: each step every expert's selection bias moves by this much "
        "toward equal load (0 = off, -1 = the preset's).",
        Range(0, also=PRESET_VALUE),
    )
    capacity_factor: float = doc(
        -1.0,
        "Tokens an expert takes per step, as a multiple of an even share (tokens x top_k / experts); the rest are "
        "dropped and counted. 0 = dropless (every token reaches its top_k), -1 = the preset's.",
        Range(1, also={0.0: "dropless", **PRESET_VALUE}),
    )
    rank_capacity_factor: float = doc(
        0.0,
        "Expert parallelism without a host read: each rank sends each ep rank at most this multiple of an even share "
        "(the tokens x the chance that top_k experts drawn evenly include one of that rank's), in buffers of that "
        "fixed size, so no split size is read on the host; the rest is dropped and counted, the same tokens in one "
        "process (at least 1; 0 = dropless, one host read per layer forward).",
        Range(1, also={0.0: "dropless"}),
    )


@dataclass
class Kernels:
    attention: str = doc(
        "auto",
        "auto (triton on GPUs, sdpa on CPU) | triton (our flash attention; falls back to sdpa, saying why, where "
        "Triton cannot run) | sdpa (PyTorch scaled_dot_product_attention) | eager (plain reference).",
        OneOf(attention_impls, extra=("auto",)),
    )
    norm: str = doc(
        "auto",
        "auto (triton on GPUs, torch on CPU) | triton (fused RMSNorm/LayerNorm kernels) | torch (PyTorch's modules).",
        OneOf(norm_impls, extra=("auto",)),
    )
    grouped_gemm: str = doc(
        "auto",
        "The routed experts' matmuls: auto (torch where it runs, else triton on a GPU, else loop) | torch "
        "(torch._grouped_mm: CUDA sm90+ in bf16, CPU with rows of 16-byte multiples) | triton (our grouped GEMM: "
        "CUDA sm80+ and ROCm) | loop (one matmul per expert).",
        OneOf(grouped_gemm_impls),
    )
    permutation: str = doc(
        "auto",
        "The tokens' permutation into expert order and the weighted sum back: auto (triton on GPUs, torch on CPU) | "
        "triton (one fused kernel each way, forward and backward) | torch (indexing and a sum: the reference).",
        OneOf(permutation_impls),
    )


@dataclass
class Compile:
    enabled: bool = doc(False, "torch.compile each transformer block.", Flag())


@dataclass
class Float8:
    enabled: bool = doc(
        False,
        "Train the blocks' linears in float8 with torchao (`pip install torchao`): GPUs with float8 matrix units "
        "(NVIDIA sm89 and later: L40S, H100, H200, B200; AMD gfx942 and later: MI300X); refused on A100 and MI250X, "
        "and on a CPU without float8.emulate. The output projection, routers and linears whose dimensions are not "
        "multiples of 16 stay in high precision, and so do the master weights and checkpoints. Pair with "
        "compile.enabled: torchao's casts are fused only under torch.compile.",
        Flag(),
    )
    recipe: str = doc(
        "tensorwise",
        "tensorwise (one scale per tensor: fastest; FSDP and TP all-gather in float8) | rowwise (one power-of-two "
        "scale per row: more accurate, slower) | rowwise_with_gw_hp (rowwise, weight gradients in high precision) | "
        "mxfp8 (OCP MXFP8, an e8m0 scale per 32 elements, through torchao's MX training: NVIDIA Blackwell sm100, or "
        "float8.emulate; linears and routed experts; dims not multiples of 32 stay high precision; no tp) | nvfp4, "
        "mxfp4 (4-bit: priced by `trillion plan`, refused here with the reason).",
        OneOf(tuple(FLOAT8_RECIPES)),
    )
    linears: bool = doc(
        True,
        "With float8.enabled: convert the blocks' linears; false keeps them in high precision and converts only the "
        "routed experts (float8.experts), as torchtitan's MXFP8 DeepSeek-V3 runs.",
        Flag(),
    )
    emulate: bool = doc(
        False,
        "Emulate float8: the same quantisation with high-precision matmuls; runs anywhere, a CPU included, but is "
        "not faster (for tests and debugging).",
        Flag(),
    )
    fsdp_all_gather: str = doc(
        "auto",
        "auto | on | off: FSDP2 all-gathers the float8 weights (half bf16's bytes), their scales precomputed once "
        "per step; torchao supports it for tensorwise only (auto: on for tensorwise under FSDP, off otherwise).",
        OneOf(FLOAT8_ALL_GATHER),
    )

    experts: str = doc(
        "auto",
        "The routed experts' grouped GEMMs (w1, w3, w2; forward and both gradients) in float8: auto (rowwise "
        "through torchao where torch._scaled_grouped_mm runs, sm90+/gfx942+, else blockwise in the Triton grouped "
        "GEMM; blockwise when emulated; mxfp8 under float8.recipe=mxfp8) | blockwise (DeepSeek-V3: 1 x 128 "
        "activation tiles, 128 x 128 weight blocks; dims not multiples of 128 end in a short block) | rowwise (one "
        "scale per row / column) | mxfp8 (blocks of 32 along every reduction, e8m0 scales: torchao's MXFP8 grouped "
        "GEMM on sm100, or emulated; dims not multiples of 32 end in a short block) | off. "
        "Routers stay high precision.",
        OneOf(FLOAT8_EXPERTS),
    )
    dispatch: bool = doc(
        False,
        "Carry the tokens of the expert all-to-all dispatch in float8 with their scales (the experts' activation "
        "quantisation, half bf16's bytes); the combine stays high precision. Needs float8 experts and "
        "parallel.ep > 1.",
        Flag(),
    )

    combine_gradient: bool = doc(
        False,
        "With float8.dispatch: the combine's gradient, on its way back to the experts' down-projections, travels in "
        "the same float8 wire form (1 x 128 tiles, power-of-two scales), as DeepSeek-V3 sends the activation "
        "gradient before its MoE down-projections; half bf16's bytes on the backward's first all-to-all. Lossy in "
        "the down-projections' weight gradient only: their input gradient quantises the same tiles again and "
        "gets what one process with float8 experts computes.",
        Flag(),
    )
    cache_activations: bool = doc(
        False,
        "The routed experts keep their activations for backward in float8, as DeepSeek-V3 cached them: the rows "
        "as w1's and w3's products quantise them, SwiGLU's inputs in 1 x 128 tiles (its output recomputed from "
        "them) and w2's input as its product quantises it, about 3 bytes an expert-width element where bf16 "
        "keeps 8; lossy (the weight gradients quantise the dequantised inputs again). Needs float8 experts of "
        "this project's product (auto, blockwise, rowwise; auto then runs blockwise in the Triton kernel, not "
        "torchao's, which keeps its own).",
        Flag(),
    )

    def check_relations(self) -> None:
        if self.enabled:  # without it, these settings do nothing and are refused as such (effects.py)
            trainable_recipe(self.recipe, self.fsdp_all_gather)
            float8_dispatch(self.dispatch, self.enabled, self.experts)
            float8_cache(self.cache_activations, self.experts)
            float8_combine_gradient(self.combine_gradient, self.dispatch)
