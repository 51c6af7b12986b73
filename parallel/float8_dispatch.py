"""Float8 dispatch (float8.dispatch): the expert all-to-all carries each token row in float8 with its scales, the
activation quantisation of the experts' float8 recipe (kernels/float8_scaling.py: 1 x 128 tiles blockwise, one
scale per row rowwise), as DeepSeek-V3 dispatches (arXiv 2412.19437 section 3.3.4); the combine, and the
dispatch's own backward, stay in the compute dtype.

The wire format is one byte tensor per direction: a row's float8 bytes, then its scales' bytes (`to_wire`,
`from_wire`), so one all-to-all with the row split sizes the high-precision dispatch uses carries both (gloo, which
has no float8 type, moves the same bytes). Scales are float32, or MXFP8's one-byte e8m0 (the power of two's
exponent: exact). A row of dim d costs d + 4 x ceil(d / 128) bytes blockwise, d + 4 rowwise, d + ceil(d / 32) mxfp8,
against 2 d in bf16.

The experts' first GEMMs quantise what arrives again: power-of-two scales make that give back the dequantised
values exactly, so an ep run with float8 dispatch computes what one process with float8 experts computes
(tests/float8/test_experts_parity.py). The gradient passes the quantisation straight through, as the experts'
own quantisation does.

The hook: parallel/expert_parallel.py's dispatch carries its rows in the payload's wire form
(ep_routing.Payload); parallelize gives it `Float8Wire(...)` when float8.dispatch is on, in every dispatch mode:
expert, rank, capacity and node (whose second hop, inside the node, quantises the rows the first delivered
again: the same values, by the power-of-two scales).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trillion.kernels import float8_scaling as scaling
from trillion.kernels.float8_grouped_gemm import float8_dtype, resolved

SCALE_BYTES = 4  # float32


def scale_dtype(recipe: str) -> torch.dtype:
    """The scales' type on the wire: MXFP8's e8m0 (one byte), else float32."""
    return torch.float8_e8m0fnu if recipe == "mxfp8" else torch.float32


def to_wire(rows: torch.Tensor, recipe: str, dtype: torch.dtype) -> torch.Tensor:
    """(rows, d) -> (rows, d + the scales' bytes per row) uint8: the float8 row, then its scales."""
    data, scale = scaling.quantize_blocks(rows, *scaling.activation_blocks(recipe), dtype)
    return torch.cat([data.view(torch.uint8), scale.to(scale_dtype(recipe)).view(torch.uint8)], dim=1)


def from_wire(wire: torch.Tensor, dim: int, recipe: str, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """to_wire's bytes -> the dequantised rows (rows, dim) in out_dtype."""
    data = wire[:, :dim].view(dtype)
    scale = wire[:, dim:].contiguous().view(scale_dtype(recipe)).float()
    return scaling.dequantize_blocks(data, scale, *scaling.activation_blocks(recipe), out_dtype)


def wire_bytes_per_row(dim: int, recipe: str) -> int:
    """Bytes one token row of `dim` takes on the wire (the planner's figure)."""
    blocks = scaling.activation_blocks(recipe)[1]
    per_scale = torch.finfo(scale_dtype(recipe)).bits // 8
    return dim + per_scale * (-(-dim // blocks) if blocks else 1)


@dataclass(frozen=True)
class Float8Wire:
    """The dispatch's rows in float8 on the wire (ep_routing.Wire): the recipe and format of float8.experts=`setting`
    on the rows' device (the experts' own, kernels/float8_grouped_gemm.py)."""

    setting: str = "auto"
    emulate: bool = False

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        recipe, _ = resolved(self.setting, self.emulate, rows.device)
        return to_wire(rows, recipe, float8_dtype(rows.device))

    def decode(self, wire: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        recipe, _ = resolved(self.setting, self.emulate, wire.device)
        return from_wire(wire, dim, recipe, float8_dtype(wire.device), dtype)
