"""Float8 training with torchao's `convert_to_float8_training`, applied from outside the model like the
parallelisms: parallelize.py swaps the linears first, then the TP plan (float8-aware styles), activation
checkpointing, compile and FSDP2 wrap the swapped modules (the order torchtitan found to work).

Recipes (torchao's Float8LinearRecipeName; torchao >= 0.18):
- tensorwise: one dynamic scale per tensor (inputs, weights e4m3; gradients e5m2). The fastest: cuBLAS's
  tensorwise float8 GEMM; the one recipe torchao can FSDP-all-gather in float8 and tensor-parallelize
  with float8 all-gathers (Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput).
- rowwise: one scale per row, rounded down to a power of two, e4m3 everywhere; more accurate, slower.
  Weights are gathered in high precision and cast after; TP uses the plain styles (torchao's float8
  styles assume tensorwise scaling), as torchtitan does.
- rowwise_with_gw_hp: rowwise, but the weight gradient's GEMM stays in high precision.
- mxfp8: the OCP MX format, a scale per 32 elements, through torchao's MX training (parallel/float8_mx.py), on
  Blackwell (sm100) or emulated; the routed experts in MXFP8 too (float8.experts=auto).
The 4-bit recipes (nvfp4, mxfp4) are priced by the planner and refused here: parallel/float8_recipes.py says why.
`float8.linears=false` keeps the linears in high precision and converts only the routed experts (torchtitan's
MXFP8 DeepSeek-V3 runs).

What is converted: the routed experts' grouped GEMMs (float8.experts, parallel/float8_experts.py) and every
nn.Linear except the output projection (`output`: the logits are the most sensitive GEMM and torchtitan keeps
it too), any MoE router or gate, and any linear whose dimensions, as each tensor-parallel rank holds them, are
not multiples of 16 (the float8 GEMM's constraint). The log names what was converted and why the rest was
kept.

FSDP2 float8 all-gather (float8.fsdp_all_gather): the weight is a torchao tensor subclass that casts its
shard to float8 before the all-gather (half bf16's bytes); its scale is precomputed once per step for all
weights after the optimizer step (`register_scale_precompute`: one all-reduce of the amaxes, instead of one
per weight). torchao 0.18 supports it for tensorwise only (`Float8LinearConfig` asserts it); float8_recipes.py's
FLOAT8_RECIPES tables what each recipe composes with, `float8_recipe` refuses `on` with a rowwise recipe,
and `auto` turns it on for tensorwise under FSDP. A state-dict hook saves the subclass's high-precision
tensor, so checkpoints hold ordinary tensors.

Layouts give one process's numbers: data-parallel ranks quantise the same micro-batches, the float8 TP
styles reduce their amaxes over the tp group, and the weight scales are global amaxes (tests/float8).

Hardware: float8 GEMMs need e4m3/e5m2 matrix units: NVIDIA sm89 and later (L40S, H100, H200, B200),
AMD gfx942 (MI300X, MI325X: the fnuz variants e4m3fnuz/e5m2fnuz) and gfx950. Elsewhere (A100, MI250X,
a CPU) only emulation runs: the same quantisation, high-precision matmuls, not faster; for tests and
debugging. `check_device` refuses the rest before any work.

The master weights stay in high precision: Float8Linear keeps nn.Linear's parameter names, shapes and
dtype and casts on the fly, so a checkpoint written with float8 on loads into a run without it and back,
and `trillion export` writes ordinary weights.
"""

import contextlib
import dataclasses
import importlib
import logging
import re
import sys
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from trillion.errors import ConfigError
from trillion.parallel import float8_mx
from trillion.parallel.float8_experts import convert_experts
from trillion.parallel.float8_recipes import float8_recipe
from trillion.parallel.layout import Float8Training

log = logging.getLogger("trillion")

ROUTER_NAMES = ("router", "gate")  # module names (last part) of MoE routers: they stay in high precision
NVIDIA_MIN_CAPABILITY = (8, 9)  # sm89 (Ada), sm90 (Hopper), sm100 (Blackwell)...
AMD_FLOAT8_ARCHS = ("gfx942", "gfx950")  # MI300X/MI325X (e4m3fnuz), MI350/MI355X (e4m3fn)
GEMM_MULTIPLE = 16
TORCHAO_MIN = (0, 18)


# --- torchao, imported only when float8 is on ------------------------------------------------------------
@contextlib.contextmanager
def _quiet_import():
    """torchao's import warns on stderr about its CUDA extensions (absent on a CPU build) and torch about an
    Enum it registers: nothing a user can act on, so the import runs with those loggers at ERROR."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def torchao_float8():
    """torchao.float8, or a ConfigError saying how to install it."""
    if sys.modules.get("torchao.float8") is not None:
        return sys.modules["torchao.float8"]
    try:
        with _quiet_import():
            module = importlib.import_module("torchao.float8")
    except ImportError as error:
        raise ConfigError(
            f"float8.enabled=true needs torchao's float8 training, which is not importable here ({error}). "
            "Install it with `pip install torchao` (or `pip install 'trillion[float8]'`; 0.18 or later, built for "
            "this torch), or run without --float8.enabled."
        ) from None
    version = getattr(sys.modules.get("torchao"), "__version__", "unknown")
    numbers = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if numbers and numbers < TORCHAO_MIN:  # a build without a version ("unknown") is given the benefit
        raise ConfigError(
            f"float8.enabled=true needs torchao {'.'.join(map(str, TORCHAO_MIN))} or later (its float8 recipes and "
            f"FSDP2 all-gather); this is torchao {version}. Upgrade with `pip install -U torchao`."
        )
    return module


def require_torchao() -> None:
    torchao_float8()


# --- the hardware gate --------------------------------------------------------------------------------------
def _accelerator(device: torch.device) -> tuple[str, str, bool]:
    """(the device's name, its architecture, whether it has float8 matrix units) from the driver."""
    name = torch.cuda.get_device_name(device)
    if torch.version.hip:
        arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
        return name, arch, arch in AMD_FLOAT8_ARCHS
    major, minor = torch.cuda.get_device_capability(device)
    return name, f"sm{major}{minor}", (major, minor) >= NVIDIA_MIN_CAPABILITY


def _table_name(name: str) -> str:
    from trillion.devices import lookup_device

    spec = lookup_device(name)
    return f" ({spec.name} in trillion/devices.toml)" if spec is not None else ""


def check_device(device: torch.device, emulate: bool) -> None:
    """Refuse float8 where it cannot run, before any work: a CPU without emulation, a GPU without float8
    matrix units (A100, MI250X) unless emulated."""
    if emulate:
        return
    if device.type != "cuda":
        raise ConfigError(
            f"float8.enabled=true on {device.type}: float8 GEMMs need e4m3/e5m2 matrix units (NVIDIA sm89 and later, "
            "AMD gfx942 and later), the routed experts' float8 grouped GEMMs too, and a CPU has none. Add "
            "--float8.emulate=true to run torchao's float8 "
            "quantisation with high-precision matmuls (for tests and debugging: the same numerics, not faster), "
            "or run on such a GPU."
        )
    name, arch, supported = _accelerator(device)
    if not supported:
        raise ConfigError(
            f"float8.enabled=true on {name!r}{_table_name(name)}, architecture {arch}: it has no float8 "
            "(e4m3/e5m2) matrix units, so torch's float8 GEMM (_scaled_mm) does not run on it, nor the routed experts' "
            "float8 grouped GEMMs (float8.experts: torchao's or the Triton one). Float8 needs NVIDIA "
            f"sm89 or later (L40S, H100, H200, B200) or AMD {' / '.join(AMD_FLOAT8_ARCHS)} (MI300X and later); "
            "the A100 (sm80) and the MI250X (gfx90a) train in bf16. Drop --float8.enabled, or add "
            "--float8.emulate=true to check float8's numerics on this device (not faster)."
        )


# --- the swap -----------------------------------------------------------------------------------------------
COLUMN_PARALLEL = ("wq", "wk", "wv", "w1", "w3")  # tensor_parallel.py's plan: each rank holds out_features / tp
ROW_PARALLEL = ("wo", "w2")  # each rank holds in_features / tp


def kept_reason(fqn: str, module: nn.Linear, tp: int = 1) -> str | None:
    """Why the linear `fqn` stays in high precision, or None to convert it."""
    leaf = fqn.rsplit(".", 1)[-1]
    if leaf == "output":
        return "the output projection"
    if leaf in ROUTER_NAMES:
        return "a router"
    out_features, in_features = module.weight.shape
    if leaf in COLUMN_PARALLEL:
        out_features //= tp
    elif leaf in ROW_PARALLEL:
        in_features //= tp
    if out_features % GEMM_MULTIPLE or in_features % GEMM_MULTIPLE:
        per_rank = f" per tensor-parallel rank (tp={tp})" if tp > 1 else ""
        return f"{out_features} x {in_features}{per_rank}: not multiples of {GEMM_MULTIPLE}"
    return None


def _summary(names: list[str]) -> str:
    """Linear names with the layer index folded: layers.*.attention.wq (4), ..."""
    groups: dict[str, int] = defaultdict(int)
    for name in names:
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "layers":
            parts[1] = "*"
        groups[".".join(parts)] += 1
    return ", ".join(f"{name} ({count})" if count > 1 else name for name, count in groups.items()) or "none"


def convert(model: nn.Module, settings: Float8Training, tp: int = 1) -> dict[str, str | None]:
    """Swap the model's linears for torchao's Float8Linear (or, under mxfp8, float8_mx's MXFP8Linear), in place
    (on the meta device, before TP and FSDP). Returns {linear name: None if converted, else why it was kept}; the
    log says the same."""
    float8 = torchao_float8()
    if float8_recipe(settings.recipe).block or not settings.linears:
        return _convert_other(model, settings)
    decisions = {
        name: kept_reason(name, module, tp) for name, module in model.named_modules() if isinstance(module, nn.Linear)
    }
    config = dataclasses.replace(
        float8.Float8LinearConfig.from_recipe_name(settings.recipe),
        emulate=settings.emulate,
        enable_fsdp_float8_all_gather=settings.fsdp_all_gather,
    )
    float8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda module, fqn: decisions.get(fqn, "") is None
    )
    convert_experts(model, settings.experts, settings.emulate, settings.cache_activations)
    if dist.is_initialized() and dist.get_backend() == "gloo":
        _float8_all_gather_as_bytes()
    if settings.fsdp_all_gather:
        model._register_state_dict_hook(_plain_weights)
    converted = [name for name, reason in decisions.items() if reason is None]
    kept = [f"{name} ({reason})" for name, reason in decisions.items() if reason is not None]
    log.info(
        "float8 (%s recipe%s%s): %d linears converted: %s; kept in high precision: %s",
        settings.recipe,
        ", FSDP float8 all-gather" if settings.fsdp_all_gather else "",
        ", emulated: the same quantisation with high-precision matmuls, not faster; for tests and debugging"
        if settings.emulate
        else "",
        len(converted),
        _summary(converted),
        ", ".join(kept) or "none",
    )
    return decisions


def _convert_other(model: nn.Module, settings: Float8Training) -> dict[str, str | None]:
    """MXFP8's linears (parallel/float8_mx.py), or none of them (float8.linears=false), and the routed experts."""
    if settings.linears:
        decisions = float8_mx.convert_linears(model, settings.emulate, ROUTER_NAMES)
    else:
        decisions = {n: "float8.linears=false" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    convert_experts(model, settings.experts, settings.emulate, settings.cache_activations)
    converted = [name for name, reason in decisions.items() if reason is None]
    kept = [f"{name} ({reason})" for name, reason in decisions.items() if reason is not None]
    log.info(
        "%s (%s recipe%s): %d linears converted: %s; kept in high precision: %s",
        "MXFP8" if settings.recipe == "mxfp8" else "float8",
        settings.recipe,
        ", emulated: the same quantisation with high-precision matmuls, not faster" if settings.emulate else "",
        len(converted),
        _summary(converted),
        ", ".join(kept) or "none",
    )
    return decisions


def _float8_all_gather_as_bytes() -> None:
    """gloo has no float8 dtypes: it fails a float8 all-gather ('Invalid scalar type') that NCCL and RCCL run.
    Under gloo (CPU emulation) torchao's float8 all-gather of the TP styles then moves the float8 payload as
    bytes (a uint8 view: the same bits), waited on at once; nothing changes on GPUs. FSDP2 needs no help: it
    gathers a block's mixed float8 and fp32 parameters as bytes already."""
    from torchao.float8 import float8_ops
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    def all_gather(op, args, kwargs=None):
        fp8 = args[0]
        data = fp8._data.contiguous()
        gathered = torch.ops._c10d_functional.wait_tensor(op(data.view(torch.uint8), *args[1:], **(kwargs or {})))
        return Float8TrainingTensor(
            gathered.view(data.dtype), fp8._scale, fp8._orig_dtype, fp8._linear_mm_config, fp8._gemm_input_role
        )

    for op in (
        torch.ops._c10d_functional.all_gather_into_tensor.default,
        torch.ops.c10d_functional.all_gather_into_tensor.default,
    ):
        float8_ops.FLOAT8_OPS_TABLE[op] = all_gather


def _plain_weights(module: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    """State-dict hook: the high-precision tensor inside each float8-gathered weight (torchao's subclass, which
    a checkpoint would otherwise pickle and only torchao could load) under the same name, sharing its storage,
    so a checkpoint holds ordinary tensors (any run loads it, float8 or not) and loading writes the weights."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Cast

    for name, value in state.items():
        if isinstance(value, DTensor) and isinstance(value._local_tensor, Cast):
            state[name] = DTensor.from_local(
                value._local_tensor._tensor,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        elif isinstance(value, Cast):
            state[name] = value._tensor


def is_float8_linear(module: nn.Module) -> bool:
    linear = sys.modules.get("torchao.float8.float8_linear")
    return linear is not None and isinstance(module, linear.Float8Linear)


def tp_styles():
    """torchao's float8 tensor-parallel styles: (colwise, rowwise, prepare-module-input) classes."""
    torchao_float8()
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


# --- the per-step scale precompute ------------------------------------------------------------------------
def _float8_gathered(model: nn.Module) -> bool:
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")
    if fsdp_utils is None:
        return False
    cast = fsdp_utils.WeightWithDynamicFloat8CastTensor
    return any(isinstance(getattr(p, "_local_tensor", p), cast) for p in model.parameters())


def register_scale_precompute(optimizer: torch.optim.Optimizer, model: nn.Module) -> bool:
    """With FSDP float8 all-gather: the float8 scales of all gathered weights at once (one all-reduce of their
    amaxes over the whole mesh), which the all-gathers then use, after every optimizer step and before the
    first forward (after the weights are initialized or loaded from a checkpoint: a block's first forward
    computes them, then the hook removes itself). Without the first, torchao's first all-gathers would reduce
    each amax over the FSDP axis only, so under FSDP x TP the first step's weight scales would be per TP shard:
    not wrong, but not the quantisation of one process. Returns whether anything was registered; a model
    without float8-gathered weights needs nothing (and imports no torchao)."""
    if not _float8_gathered(model):
        return False
    precompute = torchao_float8().precompute_float8_dynamic_scale_for_fsdp
    optimizer.register_step_post_hook(lambda *_: precompute(model))
    first: list = []

    def before_first_forward(*_):
        for handle in first:
            handle.remove()
        precompute(model)

    # prepended: before FSDP's own pre-forward hook, which all-gathers the block's weights with these scales
    blocks = getattr(model, "layers", {}).values()
    first += [block.register_forward_pre_hook(before_first_forward, prepend=True) for block in blocks]
    return True
