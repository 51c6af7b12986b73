"""MuonClip's QK-clip (the Kimi K2 report, arXiv 2507.20534, its MuonClip): after each optimizer step, every
attention head whose largest pre-softmax logit in the step passed tau has its query and key weights scaled by
gamma = tau / max logit, so that the same inputs would give it at most tau.

The maxima come from the attention's probes (models/logit_probe.py: this rank's heads, this rank's tokens). One
all-gather over the tp ranks puts the heads together (tensor parallelism splits them in order), one all-reduce
(max) over the ranks that hold other tokens (data-parallel x cp) finishes them; every rank of a pipeline stage
then holds each of its layers' (heads,) maxima.

Which rows make a head's logit is declared by its attention (models/parts: Part.logit_terms): each term is a
query block times a key block. A term whose key block serves one head (multi-head attention, latent attention's
no-position part) scales both by sqrt(gamma), the report's rule; a key block shared by a group of heads
(grouped-query attention) is scaled by sqrt of the group's smallest gamma and each query by gamma over that, so
every head's logit scales by exactly its own gamma and a head below tau keeps its logits; a key every head shares
(latent attention's rotary key) is left alone and the head's query rows take all of gamma, as the report does.
Biases of those rows scale with them. The scaling multiplies this rank's rows of each weight (any sharding:
DTensor's box of the shard), by 1 where nothing passed tau, so no step reads anything on the host.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from trillion.errors import ConfigError
from trillion.models import parts
from trillion.models.args import ModelArgs
from trillion.models.logit_probe import attention_probes
from trillion.models.parts.spec import HeadRows, Part


def attention_part(args: ModelArgs, index: int) -> Part:
    return next(p for p in parts.layer_block(args, index).sublayers if p.heads is not None)


def check_clippable(args: ModelArgs, setting: str) -> None:
    """ConfigError unless every attention of the model declares the rows that make its logits."""
    part = attention_part(args, 0)
    if not part.logit_terms:
        why = part.logit_terms_absent or "its declaration (models/parts) names no query and key rows per head"
        raise ConfigError(
            f"{setting}: this model's attention ({parts.attention_name(args)}) cannot report clippable attention "
            f"logits: {why}. Use --optimizer.qk_clip=0 (QK-clip off) with this model, or a model whose attention "
            "declares its logit terms (grouped-query attention without QK norms, latent attention)."
        )


class QKClip:
    """The clip of `model`'s probed attention (a whole model or this rank's stages), `tau` the threshold; `dims`
    the ParallelDims (its tp group and the ranks holding other tokens)."""

    def __init__(self, model: nn.Module, args: ModelArgs, tau: float, dims):
        self.tau, self.dims, self.layers = tau, dims, []
        self.device = next(model.parameters()).device
        for index, (module, probe) in attention_probes(model).items():
            part = attention_part(args, index)
            linears = {x.name: x for x in part.linears}
            self.layers.append((probe, module, part, linears))

    @torch.no_grad()
    def apply(self) -> None:
        if not self.layers:
            return
        maxima = self._reduced_maxima()
        # past tau: tau / max; at or below it, or -inf (no training forward since the reset): 1
        gamma = torch.where(maxima > self.tau, self.tau / maxima, torch.ones_like(maxima))
        for (probe, module, part, linears), layer_max, layer_gamma in zip(self.layers, maxima, gamma):
            probe.step_max = layer_max
            scales = {}
            for term in part.logit_terms:
                query, key = self._term_scales(term.query, term.key, layer_gamma, linears)
                scales.setdefault(term.query.linear, []).append((term.query, query))
                if term.key is not None:
                    scales.setdefault(term.key.linear, []).append((term.key, key))
            for name, blocks in scales.items():
                rows = torch.ones(linears[name].out_features, device=layer_gamma.device)
                for where, factor in blocks:
                    view = rows.view(-1, where.stride)[:, where.offset : where.offset + where.width]
                    view.mul_(factor.view(-1, 1))
                linear = module.get_submodule(name.split(".", 1)[1])
                for tensor in (linear.weight, linear.bias):
                    if tensor is not None:
                        _scale_rows(tensor, rows)

    def _term_scales(self, query: HeadRows, key: HeadRows | None, gamma: torch.Tensor, linears: dict):
        """(per query block, per key block) factors of one term: each head's logit times its gamma."""
        if key is None:
            return gamma, None
        groups = linears[key.linear].out_features // key.stride
        key_factor = gamma.view(groups, -1).amin(dim=1).sqrt()
        return gamma / key_factor.repeat_interleave(gamma.numel() // groups), key_factor

    def _reduced_maxima(self) -> torch.Tensor:
        """(layers, heads): every head's step maximum over this stage's ranks."""
        local = torch.stack(
            [
                probe.running
                if probe.running is not None
                else torch.full((part.heads.heads // self.dims.tp,), float("-inf"), device=self.device)
                for probe, _, part, _ in self.layers
            ]
        ).float()
        tp_mesh = self.dims.tp_mesh
        if tp_mesh is not None:
            gathered = local.new_empty(tp_mesh.size() * local.shape[0], local.shape[1])
            dist.all_gather_into_tensor(gathered, local, group=tp_mesh.get_group())
            local = gathered.view(tp_mesh.size(), *local.shape).permute(1, 0, 2).reshape(local.shape[0], -1)
        return self.dims.all_reduce_dp(local.contiguous(), op=dist.ReduceOp.MAX)


def _scale_rows(tensor: torch.Tensor, rows: torch.Tensor) -> None:
    """tensor (rows first, any sharding) x rows[i] on each of its rows, in place on this rank's shard."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if isinstance(tensor, DTensor):
        _, start = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        rows = rows[start[0] : start[0] + local.shape[0]]
    local.mul_(rows.to(local.dtype).view(-1, *([1] * (local.ndim - 1))))
