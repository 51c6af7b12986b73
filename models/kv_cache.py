"""Keys and values of past positions, so generation runs each new token through the model once.

The model reads a cache only when one is passed to `Transformer.forward`; training never does.
"""

import torch

from trillion.models.args import ModelArgs


class LayerKV:
    """One layer's keys and values, (batch, kv_heads, max_len, head_dim), filled from position 0."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, device, dtype):
        self.k = torch.zeros(batch, kv_heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
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
    """A LayerKV per transformer layer, keyed as the model's layers are."""

    def __init__(self, args: ModelArgs, batch: int, max_len: int, device=None, dtype=torch.float32):
        self.layers = {
            str(i): LayerKV(batch, args.kv_heads, max_len, args.head_dim, device, dtype) for i in range(args.n_layers)
        }

    @property
    def length(self) -> int:
        """Positions already held: the position the next token takes."""
        return next(iter(self.layers.values())).length
