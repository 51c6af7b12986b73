"""How the flash attention kernels tile a head dim, free of Triton: q/k's dim in one padded power-of-two block
or two, v's padded (the ahead-of-time report counts each tile's FLOPs and their padding with it)."""

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
