"""Which parameters Muon orthogonalizes, read from the parts' declarations (models/parts), and what one
orthogonalization costs. No torch here: the planner (parallel/planner/optimizer.py) reads it.

Muon takes the hidden weight matrices: every linear a block's parts declare (attention's projections, latent
attention's low-rank ones included, the MLP's, an MoE layer's shared experts), the router's gate, each expert of
a routed-expert stack (E, in, out) as its own matrix, and a multi-token prediction module's projection and block.
AdamW keeps what is not a hidden matrix: the embedding tables and the output head (the root's: models/parts/root.py),
every norm and every bias. The router's gate stays with Muon, as Moonlight's and Kimi K2's released code keep
every 2-D weight but the embedding and the head there (it is a hidden matrix, dim x E); the benchmark trains
debug-moe that way (experiments/bench/RESULTS.md).
"""

from dataclasses import dataclass

from trillion.models import parts
from trillion.models.args import ModelArgs

# Keller Jordan's quintic Newton-Schulz coefficients, as torch.optim.Muon (torch/optim/_muon.py) and Moonlight use
QUINTIC = (3.4445, -4.7750, 2.0315)
NEWTON_SCHULZ_STEPS = 5  # the published iteration count, torch.optim.Muon's default
MAX_NEWTON_SCHULZ_STEPS = 20  # optimizer.newton_schulz_steps' ceiling (config check says why)
MOMENTUM = 0.95  # Muon's (Nesterov) momentum in Moonlight and Kimi K2, torch.optim.Muon's default
# Moonlight's update scale ("Muon is Scalable for LLM Training", arXiv 2502.16982): 0.2 x sqrt(max(rows, cols))
# gives the orthogonalized update AdamW's RMS, so AdamW's learning rate, weight decay and schedule carry over
# (torch.optim.Muon's adjust_lr_fn="match_rms_adamw")
MATCH_ADAMW_RMS = 0.2


@dataclass(frozen=True)
class HiddenMatrix:
    """A parameter Muon steps: `count` matrices of `rows` x `cols` (1 for a linear's (out, in) weight, E for an
    expert stack (E, in, out), each expert its own); `tp_dim`: the dimension of one matrix tensor parallelism
    splits (None: whole on every tp rank); `stacked`: the parameter is 3-D (count, rows, cols)."""

    name: str
    count: int
    rows: int
    cols: int
    tp_dim: int | None
    stacked: bool = False

    @property
    def numel(self) -> int:
        return self.count * self.rows * self.cols

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.count, self.rows, self.cols) if self.stacked else (self.rows, self.cols)

    @property
    def update_scale(self) -> float:
        """Moonlight's RMS match: 0.2 x sqrt(max(rows, cols)), times the learning rate."""
        return MATCH_ADAMW_RMS * max(self.rows, self.cols) ** 0.5


def block_matrices(block: parts.Block, prefix: str) -> list[HiddenMatrix]:
    """A block's hidden matrices (its declaration, models/parts), named under `prefix` ("layers.3.")."""
    found = [
        HiddenMatrix(f"{prefix}{x.name}.weight", 1, x.out_features, x.in_features, x.tp_dim) for x in block.linears
    ]
    if block.routing is not None:
        gate = block.routing.gate
        found.append(HiddenMatrix(f"{prefix}{gate.name}.weight", 1, gate.out_features, gate.in_features, None))
    for stack in block.experts:
        found.append(
            HiddenMatrix(f"{prefix}{stack.name}", stack.n_experts, stack.in_features, stack.out_features, None, True)
        )
    return found


def hidden_matrices(args: ModelArgs) -> dict[str, HiddenMatrix]:
    """Every hidden matrix of the model by parameter name (a pipeline stage holds some of them)."""
    found = [m for i in range(args.n_layers) for m in block_matrices(parts.layer_block(args, i), f"layers.{i}.")]
    count, ahead = parts.ahead_modules(args)
    for i in range(args.n_layers, args.n_layers + count):
        found += block_matrices(parts.layer_block(args, i), f"mtp.{i}.block.")
        found += [
            HiddenMatrix(f"mtp.{i}.{x.name}.weight", 1, x.out_features, x.in_features, x.tp_dim) for x in ahead.linears
        ]
    return {m.name: m for m in found}


def newton_schulz_flops(rows: int, cols: int, steps: int = NEWTON_SCHULZ_STEPS) -> float:
    """FLOPs of one matrix's orthogonalization: each quintic step on X (m x n, m = min(rows, cols)) forms
    A = X X^T (2 m^2 n), B = b A + c A A (2 m^3) and a X + B X (2 m^2 n), as newton_schulz.py runs them."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4.0 * m * m * n + 2.0 * m**3)
