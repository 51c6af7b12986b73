"""`trillion plan`'s argument groups beyond the layout's degrees (plan_cli.py builds the parser): float8, the expert
dispatch, the model's parts and document masking."""

import argparse

from trillion.parallel.float8_recipes import FLOAT8_EXPERTS, FLOAT8_RECIPES
from trillion.parallel.layout import EP_DISPATCH


def add_dispatch_arguments(fixed) -> None:
    """The expert dispatch's settings (MoE models), each fixed when given."""
    fixed.add_argument(
        "--ep-dispatch",
        choices=EP_DISPATCH,
        default=None,
        help="MoE models: how tokens reach the experts (default: per node where the ep group spans nodes, else per "
        "rank; parallel.ep_dispatch)",
    )
    fixed.add_argument(
        "--ep-overlap",
        choices=("on", "off"),
        default=None,
        help="MoE models: overlap the expert all-to-alls with compute (default on with ep > 1; parallel.ep_overlap)",
    )
    fixed.add_argument(
        "--defer-weight-grads",
        choices=("on", "off"),
        default=None,
        help="Split-backward schedules: queue the weight gradients for the schedule's weight passes (default on where "
        "checkpointing would otherwise run them with the input passes, tp 1; parallel.defer_weight_grads)",
    )
    fixed.add_argument(
        "--ep-pairing-phase",
        type=int,
        default=None,
        help="MoE models paired across stages (DualPipeV, Interleaved1F1B): turns each paired backward hands straight "
        "back before it starts (default: the one leaving the fewest all-to-alls exposed; parallel.ep_pairing_phase)",
    )
    fixed.add_argument(
        "--ep-capacity",
        type=float,
        default=None,
        help="MoE models: a per-rank capacity, as a multiple of an even share (no host read; moe.rank_capacity_factor, "
        "at least 1); default dropless",
    )


def add_pipeline_arguments(fixed) -> None:
    """--pp-layout: the stages the search balances, or the ones given."""
    fixed.add_argument(
        "--pp-layout",
        dest="pp_layout",
        default=None,
        help="the pipeline's stages: auto (balanced by the planner's cost of each layer, the head and the MTP modules, "
        "for the fastest layouts, written out; the default), even (the layers split evenly) or a layout written out, "
        "e.g. 'E+3 | 2*29 | M+O' (with --pp and --pp-schedule; parallel.pp_layout)",
    )


def add_tp_hiding_arguments(fixed) -> None:
    """How TP's collectives run beside the GEMMs (parallel.tp_overlap, parallel.async_tp), each fixed when given."""
    fixed.add_argument(
        "--tp-overlap",
        dest="tp_overlap",
        type=int,
        default=None,
        help="tp > 1: chunks of the chunked TP overlap, any backend (0 = off; default: searched over 0, 1, 2, 4, 8 "
        "where they divide the local sequence; parallel.tp_overlap)",
    )
    fixed.add_argument(
        "--async-tp",
        dest="async_tp",
        choices=("on", "off"),
        default=None,
        help="tp > 1 with --compile: torch's async TP (CUDA with symmetric memory; parallel.async_tp); default off",
    )


def add_float8_arguments(fixed) -> None:
    """--float8 and what it covers of the routed experts (the trainer's float8.experts and float8.dispatch)."""
    fixed.add_argument(
        "--float8",
        action="store_const",
        const=True,
        default=None,
        help="plan the blocks' linears and the routed experts in float8 (fp8 GEMMs and their casts; FSDP all-gathers "
        "the linears' weights in float8); refused on hardware without float8 tensor cores",
    )
    fixed.add_argument(
        "--float8-recipe",
        dest="float8_recipe",
        choices=tuple(FLOAT8_RECIPES),
        default=None,
        help="with --float8: the recipe and its number format (default tensorwise fp8; mxfp8, and the 4-bit nvfp4 and "
        "mxfp4 with a bf16 tail of the last 15%% of blocks, at their own peaks, with a scale per 32 or 16 elements); "
        "refused on hardware without the format; the trainer's float8.recipe",
    )
    fixed.add_argument(
        "--float8-linears",
        dest="float8_linears",
        choices=("on", "off"),
        default=None,
        help="with --float8: off keeps the blocks' linears in bf16, only the routed experts in low precision (as "
        "torchtitan's MXFP8 DeepSeek-V3 runs); default on",
    )
    fixed.add_argument(
        "--float8-experts",
        dest="float8_experts",
        choices=FLOAT8_EXPERTS,
        default=None,
        help="with --float8: the routed experts' grouped GEMMs by recipe (default auto: torchao's rowwise, as the "
        "trainer's float8.experts=auto on these GPUs; off keeps them bf16)",
    )
    fixed.add_argument(
        "--float8-dispatch",
        dest="float8_dispatch",
        action="store_const",
        const=True,
        default=None,
        help="with --float8 and float8 experts: the expert dispatch all-to-all carries float8 rows and their "
        "scales (the trainer's float8.dispatch, under ep > 1)",
    )
    fixed.add_argument(
        "--float8-combine-gradient",
        dest="float8_combine_gradient",
        action="store_const",
        const=True,
        default=None,
        help="with --float8-dispatch: the combine's gradient travels back to the experts in float8 too (DeepSeek-V3's "
        "recipe; the trainer's float8.combine_gradient)",
    )
    fixed.add_argument(
        "--float8-cache-activations",
        dest="float8_cache_activations",
        action="store_const",
        const=True,
        default=None,
        help="with --float8 and float8 experts: the routed experts keep their activations for backward in float8 "
        "(DeepSeek-V3's cache; with --activation-checkpoint deepseek, w2's input rebuilt from SwiGLU's cached "
        "inputs; the trainer's float8.cache_activations)",
    )


# plan flag -> the model setting it gives the parts (models/parts apply_settings), each a count, 0 or more
PART_FLAGS = {"mtp_modules": "model.mtp_modules"}


def add_documents_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--documents",
        metavar="DIR",
        default=None,
        help="plan training with documents masked (data.document_mask) on the token store DIR (`trillion prepare-data "
        "--out DIR`): attention priced, and counted in the MFU, at the share its document lengths leave",
    )


def add_part_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mtp-modules",
        type=int,
        default=None,
        help="multi-token prediction modules to plan (default: the preset's; 0 plans without them)",
    )
