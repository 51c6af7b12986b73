"""MXFP8 training (float8.recipe=mxfp8) through torchao's MX formats, applied from outside the model as float8.py
applies its recipes: every nn.Linear of the blocks whose dims are multiples of 32 computes its three GEMMs (output,
input gradient, weight gradient) with torchao's `mx_mm` (torchao.prototype.moe_training.mxfp8_linear): each operand
dynamically quantised to e4m3 in blocks of 32 along its reduction dim, one e8m0 power-of-two scale per block (RCEIL
rounding, as torchao's MXFP8 training recipes), the product accumulated in fp32. The routed experts' grouped GEMMs run
the same format (float8.experts=auto resolves to mxfp8: kernels/float8_scaling.py's mxfp8 recipe, torchao's MXFP8
grouped GEMM on sm100).

Kernels: on NVIDIA sm100 (Blackwell) torchao's (cuBLAS / CUTLASS MXFP8 GEMMs, Triton and CUDA casts); with
float8.emulate, torchao's emulation (the same quantisation, high-precision matmuls, on any device, a CPU included).
AMD's CDNA4 (MI355X) has MX matrix units, but torchao's MX training kernels are CUDA's: refused there, with the
reason (float8.py check_device).

What stays in high precision, named in the log: the output projection, any router, and any linear whose in or out
features are not multiples of the 32-element block (torchao's casts need whole blocks; kept, not padded). The master
weights, FSDP's all-gathers and TP's collectives stay in high precision (torchao gathers no MX weights: "all
distributed communication for MXFP8 training is currently done in high precision", torchtitan's mxfp8.md); torchao's
MXFP8 linear takes no DTensor operands, so tensor parallelism is refused with it (the planner prices neither).

The swap changes each module's class only: parameters, names and the state dict are nn.Linear's, so checkpoints
load with or without MXFP8.
"""

import logging

import torch
from torch import nn

from trillion.errors import ConfigError
from trillion.kernels.float8_scaling import MX_BLOCK

log = logging.getLogger("trillion")
MX_CAPABILITY = (10, 0)  # Blackwell: block-scaled (MX) tensor-core instructions


class MXFP8Linear(nn.Linear):
    """An nn.Linear whose GEMMs run in MXFP8 through torchao's mx_mm; `mx_emulated` picks torchao's emulation."""

    mx_emulated: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        preference = KernelPreference.EMULATED if self.mx_emulated else KernelPreference.AUTO
        out = _to_mxfp8_then_scaled_mm(x, self.weight, preference, ScaleCalculationMode.RCEIL)
        return out if self.bias is None else out + self.bias


def check_device(device: torch.device, emulate: bool) -> None:
    """Refuse MXFP8 where torchao's MX kernels do not run, before any work: a CPU or a GPU before NVIDIA's Blackwell
    (sm100), and AMD's, whose MX units torchao's CUDA kernels do not reach; float8.emulate runs anywhere."""
    if emulate:
        return
    if device.type == "cuda" and not torch.version.hip and torch.cuda.get_device_capability(device) >= MX_CAPABILITY:
        return
    if device.type != "cuda":
        what = f"a {device.type}"
    else:
        major, minor = torch.cuda.get_device_capability(device)
        arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0] if torch.version.hip else ""
        what = f"{torch.cuda.get_device_name(device)!r} ({arch or f'sm{major}{minor}'})"
    raise ConfigError(
        f"float8.recipe=mxfp8 on {what}: MXFP8's block-scaled GEMMs need MX matrix units and torchao's MX training "
        "kernels, which run on NVIDIA Blackwell (sm100: B200, GB200, B300) only; Hopper and CDNA3 have no MX units, "
        "and AMD's CDNA4 (MI355X) has them but torchao's MX kernels are CUDA's. Use --float8.recipe=tensorwise (float8 "
        "on sm89+ and gfx942+), or add --float8.emulate=true to check MXFP8's numerics here (not faster)."
    )


def kept_reason(leaf: str, module: nn.Linear, routers: tuple[str, ...]) -> str | None:
    """Why the linear `leaf` stays in high precision under MXFP8, or None to convert it."""
    if leaf == "output":
        return "the output projection"
    if leaf in routers:
        return "a router"
    out_features, in_features = module.weight.shape
    if out_features % MX_BLOCK or in_features % MX_BLOCK:
        return f"{out_features} x {in_features}: not multiples of the {MX_BLOCK}-element MX block"
    return None


def convert_linears(model: nn.Module, emulate: bool, routers: tuple[str, ...]) -> dict[str, str | None]:
    """Swap the model's eligible linears to MXFP8Linear in place (on the meta device, before FSDP); returns
    {linear name: None if converted, else why it was kept}."""
    decisions = {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            decisions[name] = kept_reason(name.rsplit(".", 1)[-1], module, routers)
            if decisions[name] is None:
                module.__class__ = MXFP8Linear
                module.mx_emulated = emulate
    return decisions
