"""The low-precision training recipes (`float8.recipe`, `trillion plan --float8-recipe`) and their rules: what
torchao composes each with, the number format and block scales the matrix units multiply it in, and what it costs
beside the GEMMs. The trainer (float8.py, float8_mx.py, the config docs) and the planner read this table, and
`float8_recipe`, `check_block_scaled_layout` and `float8_dispatch` refuse for both, so the planner never proposes
float8 the trainer would refuse. No torch here: the planner imports it and starts fast.
"""

from dataclasses import dataclass

from trillion.errors import ConfigError


@dataclass(frozen=True)
class Float8Recipe:
    """A low-precision training recipe (`float8.recipe`, `trillion plan --float8-recipe`): what torchao 0.18 composes
    it with, the number format the matrix units multiply it in, and what it costs beside the GEMMs (the planner)."""

    name: str
    fsdp_float8_all_gather: bool  # FSDP2 can gather the weights in float8 (a scale computable before the gather)
    float8_tp: bool  # torchao's float8 TP styles (they cast activations tensorwise) apply
    # the matrix units' format (trillion/devices.py LOW_PRECISION_FORMATS), whose peak and plateau price the GEMMs
    format: str = "fp8"
    element_bytes: float = 1.0  # of one quantised element
    block: int = 0  # elements sharing one scale along the reduction (0: one per tensor or per row)
    scale_bytes: int = 0  # of one block's scale (e8m0 for MX, e4m3 for NVFP4)
    dim_multiple: int = 16  # a converted linear's in and out features, as each TP rank holds them, are multiples
    requantizes: bool = False  # the weight gradient quantises its operands again, along the tokens (rowwise, MX)
    high_precision_tail: float = 0.0  # share of the last blocks kept in bf16 (4-bit: torchtitan's nvfp4.md)
    untrainable: str = ""  # why the trainer cannot train it (the planner still prices it); "" where it trains

    def quantised_bytes(self, elements: float) -> float:
        """Bytes of `elements` in this format with their scales (on the wire, or as a GEMM reads them)."""
        return elements * self.element_bytes + (elements / self.block * self.scale_bytes if self.block else 0.0)


_MX = dict(fsdp_float8_all_gather=False, float8_tp=False, scale_bytes=1, requantizes=True)
# 4-bit recipes keep the last 15% of blocks in bf16: torchtitan components/quantization/nvfp4.md ("leave approximately
# the final 15% of decoder blocks in BF16"), after NVIDIA's "Pretraining Large Language Models with NVFP4" (arXiv
# 2509.25149). NVFP4's kernels need local GEMM dims divisible by 128 (the same page; torchao's nvfp4_mm_triton).
_FOUR_BIT = dict(_MX, element_bytes=0.5, high_precision_tail=0.15)
FLOAT8_RECIPES: dict[str, Float8Recipe] = {
    r.name: r
    for r in (
        Float8Recipe("tensorwise", fsdp_float8_all_gather=True, float8_tp=True),
        Float8Recipe("rowwise", fsdp_float8_all_gather=False, float8_tp=False, requantizes=True),
        Float8Recipe("rowwise_with_gw_hp", fsdp_float8_all_gather=False, float8_tp=False, requantizes=True),
        Float8Recipe("mxfp8", format="mxfp8", block=32, dim_multiple=32, **_MX),
        Float8Recipe(
            "nvfp4",
            format="nvfp4",
            block=16,
            dim_multiple=128,
            untrainable="torchao 0.18's NVFP4 training runs Triton kernels on sm100 only, with no emulation, so no "
            "machine this project tests on can check it; its NVFP4Linear also adds buffers to the checkpoint",
            **_FOUR_BIT,
        ),
        Float8Recipe(
            "mxfp4",
            format="mxfp4",
            block=32,
            dim_multiple=32,
            untrainable="torchao 0.18 has no MXFP4 training path (its MX linear trains MXFP8 only)",
            **_FOUR_BIT,
        ),
    )
}
FLOAT8_ALL_GATHER = ("auto", "on", "off")  # float8.fsdp_all_gather
FLOAT8_EXPERTS = ("auto", "blockwise", "rowwise", "mxfp8", "off")  # float8.experts (kernels/float8_grouped_gemm.py)


def trainable_recipe(name: str, fsdp_all_gather: str = "auto") -> Float8Recipe:
    """The recipe `float8.recipe` names, refused where the trainer cannot train it (the planner prices it still)
    or combined with a `float8.fsdp_all_gather` torchao lacks."""
    recipe = float8_recipe(name, fsdp_all_gather)
    if recipe.untrainable:
        trainable = " | ".join(r.name for r in FLOAT8_RECIPES.values() if not r.untrainable)
        raise ConfigError(
            f"float8.recipe={name}: the trainer cannot train in {recipe.format} ({recipe.untrainable}); "
            f"`trillion plan --float8 --float8-recipe {name}` still prices it. Train with one of {trainable}."
        )
    return recipe


def float8_recipe(name: str, fsdp_all_gather: str = "auto") -> Float8Recipe:
    """The recipe `float8.recipe` names (trainable or not: the planner prices them all); refuses a combination with
    `float8.fsdp_all_gather` torchao lacks."""
    recipe = low_precision_recipe(name, "float8.recipe")
    if fsdp_all_gather == "on" and not recipe.fsdp_float8_all_gather:
        supported = ", ".join(r.name for r in FLOAT8_RECIPES.values() if r.fsdp_float8_all_gather)
        raise ConfigError(
            f"float8.fsdp_all_gather=on with float8.recipe={name}: torchao (0.18) gathers weights in float8 under "
            f"FSDP2 with {supported} scaling only (its Float8LinearConfig refuses the rest): {name} casts each weight "
            "twice, per row for the forward and per column for the input gradient, and a column's scale spans every "
            "rank's shard, so there is no one float8 copy to gather. "
            "Use --float8.fsdp_all_gather=auto (or off) to gather the high-precision weights and cast after the "
            "all-gather, or --float8.recipe=tensorwise."
        )
    return recipe


def check_block_scaled_layout(tp: int, tokens_per_microbatch: int = 0) -> None:
    """Refuse, before any work, what torchao's MXFP8 linear cannot take: DTensor operands (tensor parallelism), and a
    micro-batch whose tokens do not fill whole 32-token blocks (the weight gradient quantises along the tokens; 0: the
    tokens not known, as the planner's layouts)."""
    if tp > 1:
        raise ConfigError(
            f"float8.recipe=mxfp8 with parallel.tp={tp}: torchao's MXFP8 linear takes no DTensor operands (its casts "
            "and scaled GEMMs are per tensor), so tensor parallelism cannot run through it; torchtitan likewise leaves "
            "MXFP8 with TP for later. Use --parallel.tp=1 (FSDP, pipeline and expert parallelism compose), or "
            "--float8.recipe=tensorwise for float8 under TP."
        )
    if tokens_per_microbatch % 32:  # 0 passes
        raise ConfigError(
            f"float8.recipe=mxfp8: a micro-batch holds {tokens_per_microbatch} tokens per rank "
            "(training.micro_batch_size x training.seq_len / parallel.cp), not a multiple of the 32-token MX block "
            "that the weight gradient quantises along. Use a training.seq_len that is a multiple of "
            "32 (times parallel.cp)."
        )


def low_precision_recipe(name: str, setting: str = "--float8-recipe") -> Float8Recipe:
    """The recipe `name` (trainable or not: the planner prices them all), or a ConfigError naming `setting`."""
    if name not in FLOAT8_RECIPES:
        raise ConfigError(f"{setting}={name!r} is not a low-precision recipe. Use {' | '.join(FLOAT8_RECIPES)}.")
    return FLOAT8_RECIPES[name]


def float8_cache(cache: bool, experts: str) -> None:
    """Refuse float8.cache_activations where no float8 product of this project's quantises the experts' inputs: it
    keeps that float8 for backward (parallel/float8_experts.py), which high-precision experts do not make and
    torchao's MXFP8 grouped GEMM keeps itself."""
    if cache and experts in ("off", "mxfp8"):
        why = (
            "keep them in high precision"
            if experts == "off"
            else "run torchao's MXFP8 grouped GEMM, which keeps its own"
        )
        raise ConfigError(
            f"float8.cache_activations=true with float8.experts={experts}: it keeps for backward the float8 the "
            f"routed experts' products quantise their inputs to, and these {why}. Use --float8.experts=auto "
            "(or blockwise, rowwise: the Triton product, emulated on a CPU), or drop --float8.cache_activations."
        )


def float8_combine_gradient(combine_gradient: bool, dispatch: bool) -> None:
    """Refuse float8.combine_gradient without the float8 dispatch whose wire form it uses."""
    if combine_gradient and not dispatch:
        raise ConfigError(
            "float8.combine_gradient=true (plan: --float8-combine-gradient) sends the combine's gradient back in the "
            "float8 wire form of float8.dispatch (DeepSeek-V3 quantises both), which is off here. Add "
            "--float8.dispatch=true (plan: --float8-dispatch), or drop it."
        )


def float8_dispatch(dispatch: bool, enabled: bool, experts: str, ep: int | None = None) -> None:
    """Refuse float8.dispatch where it cannot work: the tokens go out in the float8 the experts' GEMMs would
    quantise them to anyway, so it needs float8 experts, and an expert all-to-all (parallel.ep > 1) to carry them.
    `ep` None: not known yet (the config alone)."""
    if not dispatch:
        return
    if not enabled or experts == "off":
        why = "float8.enabled=false" if not enabled else "float8.experts=off"
        raise ConfigError(
            f"float8.dispatch=true with {why}: the dispatch sends the tokens in the float8 (and the scales) the "
            "experts' float8 GEMMs quantise them to, so the experts' first GEMMs see what they would have computed "
            "anyway; with high-precision experts it would only lose precision. Add --float8.enabled=true with "
            "--float8.experts=auto (or blockwise, rowwise), or drop --float8.dispatch."
        )
    if ep is not None and ep < 2:
        raise ConfigError(
            f"float8.dispatch=true with parallel.ep={ep}: without expert parallelism there is no dispatch "
            "all-to-all to carry the tokens in float8. Use --parallel.ep=2 or more, or drop --float8.dispatch."
        )
