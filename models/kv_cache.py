"""Keys and values of past positions, so generation runs each new token through the model once.

The model reads a cache only when one is passed to `Transformer.forward`; training never does.
"""

import torch

from trillion.models.args import ModelArgs


class LayerKV:
    """One layer's keys and values, (batch, kv_heads, max_len, k_dim or v_dim), filled from position 0."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, k_dim: int, v_dim: int, device, dtype):
        self.k = torch.zeros(batch, kv_heads, max_len, k_dim, device=device, dtype=dtype)
        self.v = torch.zeros(batch, kv_heads, max_len, v_dim, device=device, dtype=dtype)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' keys and values; return those of every position so far."""
        end = self.length + k.shape[-2]
        if end > self.k.shape[-2]:
            raise ValueError(f"the KV cache holds {self.k.shape[-2]} positions; {end} were asked for")
        self.k[:, :, self.length : end], self.v[:, :, self.length : end] = k, v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """A LayerKV per transformer layer, keyed as the model's layers are. Latent attention (models/mla.py) caches
    its expanded keys and values: every head's, qk_head_dim and v_head_dim wide."""

    def __init__(self, args: ModelArgs, batch: int, max_len: int, device=None, dtype=torch.float32):
        mla = args.mla
        k_dim, v_dim = (mla.qk_head_dim, mla.v_head_dim) if mla is not None else (args.head_dim, args.head_dim)
        self.layers = {
            str(i): LayerKV(batch, args.kv_heads, max_len, k_dim, v_dim, device, dtype) for i in range(args.n_layers)
        }

    @property
    def length(self) -> int:
        """Positions already held: the position the next token takes."""
        return next(iter(self.layers.values())).length
