"""How the flash attention kernels tile a head dim, free of Triton (the planner prices attention with it):
q/k's dim in one padded power-of-two block or two, v's padded, and what a query-key pair then costs."""

from trillion.kernels._triton_setup import next_power_of_2


def block_d_for(head_dim: int) -> int:
    """The head dim padded to the kernels' tile: the next power of two, at least 16."""
    return max(16, next_power_of_2(head_dim))


def block_dims_for(head_dim: int) -> tuple[int, int]:
    """The q/k head dim's blocks in the kernels (BLOCK_D, BLOCK_D2): one padded power of two (BLOCK_D2 = 0),
    or, where two cover it with less padding, its largest power of two and the rest padded (latent
    attention's 192: 128 + 64, two dot products per tile instead of one over 256)."""
    padded, main = block_d_for(head_dim), 1 << (head_dim.bit_length() - 1)
    if main < 16 or main == head_dim:
        return padded, 0
    rest = block_d_for(head_dim - main)
    return (main, rest) if main + rest < padded else (padded, 0)


def executed_width(qk_head_dim: int, v_head_dim: int) -> int:
    """The q/k plus v width the kernels' matmuls run per query-key pair, padding included (against
    qk_head_dim + v_head_dim of useful work): 320 for latent attention's 192/128, 256 for 128/128."""
    return sum(block_dims_for(qk_head_dim)) + block_d_for(v_head_dim)
