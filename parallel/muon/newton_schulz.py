"""Newton-Schulz orthogonalization: a stack of matrices -> each one's nearest semi-orthogonal matrix, roughly
(U S' V^T with S' near 1 rather than U V^T: Keller Jordan's quintic iteration, parallel/muon/matrices.py QUINTIC).

The same operations, in the same order, as torch.optim.Muon's `_zeropower_via_newtonschulz`
(torch/optim/_muon.py): a wide copy (a tall matrix transposed), divided by its Frobenius norm (at least EPS),
then per step A = X X^T, B = b A + c A A, X = a X + B X, transposed back. Here for a whole stack at once (batched
matrix products), in the `dtype` asked for; torch's hard-codes bfloat16.
"""

import torch

from trillion.parallel.muon.matrices import QUINTIC

EPS = 1e-7  # torch.optim.Muon's: the smallest norm divided by (an all-zero update stays zero)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def working_dtype(name: str, state_dtype: torch.dtype, device_type: str) -> torch.dtype:
    """optimizer.newton_schulz_dtype as a dtype: auto is bfloat16 on GPUs (Keller Jordan's and Moonlight's
    choice, the tensor cores' rate) and float32 elsewhere (a CPU multiplies bfloat16 no faster); float32 means
    at least float32, so a float64 run (the reference tests) stays in float64."""
    if name == "auto":
        name = "bfloat16" if device_type == "cuda" else "float32"
    dtype = DTYPES[name]
    return torch.promote_types(dtype, state_dtype) if dtype == torch.float32 else dtype


def orthogonalize(matrices: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """(k, rows, cols) -> (k, rows, cols) in `dtype`: each matrix orthogonalized by `steps` quintic steps."""
    a, b, c = QUINTIC
    x = matrices.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=EPS)
    for _ in range(steps):
        gram = x @ x.mT
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, update, x, beta=a)
    return x.mT if tall else x
