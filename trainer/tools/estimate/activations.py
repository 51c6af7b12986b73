"""The activation peak of one micro-batch, measured by PyTorch's MemTracker: on meta tensors for the
estimate (trainer/tools/estimate/dry_run.py), on real tensors for the checks against it (tests/estimate).

The model given is already tensor-parallel and activation-checkpointed, without FSDP: FSDP changes
where parameters live, not what forward and backward keep.

Mixture-of-experts layers on meta tensors (`_moe_on_meta`): their routing is data (which expert each
token picks), which meta tensors do not have. Every expert then gets the same share of the rows: the
planner's default `moe_load_imbalance` of 1.0. Under expert parallelism the dispatch's one host read
(the split sizes, parallel/expert_parallel.py) is replaced by that balanced route, and the token
all-to-alls run on meta (the fake group moves nothing); the grouped matmul takes the backend the
target picks (torch._grouped_mm in bf16, as on sm90; the per-expert loop otherwise) with even groups.
The micro-batch is measured as the run's steady state holds it (on real tensors too): where the layout pairs
micro-batches, whole (its tokens in one chunk a layer, as a paired forward sends them), where it does not, in the
in-layer overlap's chunks.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@dataclass(frozen=True)
class MicroBatchMemory:
    """One micro-batch through one stage (the whole model without pipelining): bytes above what
    existed before it (parameters, the stage input, the gradient arriving for its output)."""

    held: int  # from the end of its forward (loss included on the last stage) until its backward
    forward_peak: int
    peak: int  # forward and backward
    grad_elements: int  # weight-gradient elements as autograd made them
    # parallel.defer_weight_grads: what an input-gradient pass leaves queued for its weight pass (the products'
    # inputs and output gradients); 0 without deferral
    awaiting_weights: int = 0

    def scaled(self, other: "MicroBatchMemory", factor: float) -> "MicroBatchMemory":
        """self + factor x (other - self), field by field: extrapolation in depth."""
        return MicroBatchMemory(
            **{
                f: int(round(getattr(self, f) + factor * (getattr(other, f) - getattr(self, f))))
                for f in self.__dataclass_fields__
            }
        )


def measure_micro_batch(
    model: nn.Module, inputs: torch.Tensor, target: torch.Tensor, tp_enabled: bool, last: bool, gpu: bool = True
) -> MicroBatchMemory:
    """Forward and backward of one micro-batch under MemTracker. `inputs`: tokens, or the hidden state a
    later stage receives; `target`: the labels on the `last` stage (its loss is the trainer's), else
    the gradient the next stage sends back for the output. Both exist before tracking starts, as the
    pipeline's receive buffers do, and are left out of every figure. Weight gradients are dropped once
    accumulated (FSDP reduce-scatters and frees them; the kept shards are counted as gradients), so the
    figures are activations, their gradients and the temporaries of backward (under parallel.defer_weight_grads
    the backward runs as an input-gradient pass, its peak holding what it queues: `awaiting_weights`). Under TP
    alone a vocabulary-parallel embedding gets a replicated, whole-table gradient (DTensor's embedding backward
    does not keep the shard), which `grad_elements` reports. `gpu`: the run is for GPUs, whose fused norms meta
    tensors then keep (`_norm_on_meta`); else torch's norms keep on meta what they keep on a CPU."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from trillion.parallel.tensor_parallel import loss_context

    grad_elements = {}

    def drop(param):
        if param.grad is None:  # a deferred weight gradient's (parallel.defer_weight_grads): it comes with the W
            return
        local = local_tensor(param.grad)
        grad_elements[id(param)] = local.untyped_storage().nbytes() // local.element_size()
        param.grad = None

    device = local_tensor(inputs).device.type
    queue = getattr(model, "weight_grad_queue", None)  # parallel.defer_weight_grads (deferred_weight_grads.py)
    handles = [p.register_post_accumulate_grad_hook(drop) for p in model.parameters() if p.requires_grad]
    tracker = MemTracker()
    # the input and target too: MemTracker starts counting a storage made before it when an op returns a view of it,
    # which would put a later stage's received hidden state in `held` as well as in its receive buffer
    # (pipeline_schedule.py's, counted apart)
    tracker.track_external(model, inputs, target)
    try:
        with (
            tracker,
            _flash_on_meta(),
            _norm_on_meta(gpu),
            _moe_on_meta(),
            warnings.catch_warnings(),
            loss_context(tp_enabled and last),
        ):
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable")  # MemTracker on grad=None
            base = _device_total(tracker.get_tracker_snapshot("current"), device)
            output = _last_stage_loss(model, inputs, target) if last else model(inputs)
            held = _device_total(tracker.get_tracker_snapshot("current"), device) - base
            forward_peak = _device_total(tracker.get_tracker_snapshot("peak"), device) - base
            with queue.deferring(True) if queue is not None else contextlib.nullcontext():
                output.backward(None if last else target)  # as an input-gradient pass, under deferral
            del output
            peak = _device_total(tracker.get_tracker_snapshot("peak"), device) - base
            awaiting = 0
            if queue is not None:
                awaiting = _device_total(tracker.get_tracker_snapshot("current"), device) - base
                queue.take()()  # the weight pass: its gradients counted as autograd's are
    finally:
        for handle in handles:
            handle.remove()
    return MicroBatchMemory(held, forward_peak, peak, sum(grad_elements.values()), awaiting)


def _last_stage_loss(model: nn.Module, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The trainer's loss on the last stage, before its division by the tokens; with the multi-token prediction
    modules the stage holds, run as the trainer runs them (their inputs and logits are the stage's activations too)."""
    from trillion.models.mtp import lookahead_labels, lookahead_tokens
    from trillion.parallel.forward_backward import IGNORE_INDEX, lookahead_loss, token_loss

    depths = len(model.ahead_modules())
    if not depths:
        return token_loss(model(inputs), target, 1)
    stacked = lookahead_labels(target, depths, IGNORE_INDEX)
    logits, *depth_logits = model(inputs, ahead=lookahead_tokens(stacked))
    return token_loss(logits, target, 1) + lookahead_loss(depth_logits, stacked, 1)


def _meta_flash(q, k, v, causal: bool, scale: float | None) -> torch.Tensor:
    if q.shape[-1] != v.shape[-1]:
        # a value head narrower or wider than the query/key head (latent attention: 192 and 128), which aten's flash
        # op does not take: the project's flash kernel (kernels/flash_attention_op.py), whose fake has its outputs,
        # the output and an fp32 log-sum-exp per query and head; an op the op-level policies keep, as on a GPU
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return torch.ops.trillion.flash_attn_fwd(q, k, v, causal, scale)[0]
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[0]


@contextlib.contextmanager
def _flash_on_meta():
    """On meta tensors SDPA falls back to its math path, which saves the seq x seq score matrix; a GPU
    (flash / memory-efficient SDPA, our Triton kernel) and the CPU (flash for CPU) save only the output
    and an fp32 log-sum-exp per query and head. While measuring, SDPA on meta tensors runs the flash op,
    whose meta kernel has exactly those outputs. The same for the kernels' SDPA path with fewer queries
    than keys (context parallelism's query chunks), which takes the eager path for its lower-right mask
    (the mask's alignment changes no shape). A patch of the function rather than a TorchFunctionMode:
    modes are thread-local and checkpoint recomputation runs on autograd's thread."""
    plain = F.scaled_dot_product_attention
    kernels = importlib.import_module("trillion.kernels.attention_dispatch")
    eager = kernels.eager_attention

    def eager_on_meta(q, k, v, *, causal=True, softmax_scale=None):
        if q.device.type != "meta":
            return eager(q, k, v, causal=causal, softmax_scale=softmax_scale)
        return _meta_flash(q, k, v, causal, softmax_scale)

    def flash(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.device.type != "meta" or attn_mask is not None or dropout_p:
            return plain(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        return _meta_flash(q, k, v, is_causal, scale)

    F.scaled_dot_product_attention, kernels.eager_attention = flash, eager_on_meta
    try:
        yield
    finally:
        F.scaled_dot_product_attention, kernels.eager_attention = plain, eager


@contextlib.contextmanager
def _norm_on_meta(gpu: bool):
    """Norms on meta tensors as a GPU runs them. There both norm paths are fused and keep the input and an fp32 rstd
    per row: the project's kernel (kernels/norm.py; kernels.norm=triton, auto without tensor parallelism) where a row
    fits it, else torch's F.rms_norm (auto under tensor parallelism; the latent and QK norms), which on CUDA runs
    aten._fused_rms_norm: its autograd node (FusedRmsNormBackward0, torch 2.13) saves the input, the weight and the
    fp32 rstd, and DTensor has its sharding rule (torch/distributed/tensor/_ops/_math_ops.py). On meta tensors both
    would run torch's composite RMSNorm (aten._fused_rms_norm has no meta kernel, only its composite, and
    torch.library refuses a meta kernel for an op with one), which keeps an fp32 copy of the input and of the
    normalised rows: 8 bytes an element in bf16, against 2. So while measuring both run the project's fused op on meta
    tensors, whose fake and DTensor rule keep that same set. F.rms_norm stays the composite where aten's rms_norm
    takes it (a weight of another dtype than the input's) and for a run not on GPUs (`gpu` false), as a CPU runs it."""
    norm = importlib.import_module("trillion.kernels.norm")
    plain, functional = norm._use_triton, F.rms_norm

    def fused_on_meta(x, what):
        if x.device.type != "meta":
            return plain(x, what)
        return x.shape[-1] <= norm.MAX_FUSED_DIM

    def rms_norm_on_meta(x, normalized_shape, weight=None, eps=None):
        composite = len(normalized_shape) != 1 or (weight is not None and weight.dtype != x.dtype)
        if x.device.type != "meta" or not gpu or composite:
            return functional(x, normalized_shape, weight, eps)
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        return norm._fwd_op(x, weight, None, float(eps), True)[0]

    # the kernels' fall-back notes (the target's Triton kernels on meta tensors fall back to the ops patched here)
    notes = logging.getLogger("kernels")
    level, norm._use_triton, F.rms_norm = notes.level, fused_on_meta, rms_norm_on_meta
    notes.setLevel(logging.ERROR)
    try:
        yield
    finally:
        norm._use_triton, F.rms_norm = plain, functional
        notes.setLevel(level)


@contextlib.contextmanager
def _moe_on_meta():
    """MoE layers on meta tensors with balanced routing (the module docstring); real tensors as they are."""
    grouped = importlib.import_module("trillion.kernels.grouped_gemm")
    expert_parallel = importlib.import_module("trillion.parallel.expert_parallel")
    unavailable, loop, sizes, parts = (
        grouped.grouped_mm_unavailable,
        grouped.loop_grouped_mm,
        expert_parallel.ExpertDispatch._sizes,
        expert_parallel.ExpertDispatch._parts,
    )

    def unavailable_on_meta(x, weight):
        if x.device.type != "meta":
            return unavailable(x, weight)
        return None if x.dtype == torch.bfloat16 else "the target's torch._grouped_mm runs bf16 only"

    def loop_on_meta(x, weight, offsets):
        if x.device.type != "meta":
            return loop(x, weight, offsets)
        bounds = [x.shape[0] * g // weight.shape[0] for g in range(weight.shape[0] + 1)]
        return torch.cat([x[a:b] @ weight[g] for g, (a, b) in enumerate(zip(bounds, bounds[1:]))])

    def sizes_on_meta(self, start, beside, beside_rows, x, parts, replayed):
        if x.device.type != "meta":
            return sizes(self, start, beside, beside_rows, x, parts, replayed)
        beside.upto(beside_rows)
        return self.even_sizes(x.shape[0], parts)

    def parts_in_steady_state(self, tokens):
        return 1 if self.pairs else parts(self, tokens)  # outside a Pair here, where the run's paired forwards are

    grouped.grouped_mm_unavailable, grouped.loop_grouped_mm = unavailable_on_meta, loop_on_meta
    dispatch = expert_parallel.ExpertDispatch
    dispatch._sizes, dispatch._parts = sizes_on_meta, parts_in_steady_state
    try:
        yield
    finally:
        grouped.grouped_mm_unavailable, grouped.loop_grouped_mm = unavailable, loop
        dispatch._sizes, dispatch._parts = sizes, parts


def _device_total(snapshot: dict, device: str) -> int:
    return sum(stats["Total"] for dev, stats in snapshot.items() if torch.device(dev).type == device)


DIRECT_LAYERS = 8  # deeper stages are measured at 2 and 3 checkpointing periods and extrapolated


def measure_in_depth(run, n_layers: int, period: int, direct_layers: int = DIRECT_LAYERS) -> MicroBatchMemory:
    """`run(n)` measures the stage cut to its first n blocks, checkpointed every `period` blocks.

    Blocks are identical, so every figure grows linearly in the number of checkpointing periods (one
    block, or N blocks for selective:N): a stage deeper than `direct_layers` is measured at 2 and 3
    periods and extrapolated, which keeps the 1T model's 128 layers to a few seconds."""
    if n_layers <= max(direct_layers, 3 * period):
        return run(n_layers)
    return run(2 * period).scaled(run(3 * period), n_layers / period - 2)
