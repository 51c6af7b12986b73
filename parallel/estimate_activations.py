"""The activation peak of one micro-batch, measured by PyTorch's MemTracker: on meta tensors for the
estimate (parallel/estimate.py), on real tensors for the checks against it (tests/estimate).

The model given is already tensor-parallel and activation-checkpointed, without FSDP: FSDP changes
where parameters live, not what forward and backward keep.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch import nn


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def measure_activations(model: nn.Module, vocab_size: int, micro_batch: int, seq_len: int, tp_enabled: bool,
                        device: str = "meta") -> tuple[int, int]:
    """Peak bytes above parameters and buffers during one micro-batch's forward and backward, tracked
    by MemTracker. Weight gradients are dropped once accumulated (FSDP reduce-scatters and frees
    them; the kept shards are counted as gradients), so the figure is activations, their gradients
    and the temporaries of backward. Also returns the elements of the weight gradients' storages as
    autograd made them (under TP alone a vocabulary-parallel embedding gets a replicated, whole-table
    gradient: DTensor's embedding backward does not keep the shard)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from parallel.tensor_parallel import loss_context

    grad_elements = {}

    def drop(param):
        local = local_tensor(param.grad)
        grad_elements[id(param)] = local.untyped_storage().nbytes() // local.element_size()
        param.grad = None

    handles = [p.register_post_accumulate_grad_hook(drop) for p in model.parameters() if p.requires_grad]
    tokens = torch.randint(0, vocab_size, (micro_batch, seq_len + 1), device=device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    tracker = MemTracker()
    tracker.track_external(model)
    try:
        with tracker, _flash_on_meta(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable")  # MemTracker on grad=None
            base = _device_total(tracker.get_tracker_snapshot("current"), device)
            logits = model(inputs)
            with loss_context(tp_enabled):
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
                loss.backward()
            del logits, loss
            peak = _device_total(tracker.get_tracker_snapshot("peak"), device)
    finally:
        for handle in handles:
            handle.remove()
    return int(peak - base), sum(grad_elements.values())


@contextlib.contextmanager
def _flash_on_meta():
    """On meta tensors SDPA falls back to its math path, which saves the seq x seq score matrix; a GPU
    (flash / memory-efficient SDPA, our Triton kernel) and the CPU (flash for CPU) save only the output
    and an fp32 log-sum-exp per query and head. While measuring, SDPA on meta tensors runs the flash op,
    whose meta kernel has exactly those outputs. A patch of the function rather than a TorchFunctionMode:
    modes are thread-local and checkpoint recomputation runs on autograd's thread."""
    plain = F.scaled_dot_product_attention

    def flash(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.device.type != "meta" or attn_mask is not None or dropout_p:
            return plain(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa)
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[0]

    F.scaled_dot_product_attention = flash
    try:
        yield
    finally:
        F.scaled_dot_product_attention = plain


def _device_total(snapshot: dict, device: str) -> int:
    return sum(stats["Total"] for dev, stats in snapshot.items() if torch.device(dev).type == device)



DIRECT_LAYERS = 8  # deeper models are measured at 2 and 3 checkpointing periods and extrapolated


def measure_stage_activations(build, n_layers: int, period: int, vocab_size: int, micro_batch: int, seq_len: int,
                              tp_enabled: bool, direct_layers: int = DIRECT_LAYERS) -> tuple[int, int]:
    """(activation peak, weight-gradient elements) of one micro-batch through a model of `n_layers`
    blocks, checkpointed every `period` blocks; `build(n)` gives that model with n blocks.

    Blocks are identical, so the peak grows linearly in the number of checkpointing periods (one
    block, or N blocks for selective:N): a model deeper than `direct_layers` is measured at 2 and 3
    periods and extrapolated, which keeps the 1T model's 128 layers to a few seconds."""

    def run(n: int) -> tuple[int, int]:
        return measure_activations(build(n), vocab_size, micro_batch, seq_len, tp_enabled)

    if n_layers <= max(direct_layers, 3 * period):
        return run(n_layers)
    (a, ga), (b, gb) = run(2 * period), run(3 * period)
    periods = n_layers / period
    return int(round(a + (periods - 2) * (b - a))), int(round(ga + (periods - 2) * (gb - ga)))
