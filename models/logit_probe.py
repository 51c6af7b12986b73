"""Each attention head's largest pre-softmax logit over a training step, measured beside the attention.

MuonClip (parallel/muon/qk_clip.py) clips the query and key weights of a head whose logits grew past a
threshold; it needs each head's maximum of q . k x softmax_scale over the step. `MaxLogitProbe` wraps an
attention module's `attend` (the callable it runs attention through, models/attention.py and models/mla.py)
and, in a training forward, computes those maxima from the very q and k the backend receives, then calls
the backend unchanged. Context parallelism and tensor parallelism wrap `attend` in turn
(parallel/context_parallel.py, parallel/tensor_parallel.py), so the probe sees this rank's heads and this
rank's query chunks against the keys they attend to: the maxima are this rank's; the clip reduces them over
the ranks that hold other heads and other tokens.

Cost: one more q k^T product per attention forward (no softmax, no PV, no backward: about a sixth of the
attention's training FLOPs), computed in chunks of queries so that it holds at most QUERY_CHUNK_SCORES scores
at a time, O(seq x chunk) per head, never the seq x seq matrix; only when `optimizer.qk_clip` is set. It is
computed apart from the kernel, which keeps its row maxima to itself (kernels/flash_attention_op.py), so every
backend (triton, sdpa, eager) reports the same maxima. A recomputed forward (activation checkpointing) and an
evaluation or generation forward (no gradients) are not measured. Under torch.compile the measurement runs
outside the compiled graph (one graph break per attention).
"""

import re

import torch
from torch import nn

from trillion.models.step_hooks import StepHooks, register_step_hooks

# scores held at once (64 MB in float32): queries per chunk = this / (batch x heads x keys)
QUERY_CHUNK_SCORES = 1 << 24


@torch.no_grad()
def head_max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    document_ids: torch.Tensor | None = None,
):
    """(q_heads,) float32: each head's largest q . k x scale over the batch and the positions the mask keeps. q
    (batch, q_heads, q_len, dim), k (batch, kv_heads, kv_len, dim): query head h reads key head h // (q_heads /
    kv_heads), and a causal mask is aligned to the lower right, as kernels.attention's backends do, and so are
    `document_ids` (batch, kv_len): a query sees only its own document's keys, as the attention does."""
    batch, heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else dim**-0.5
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, q_len, dim)
    keys = k.unsqueeze(2).transpose(-2, -1)  # (batch, kv_heads, 1, dim, kv_len)
    chunk = max(1, QUERY_CHUNK_SCORES // max(1, batch * heads * kv_len))
    best = torch.full((heads,), float("-inf"), dtype=torch.float32, device=q.device)
    for start in range(0, q_len, chunk):
        scores = torch.matmul(grouped[..., start : start + chunk, :], keys).float() * scale
        if causal:
            last_key = torch.arange(start, start + scores.shape[-2], device=q.device) + (kv_len - q_len)
            hidden = torch.arange(kv_len, device=q.device) > last_key[:, None]
            scores = scores.masked_fill(hidden, float("-inf"))
        if document_ids is not None:
            rows = document_ids[:, kv_len - q_len + start : kv_len - q_len + start + scores.shape[-2]]
            other = rows[:, :, None] != document_ids[:, None, :]  # (batch, queries, keys)
            scores = scores.masked_fill(other[:, None, None], float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 3, 4)).flatten())
    return best


class MaxLogitProbe:
    """An attention's `attend`, measuring each of its heads' largest logit of the training forwards since `reset`
    (`running`: (heads on this rank,), -inf before any) before it calls the wrapped `attend`. `step_max`: the last
    optimizer step's maxima over every head of the layer, reduced over the ranks by the clip that set it."""

    def __init__(self, attend):
        self.attend = attend
        self.running: torch.Tensor | None = None
        self.step_max: torch.Tensor | None = None

    def reset(self) -> None:
        self.running = None

    def __call__(self, q, k, v, *, causal: bool = True, softmax_scale: float | None = None, **kwargs):
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:  # not in a recompute, not eval
            self._record(q, k, causal, softmax_scale, kwargs.get("document_ids"))
        return self.attend(q, k, v, causal=causal, softmax_scale=softmax_scale, **kwargs)

    # torch.compiler.disable imports torch._dynamo when applied; this form, on the first call (models/moe.py)
    @torch._disable_dynamo
    def _record(self, q, k, causal, softmax_scale, document_ids) -> None:
        found = head_max_logits(
            q.detach(), k.detach(), causal=causal, softmax_scale=softmax_scale, document_ids=document_ids
        )
        self.running = found if self.running is None else torch.maximum(self.running, found)


def install_probes(model: nn.Module) -> list[str]:
    """Wrap the `attend` of every block's attention of `model` (a whole model on the meta device, before
    parallelize) in a MaxLogitProbe; returns the names of the attention modules that have no `attend` to wrap."""
    missing = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "attention":
            continue
        if not callable(getattr(module, "attend", None)):
            missing.append(name)
            continue
        probe = MaxLogitProbe(module.attend)
        module.attend = module.logit_probe = probe
    return missing


def attention_probes(model: nn.Module) -> dict[int, tuple[nn.Module, MaxLogitProbe]]:
    """{block index: (its attention module, its probe)} of the probed attention `model` holds (a whole model or this
    rank's pipeline stages; a multi-token prediction block numbers after the trunk's), in index order."""
    found = {}
    for name, module in model.named_modules():
        probe = getattr(module, "logit_probe", None)
        if isinstance(probe, MaxLogitProbe):
            found[int(re.search(r"\d+", name).group())] = (module, probe)
    return dict(sorted(found.items()))


class MaxLogitHooks(StepHooks):
    """The probes' share of every step: forget the last step's maxima before the forward; report the clip's."""

    def __init__(self, probes: dict[int, MaxLogitProbe]):
        self.probes = probes

    def before_step(self, token_scale: torch.Tensor) -> None:
        for probe in self.probes.values():
            probe.reset()

    def statistics(self) -> dict:
        """attention/max_logit (the largest over the layers) and attention/max_logit/layer{i} (over that layer's
        heads): the last optimizer step's, before the clip scaled the weights."""
        per_layer = {i: p.step_max.max().item() for i, p in self.probes.items() if p.step_max is not None}
        per_layer = {i: value for i, value in per_layer.items() if value > float("-inf")}  # a layer no forward ran
        if not per_layer:
            return {}
        return {
            "attention/max_logit": max(per_layer.values()),
            **{f"attention/max_logit/layer{i}": value for i, value in per_layer.items()},
        }


@register_step_hooks
def max_logit_hooks(model: nn.Module) -> list[MaxLogitHooks]:
    probes = {index: probe for index, (_, probe) in attention_probes(model).items()}
    return [MaxLogitHooks(probes)] if probes else []
