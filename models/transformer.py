"""One decoder-only transformer for both families in experiments/frontier/PAPER.md.

GPT: LayerNorm, GELU MLP (4h), learned (or rotary) positions, biases, untied output.
Llama: RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, no biases.
The fields of ModelArgs pick the parts; there is no `if family` anywhere below.

The model holds no process groups: parallelism is applied from outside (parallel/). It is built
on the meta device and then materialized with `to_empty` + `init_weights`, which gives the same
values for the same seed whatever happens between the two.
"""

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from trillion.models.args import ModelArgs
from trillion.models.attention import with_documents
from trillion.models.kv_cache import KVCache, LayerKV
from trillion.models.moe import MoE, reset_moe_state
from trillion.models.mtp import MultiTokenPrediction, predict_ahead
from trillion.models.parts import attention_kind
from trillion.models.rope import apply_rope, model_rope_cache, rope_cache  # noqa: F401 (rope_cache: tests use it here)


def build_norm(args: ModelArgs) -> nn.Module:
    if args.norm_impl == "triton":
        from trillion.kernels.norm import LayerNorm, RMSNorm  # subclasses of the torch modules below
    else:
        LayerNorm, RMSNorm = nn.LayerNorm, nn.RMSNorm
    if args.norm == "layernorm":
        return LayerNorm(args.dim, eps=args.norm_eps, bias=args.bias)
    return RMSNorm(args.dim, eps=args.norm_eps)


class FeedForward(nn.Module):
    """SwiGLU (w2(silu(w1 x) * w3 x)) or GELU (w2(gelu(w1 x))); w3 exists only for SwiGLU. `hidden`:
    the width, args.ffn_hidden unless given (an MoE layer's shared experts)."""

    def __init__(self, args: ModelArgs, hidden: int | None = None):
        super().__init__()
        self.gated = args.mlp == "swiglu"
        hidden = hidden or args.ffn_hidden
        self.w1 = nn.Linear(args.dim, hidden, bias=args.bias)
        self.w2 = nn.Linear(hidden, args.dim, bias=args.bias)
        self.w3 = nn.Linear(args.dim, hidden, bias=args.bias) if self.gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


def build_feed_forward(args: ModelArgs, index: int) -> nn.Module:
    """Block `index`'s feed-forward: dense, or a mixture of experts past the preset's dense blocks."""
    if not args.is_moe_layer(index):
        return FeedForward(args)
    moe = args.moe
    shared = FeedForward(args, hidden=moe.n_shared_experts * moe.expert_ffn_dim) if moe.n_shared_experts else None
    return MoE(args.dim, moe, shared_experts=shared)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, index: int = 0):
        super().__init__()
        self.attention_norm = build_norm(args)
        self.attention = attention_kind(args).build(args)  # models/parts: the kind ModelArgs chooses
        self.ffn_norm = build_norm(args)
        self.feed_forward = build_feed_forward(args, index)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor | None, cache: LayerKV | None = None, document_ids=None
    ) -> torch.Tensor:
        x = x + self.attend(x, rope, cache, document_ids)
        return x + self.feed(x)

    # The two sublayers' branches, each its norm and its part: seams a recompute mode checkpoints apart
    # (parallel/activation_checkpoint.py, DeepSeek's recompute of norms and up-projections)
    def attend(self, x: torch.Tensor, rope, cache: LayerKV | None = None, document_ids=None) -> torch.Tensor:
        # keywords: TP plans list positional inputs; document ids only where given (an attention kind that
        # cannot mask documents is refused before a run: models/parts AttentionKind.masks_documents)
        return self.attention(self.attention_norm(x), rope, cache=cache, **with_documents(document_ids))

    def feed(self, x: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab).

    Layers live in a ModuleDict keyed by their index, and every top-level part may be None, so a
    pipeline stage can delete what it does not own while parameter names stay global.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim) if args.positions == "learned" else None
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm = build_norm(args)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # multi-token prediction (training only): keyed by the layer numbers after the trunk's, as published
        depths = range(args.n_layers, args.n_layers + args.mtp_modules)
        make_norm = lambda: build_norm(args)  # noqa: E731
        mtp = {str(i): MultiTokenPrediction(args.dim, TransformerBlock(args, i), make_norm) for i in depths}
        self.mtp = nn.ModuleDict(mtp) if mtp else None
        if args.positions == "rope":
            self.register_buffer("rope", model_rope_cache(args), persistent=False)
        else:
            self.rope = None

    def units(self) -> list[nn.Module]:
        """What FSDP shards one at a time: each block this module holds, then each multi-token prediction
        module (its block and projection, models/mtp.py)."""
        return [*self.layers.values(), *self.ahead_modules().values()]

    def ahead_modules(self) -> dict[str, nn.Module]:
        """The multi-token prediction modules this module holds, by layer index (none: {})."""
        return dict(self.mtp.items()) if self.mtp is not None else {}

    def blocks(self) -> dict[str, nn.Module]:
        """Every transformer block this module holds by its layer index: the trunk's, then each multi-token
        prediction module's (numbered on), which tensor and context parallelism treat as the trunk's."""
        return {**self.layers, **{index: module.block for index, module in self.ahead_modules().items()}}

    def output_end(self) -> list[nn.Module | None]:
        """What runs with the output head, on a pipeline's last stage: the final norm, the head and the multi-token
        prediction modules."""
        return [self.norm, self.output, self.mtp]

    def output_end_reads(self) -> list[str]:
        """The input end's modules the output end also reads: the embedding, which the multi-token prediction
        modules embed later tokens with (a pipeline's last stage keeps a copy: parallel/pipeline_ahead.py)."""
        return ["tok_embeddings"] if self.mtp is not None else []

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        *,
        ahead: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """`tokens` (batch, seq) token ids, or a pipeline stage's hidden state (floating point). `positions` (seq,):
        the position of each token in its sequence, 0..seq-1 unless given; a context-parallel rank, which holds
        chunks of every sequence, passes theirs; (batch, seq) where they restart at each document. With a `cache`
        (generation) the tokens continue the positions it holds and are added to it. `ahead` (batch, seq, D)
        (training with multi-token prediction): at each position the tokens 1..D further on (models/mtp.py); the
        module holding the head then returns (logits, depth 1's logits, ..., depth D's). `document_ids` (batch, the
        whole sequence): attention stays within each document packed into a sequence (kernels.attention)."""
        embeds = self.tok_embeddings is not None and not torch.is_floating_point(tokens)
        h = self.tok_embeddings(tokens) if embeds else tokens
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + h.shape[1], device=h.device)
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(positions)
        rope = self.rope[:, positions] if self.rope is not None else None
        if rope is not None and positions.dim() == 2:  # per sequence: (2, batch, 1, seq, rotary dim), over the heads
            rope = rope.unsqueeze(2)
        documents = with_documents(document_ids)
        for name, layer in self.layers.items():
            h = layer(h, rope, cache=cache.layers[name]) if cache is not None else layer(h, rope, **documents)
        h = self.norm(h) if self.norm is not None else h
        logits = self.output(h) if self.output is not None else h
        if ahead is not None and self.mtp is not None:
            ahead_logits = predict_ahead(self.mtp, self.tok_embeddings, self.output, ahead, h, rope, document_ids)
            return (logits, *ahead_logits)
        return logits

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter from `seed`, wherever and however it is stored.

        GPT-2 scheme: normal(0, init_std) for weights, the residual-branch output projections
        scaled by 1/sqrt(2 * n_layers), zero biases, unit norm weights. Each parameter draws from
        its own generator, seeded by (seed, name), so a pipeline stage that holds only some of the
        parameters gets the same values for them as the whole model does.

        A parameter sharded by tensor parallelism or FSDP (a DTensor) gets exactly the values it
        would have in one process: the full tensor is drawn on this rank's device and each rank
        keeps its own shard of it. That costs one parameter's full size of temporary memory (the
        largest, gpt-1t's 102400 x 25600 FFN matrix, is 10 GB in fp32), never the whole model;
        drawing shard by shard would need a counter-based generator to match one process, which
        the CPU has not. This is layout-agnostic code: it asks only how the tensor is stored.
        """
        std, out_std = self.args.init_std, self.args.init_std / math.sqrt(2 * self.args.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif "norm" in name:
                nn.init.ones_(param)
            else:
                generator = torch.Generator(device=param.device).manual_seed(
                    seed * 1_000_003 + zlib.crc32(name.encode())
                )
                full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
                residual_out = name.endswith(("wo.weight", "w2.weight", "experts.w2"))
                full.normal_(0.0, out_std if residual_out else std, generator=generator)
                _copy_full_into(param, full)
        reset_moe_state(self)
        if self.rope is not None:
            self.rope = model_rope_cache(self.args, device=self.rope.device)


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """param <- full, where param may hold only this rank's shard of it (a DTensor)."""
    if isinstance(param, DTensor):
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(shard)
    else:
        param.copy_(full)
