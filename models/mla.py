"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values come from one compressed latent.

    queries:  wq x                                   or  wq_b(q_norm(wq_a x))   (q_lora_rank > 0)
    latent:   [c, k_rope] = wkv_a x;  [k_nope, v] = wkv_b(kv_norm(c)) per head
    q, k:     [nope part, rotary part]; the key's rotary part is one head shared by all heads

A query/key head is qk_nope_head_dim + qk_rope_head_dim wide, a value head v_head_dim; the attention
runs through kernels.attention like the other attention's, with its own softmax scale (YaRN's mscale^2
when the preset stretches its context). Generation caches the expanded keys and values (as the other
attention does), not the latent: simpler, n_heads x (qk + v) per position instead of kv_lora_rank + rope.

Tensor parallelism (parallel/tensor_parallel.py) splits the heads: wq / wq_b and wkv_b column-wise, wo
row-wise; the down projections and their norms are replicated. Under it the tensors here are DTensors
up to the attention call, so the shared rotary key's gradient is summed over every rank's heads.
"""

import torch
from torch import nn

from trillion.kernels import attention
from trillion.models.args import ModelArgs
from trillion.models.attention import with_documents
from trillion.models.kv_cache import LayerKV
from trillion.models.rope import apply_rope, yarn_mscale

# The latent norms' epsilon: DeepSeek's and transformers' code build them with their default, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def softmax_scale(args: ModelArgs) -> float:
    """qk_head_dim^-0.5, times mscale^2 of YaRN's mscale_all_dim when the preset stretches its context."""
    scale = args.mla.qk_head_dim**-0.5
    if args.yarn is not None and args.yarn.mscale_all_dim:
        scale *= yarn_mscale(args.yarn.factor, args.yarn.mscale_all_dim) ** 2
    return scale


class MLAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        mla = args.mla
        self.mla, self.impl, self.softmax_scale = mla, args.attention_impl, softmax_scale(args)
        q_out = args.n_heads * mla.qk_head_dim
        if mla.q_lora_rank > 0:
            self.wq = None
            self.wq_a = nn.Linear(args.dim, mla.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(mla.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(mla.q_lora_rank, q_out, bias=False)
        else:
            self.wq = nn.Linear(args.dim, q_out, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        self.wkv_a = nn.Linear(args.dim, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(mla.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(mla.kv_lora_rank, args.n_heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * mla.v_head_dim, args.dim, bias=False)
        # context parallelism (parallel/context_parallel.py) puts attention across sequence shards here
        self.attend = attention

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, cache: LayerKV | None = None, document_ids=None
    ) -> torch.Tensor:
        mla, (batch, seq, _) = self.mla, x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 instead of the head count: under tensor parallelism each rank holds a slice of the heads.
        q = q.view(batch, seq, -1, mla.qk_head_dim).transpose(1, 2)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq, -1, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k_rope = apply_rope(k_rope.unsqueeze(1), rope)  # (batch, 1, seq, rope): one head for all
        q = torch.cat([q_nope, apply_rope(q_rope, rope)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        if cache is not None:  # generation: attend to the cached positions too (causal aligns lower right)
            k, v = cache.append(k, v)
        out = self.attend(
            q, k, v, impl=self.impl, causal=True, softmax_scale=self.softmax_scale, **with_documents(document_ids)
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
