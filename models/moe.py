"""The mixture-of-experts feed-forward: a router picks each token's top_k of E routed SwiGLU experts,
the tokens are permuted into expert order (no per-token Python), the experts run as one grouped
matrix product per projection (kernels/grouped_gemm.py), each slot's SwiGLU output weighted by the router's score
before the down projection, and the outputs return to token order, summed; shared experts, if any, see every token.

Where the experts live is not this file's business: `MoE.dispatch` takes the tokens, their chosen experts and
weights and returns each token's weighted sum of its experts' outputs. Here it runs the local experts
(models/expert_rows.py, through the fused permutation); expert parallelism (parallel/expert_parallel.py)
replaces it by all-to-alls around them.

Balancing, on the router's choices: the auxiliary loss (Switch/Mixtral: E * sum_e f_e P_e, f_e the
share of tokens choosing e, P_e the mean score of e) and DeepSeek-V3's sequence-wise one (the same
statistics per sequence, on scores normalised to sum to one) enter the backward through
`_AuxLossGrad`, so the model still returns only logits; the auxiliary-loss-free bias (DeepSeek-V3)
is added to the scores for selection only and moved by `MoEStepHooks.after_step` after each
optimizer step.
Each MoE layer tallies its loads over the step in `load_tally` for both and for the statistics.
"""

import math
from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from trillion.errors import ConfigError
from trillion.kernels.grouped_gemm import backend_unavailable, grouped_mm
from trillion.kernels.swiglu import float8_inputs, from_float8_inputs, routed_swiglu
from trillion.models.args import ModelArgs, MoEArgs
from trillion.models.expert_rows import run_experts
from trillion.models.parts.moe import reach_share
from trillion.models.step_hooks import StepHooks, register_step_hooks

# load_tally holds E loads, then these four
DROPPED, AUX_TIMES_TOKENS, SEQ_AUX_TIMES_TOKENS, TOKENS = range(-4, 0)


class Router(nn.Module):
    """x (tokens, dim) -> scores (tokens, E) in float32, the chosen experts (tokens, top_k) and their
    weights (tokens, top_k). `expert_bias` (with bias_update_rate > 0) steers the choice only."""

    def __init__(self, dim: int, moe: MoEArgs):
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(dim, moe.n_experts, bias=False)
        if moe.bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(moe.n_experts))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        moe = self.moe
        logits = self.gate(x)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 at least, float64 kept
        scores = logits.softmax(dim=-1) if moe.score_func == "softmax" else logits.sigmoid()
        choice = scores.detach() if self.expert_bias is None else scores.detach() + self.expert_bias
        if moe.n_groups > 1:  # DeepSeek-V3: a group scores the sum of its best two; keep the best topk_groups
            grouped = choice.view(x.shape[0], moe.n_groups, -1)
            best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(moe.topk_groups, dim=-1).indices
            allowed = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
            choice = grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).flatten(1)
        chosen = choice.topk(moe.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if moe.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, chosen, weights * moe.route_scale


class RoutedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: w1, w3 (E, dim, hidden), w2 (E, hidden, dim). Under expert
    parallelism each is a DTensor sharded on its first dimension and this rank runs its own experts."""

    def __init__(self, dim: int, moe: MoEArgs):
        super().__init__()
        self.impl, self.permute_impl = moe.experts_impl, moe.permute_impl
        self.float8 = None  # a float8 grouped product (parallel/float8.py), in place of grouped_mm
        # keep w1's and w3's outputs, recompute SwiGLU's in backward (DeepSeek's: parallel/activation_checkpoint.py)
        self.recompute_swiglu = False
        self.grouped_mm = grouped_mm  # one whose weight gradient waits (parallel/deferred_weight_grads.py)
        self.w1 = nn.Parameter(torch.empty(moe.n_experts, dim, moe.expert_ffn_dim))
        self.w3 = nn.Parameter(torch.empty(moe.n_experts, dim, moe.expert_ffn_dim))
        self.w2 = nn.Parameter(torch.empty(moe.n_experts, moe.expert_ffn_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (rows, dim) sorted by expert, `counts` rows per expert of this rank (rows past them: zeros), or
        (sources, experts): rows per expert from each source rank, each expert's in source order; `weights` (rows,)
        each row's routing weight, applied to its SwiGLU output before w2 (models/expert_rows.py says why)."""
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        per_source = counts.dim() == 2
        offsets = (counts.sum(0) if per_source else counts).cumsum(0).to(torch.int32)
        segments = counts.t().flatten().cumsum(0).to(torch.int32) if per_source else offsets
        if self.float8 is not None and self.float8.keep_float8 and torch.is_grad_enabled():
            return self._float8_kept(x, weights, w1, w2, w3, offsets, segments)
        gate, up = self._product(x, w1, offsets, segments), self._product(x, w3, offsets, segments)
        if self.recompute_swiglu and torch.is_grad_enabled():
            # what backward needs of SwiGLU's output (w2's input) comes back from gate and up, its ops run again;
            # the recompute stops there (checkpoint's early stop), before w2's product
            return checkpoint(self._down, gate, up, weights, w2, offsets, segments, use_reentrant=False)
        return self._down(gate, up, weights, w2, offsets, segments)

    def _float8_kept(self, x, weights, w1, w2, w3, offsets, segments) -> torch.Tensor:
        """float8.cache_activations (DeepSeek-V3's activation cache): backward keeps the rows as w1's and w3's
        products quantise them (once, for both), SwiGLU's inputs in float8 (its output recomputed from them,
        kernels/swiglu.py) and w2's input as its product quantises it; no high-precision activation. Under DeepSeek's
        recompute (`recompute_swiglu`) not w2's input either: its product rebuilds it from SwiGLU's float8 inputs."""
        quantized = self.float8.quantize_input(x)
        gate = self.float8(x, w1, offsets, segments, quantized)
        up = self.float8(x, w3, offsets, segments, quantized)
        kept = float8_inputs(gate, up, quantized[0].dtype)
        hidden = routed_swiglu(gate, up, weights, kept)
        rebuild = (partial(from_float8_inputs, dtype=hidden.dtype), (*kept, weights)) if self.recompute_swiglu else None
        return self.float8(hidden, w2, offsets, segments, rebuild=rebuild)

    def _down(self, gate, up, weights, w2, offsets, segments) -> torch.Tensor:
        return self._product(routed_swiglu(gate, up, weights), w2, offsets, segments)

    def _product(self, x, weight, offsets, segments) -> torch.Tensor:
        """The grouped GEMM; a float8 one bounds its weight gradient's token tiles by the segments (one source's
        rows of one expert: kernels/float8_scaling.py)."""
        if self.float8 is None:
            return self.grouped_mm(x, weight, offsets, self.impl)
        return self.float8(x, weight, offsets, segments)


class MoE(nn.Module):
    """(batch, seq, dim) -> (batch, seq, dim). `shared_experts`: a dense feed-forward every token passes."""

    def __init__(self, dim: int, moe: MoEArgs, shared_experts: nn.Module | None = None):
        super().__init__()
        self.moe = moe
        self.router = Router(dim, moe)
        self.experts = RoutedExperts(dim, moe)
        self.shared_experts = shared_experts
        self.register_buffer("load_tally", torch.zeros(moe.n_experts - DROPPED), persistent=False)
        self.token_scale: torch.Tensor | None = None  # MoEStepHooks.before_step: 1 / the step's target tokens
        # Statistics of the micro-batch's sequences summed over the ranks holding their other positions (context
        # parallelism sets it, and folding ep over tp: parallel/context_parallel.py), with their count; None: every
        # rank holds whole ones
        self.sequence_shards: SequenceShards | None = None
        self.last_step_tally: torch.Tensor | None = None  # MoEStepHooks.after_step: the last step's, summed over ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe, shape = self.moe, x.shape
        x = x.reshape(-1, shape[-1])
        scores, chosen, weights = self.router(x)
        kept = self._kept(chosen, shape[0])
        ids = chosen if kept is None else chosen.masked_fill(~kept, -1)  # a dropped choice: expert -1, never run
        # scatter_add, not bincount: bincount reads its input's maximum on the host under CUDA
        counts = torch.zeros(moe.n_experts + 1, dtype=torch.long, device=x.device)
        counts = counts.scatter_add_(0, ids.flatten() % (moe.n_experts + 1), torch.ones_like(ids.flatten()))
        counts = counts[: moe.n_experts]  # (-1 % (E + 1) = E: the dropped choices' bin, cut)
        balancing = (moe.aux_loss_coef > 0 or moe.seq_aux_loss_coef > 0) and torch.is_grad_enabled()
        aux = self._aux_loss(scores, counts) if balancing and moe.aux_loss_coef > 0 else None
        seq_aux = self._sequence_aux_loss(scores, chosen, shape[0]) if balancing and moe.seq_aux_loss_coef > 0 else None
        self._tally(counts, ids.numel() - counts.sum(), scores.shape[0], aux, seq_aux)
        out, beside = self.dispatch(x, ids, weights, self.shared_experts)
        if beside is not None:
            out = out + beside
        if balancing:
            balance = moe.aux_loss_coef * aux if aux is not None else 0.0
            if seq_aux is not None:
                balance = balance + moe.seq_aux_loss_coef * seq_aux
            out = _AuxLossGrad.apply(out, balance, self._token_share(x.shape[0]))
        return out.view(shape)

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, beside=None):
        """(tokens (T, dim), chosen experts (T, top_k; -1: dropped), their weights (T, top_k), work on the tokens to
        run while the routed ones travel (rows -> rows) or None) -> (each token's weighted sum of its experts' outputs
        (T, dim), that work's result). Here the experts are local; expert parallelism (parallel/expert_parallel.py)
        replaces this."""
        return run_experts(self.experts, x, ids, weights), beside(x) if beside is not None else None

    def _kept(self, chosen: torch.Tensor, sequences: int) -> torch.Tensor | None:
        """Which (token, choice) slots the capacities keep (T, top_k), or None when dropless. A per-rank capacity
        applies to each of capacity_shards chunks of the sequences apart (the ranks routing them), unless this layer's
        sequences are already split over ranks (`sequence_shards`): then to its own tokens."""
        moe, kept = self.moe, None
        if moe.capacity_factor > 0:
            kept = self._capacity_mask(chosen.flatten()).view_as(chosen)
        if moe.rank_capacity_factor > 0:
            shards = 1 if self.sequence_shards is not None else moe.capacity_shards
            by_shard = chosen.view(sequences, shards, -1, moe.top_k).transpose(0, 1).reshape(shards, -1, moe.top_k)
            factor, ranks = moe.rank_capacity_factor, moe.capacity_ranks
            masks = [rank_capacity_mask(c, moe.n_experts, ranks, factor) for c in by_shard]
            by_rank = torch.stack(masks).view(shards, sequences, -1, moe.top_k).transpose(0, 1).reshape_as(chosen)
            kept = by_rank if kept is None else kept & by_rank
        return kept

    def _capacity_mask(self, slots: torch.Tensor) -> torch.Tensor:
        """With a capacity factor: which slots their expert takes (the first `capacity` in token order)."""
        moe = self.moe
        capacity = math.ceil(moe.capacity_factor * slots.numel() / moe.n_experts)
        one_hot = F.one_hot(slots, moe.n_experts)
        position_in_expert = (one_hot.cumsum(dim=0) * one_hot).sum(dim=1)  # 1-based, in token order
        return position_in_expert <= capacity

    def _aux_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """E * sum_e (tokens choosing e / tokens) * mean score of e (1.0 when perfectly even, for top-1), over the
        micro-batch: its statistics are sums over its tokens (E counts, E score sums), so a rank holding only some
        of them (context parallelism, or tp ranks that each route their own) adds the others' in first."""
        statistics, tokens = torch.cat([counts.to(scores.dtype), scores.sum(dim=0)]), scores.shape[0]
        if self.sequence_shards is not None:
            statistics, tokens = self.sequence_shards.sum(statistics), tokens * self.sequence_shards.count
        counts, score_sums = statistics.split(self.moe.n_experts)
        return self.moe.n_experts * (counts / tokens * score_sums / tokens).sum()

    def _sequence_aux_loss(self, scores: torch.Tensor, chosen: torch.Tensor, sequences: int) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss without its coefficient (arXiv 2412.19437 eq. 18-20), the
        mean over the micro-batch's sequences of sum_e f_e P_e: f_e = E / (top_k T) x the sequence's tokens
        choosing e, P_e = the sequence's mean of the scores normalised to sum to one over the experts. The
        statistics are sums over the sequence's tokens (its E counts and E score sums), so a rank holding only
        part of each sequence (context parallelism) adds the other parts' in before the product."""
        n_experts, top_k = self.moe.n_experts, self.moe.top_k
        scores = scores.view(sequences, -1, n_experts)
        picks = chosen.view(sequences, -1)
        counts = torch.zeros(sequences, n_experts, device=scores.device, dtype=scores.dtype)
        counts = counts.scatter_add_(1, picks, torch.ones_like(picks, dtype=scores.dtype))
        statistics = torch.cat([counts, (scores / scores.sum(dim=-1, keepdim=True)).sum(dim=1)], dim=-1)
        length = scores.shape[1]
        if self.sequence_shards is not None:
            statistics, length = self.sequence_shards.sum(statistics), length * self.sequence_shards.count
        counts, score_sums = statistics.split(n_experts, dim=-1)
        share = counts * n_experts / (top_k * length)
        return (share * score_sums / length).sum(dim=-1).mean()

    def _token_share(self, tokens: int) -> torch.Tensor | float:
        """This micro-batch's share of the step's tokens (set by MoEStepHooks.before_step), the balance losses'
        weight in the step's loss as the token loss's; 1 outside a training step."""
        return tokens * self.token_scale if self.token_scale is not None else 1.0

    # torch.compiler.disable imports torch._dynamo when applied (about a second per process); this form, on the
    # first call, so a process that never runs an MoE layer never pays it
    @torch._disable_dynamo
    def _tally(self, counts, dropped, tokens: int, aux: torch.Tensor | None, seq_aux: torch.Tensor | None) -> None:
        # Training forwards only (evaluation runs without gradients); a recomputed forward (activation
        # checkpointing, inside the backward) routes as the first did: count once.
        if not (self.training and torch.is_grad_enabled()) or torch._C._current_graph_task_id() != -1:
            return
        with torch.no_grad():
            self.load_tally[: self.moe.n_experts] += counts
            self.load_tally[DROPPED] += dropped
            self.load_tally[TOKENS] += tokens
            if aux is not None:
                self.load_tally[AUX_TIMES_TOKENS] += aux.detach() * tokens
            if seq_aux is not None:
                self.load_tally[SEQ_AUX_TIMES_TOKENS] += seq_aux.detach() * tokens


def rank_capacity(tokens: int, top_k: int, n_experts: int, ranks: int, factor: float) -> int:
    """Rows one source sends one of `ranks` destinations (each E / ranks experts) at most: `factor` x an even share,
    the tokens x reach_share."""
    return math.ceil(factor * tokens * reach_share(n_experts, top_k, n_experts // ranks))


def rank_capacity_mask(chosen: torch.Tensor, n_experts: int, ranks: int, factor: float) -> torch.Tensor:
    """(T, top_k) which choices a per-rank capacity keeps: experts in `ranks` equal groups (an ep rank's); each group
    takes the first rank_capacity(...) tokens that chose any of its experts, in token order, and a token past it
    loses every choice in that group. Expert parallelism's fixed-size dispatch drops exactly these."""
    group = chosen // (n_experts // ranks)
    reaches = torch.zeros(chosen.shape[0], ranks, dtype=torch.long, device=chosen.device).scatter_(1, group, 1)
    position = reaches.cumsum(dim=0) - 1  # (T, ranks): the token's place among those reaching the group
    fits = position < rank_capacity(chosen.shape[0], chosen.shape[1], n_experts, ranks, factor)
    return fits.gather(1, group)


class SequenceShards(Protocol):
    """The other ranks holding positions of the same sequences: `count` of them in all (this one included), each
    an equal share; `sum(tensor)` adds their tensors to this one's, with autograd (the gradient summed back)."""

    count: int

    def sum(self, tensor: torch.Tensor) -> torch.Tensor: ...


class _AuxLossGrad(torch.autograd.Function):
    """Identity on the layer's output whose backward also sends `weight` as the gradient of the balance
    losses (Megatron's approach): the loss joins the backward without changing what the model returns."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor, weight) -> torch.Tensor:
        ctx.weight = weight
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = ctx.weight
        aux_grad = weight.detach().reshape(()) if isinstance(weight, torch.Tensor) else torch.tensor(weight)
        return grad, aux_grad.to(device=grad.device, dtype=torch.float32), None


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """This module's MoE layers by block index (a pipeline stage holds some of them; a multi-token prediction
    block, `mtp.<index>`, numbers after the trunk's), in index order."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            found[next(int(part) for part in name.split(".") if part.isdigit())] = module
    return dict(sorted(found.items()))


class MoEStepHooks(StepHooks):
    """The MoE layers' share of every step (models/step_hooks.py), for the layers found once."""

    def __init__(self, layers: dict[int, MoE]):
        self.layers = layers

    def before_step(self, token_scale: torch.Tensor) -> None:
        """1 / the step's target tokens (times a gradient scaler's scale), so that each micro-batch's
        auxiliary loss weighs by its share of the step's tokens, as the token loss does."""
        for layer in self.layers.values():
            layer.token_scale = token_scale

    @torch.no_grad()
    def after_step(self, sum_over_ranks) -> None:
        """Each MoE layer's tally summed by `sum_over_ranks` (in place, over the ranks that route other tokens
        through the same layers: data-parallel x cp, and the tp ranks when ep folds over them) into its
        `last_step_tally` (E loads, then dropped slots, auxiliary loss x tokens, sequence-wise auxiliary loss x
        tokens, tokens; on the device), the balancing
        bias moved toward equal load (the same on every such rank), the tallies zeroed. One small all-reduce;
        nothing read on the host."""
        tally = torch.stack([layer.load_tally for layer in self.layers.values()])
        sum_over_ranks(tally)
        for row, layer in zip(tally, self.layers.values()):
            layer.load_tally.zero_()
            layer.last_step_tally = row
            bias, loads = layer.router.expert_bias, row[: layer.moe.n_experts]
            if bias is not None:
                step = layer.moe.bias_update_rate * torch.sign(loads.mean() - loads)
                bias += step - step.mean()

    def statistics(self) -> dict:
        """The last step's per-layer statistics, read on the host (a logged step's): tokens per expert,
        max/mean load (1 = even), the share of token-expert slots the capacity dropped, the auxiliary losses
        (without their coefficients), the bias spread (max - min)."""
        stats = {}
        for index, layer in self.layers.items():
            if layer.last_step_tally is None:
                continue
            values, moe = layer.last_step_tally.tolist(), layer.moe
            loads, tokens = values[: moe.n_experts], max(values[TOKENS], 1.0)
            prefix = f"moe/layer{index}/"
            stats[prefix + "tokens_per_expert"] = [int(load) for load in loads]
            stats[prefix + "max_mean"] = max(loads) / max(sum(loads) / len(loads), 1e-9)
            stats[prefix + "dropped"] = values[DROPPED] / (tokens * moe.top_k)
            if moe.aux_loss_coef > 0:
                stats[prefix + "aux_loss"] = values[AUX_TIMES_TOKENS] / tokens
            if moe.seq_aux_loss_coef > 0:
                stats[prefix + "seq_aux_loss"] = values[SEQ_AUX_TIMES_TOKENS] / tokens
            bias = layer.router.expert_bias
            if bias is not None:
                stats[prefix + "bias_spread"] = (bias.max() - bias.min()).item()
        return stats


@register_step_hooks
def moe_step_hooks(model: nn.Module) -> list[MoEStepHooks]:
    """One MoEStepHooks for the model's MoE layers; none for a model (or pipeline stage) without them."""
    layers = moe_layers(model)
    return [MoEStepHooks(layers)] if layers else []


def routed_expert_stacks(model: nn.Module) -> list[RoutedExperts]:
    """The RoutedExperts of this module's MoE layers (parallel/float8_experts.py gives them a float8 product)."""
    return [layer.experts for layer in moe_layers(model).values()]


def routed_expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The stacked routed-expert weights this module holds (what expert parallelism spreads over ep)."""
    return [p for layer in moe_layers(model).values() for p in layer.experts.parameters()]


def reset_moe_state(model: nn.Module) -> None:
    """Zero the balancing bias and the tallies (init_weights: buffers built on the meta device hold garbage)."""
    for layer in moe_layers(model).values():
        layer.load_tally.zero_()
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.zero_()


def check_grouped_gemm(args: ModelArgs, device: torch.device, dtype: torch.dtype) -> None:
    """kernels.grouped_gemm=torch or =triton where that backend cannot run: refused before any work (nothing
    to check for a dense model)."""
    if args.moe is None or args.moe.experts_impl not in ("torch", "triton"):
        return
    x = torch.empty(0, args.dim, device=device, dtype=dtype)
    why = backend_unavailable(args.moe.experts_impl, x, torch.empty(0, 0, args.moe.expert_ffn_dim, dtype=dtype))
    if why is not None:
        raise ConfigError(
            f"kernels.grouped_gemm={args.moe.experts_impl} cannot run here: {why}. Use --kernels.grouped_gemm=auto "
            "(torch._grouped_mm where it runs, else the Triton kernel on a GPU, else one matmul per expert) or "
            "--kernels.grouped_gemm=loop."
        )
