"""Context parallelism: the cp ranks of a group each hold 1/cp of every sequence, which divides the
activation memory of long sequences (no other dimension does).

Load balance: the sequence is cut into 2 cp chunks and rank r holds chunks r and 2 cp - 1 - r (a
head chunk and the matching tail chunk), so under causal attention every rank gets the same number
of query-key pairs instead of the first rank the cheapest rows and the last the most expensive.
The rank's tokens carry their global positions into RoPE and GPT's learned positions (a forward
pre-hook on the model passes them, so the model itself stays layout-agnostic); labels are sharded
the same way, so the loss, its token count (summed over data-parallel x cp ranks) and its
normalization are those of the whole sequence.

Attention across shards, by all-gather of K/V: each layer gathers the cp ranks' keys and values
(a functional all-gather with autograd; its backward reduce-scatters dK/dV back to their owners),
restores the global order, and each of the rank's two query chunks attends, with the ordinary
lower-right-aligned causal mask, to the key prefix that ends where the chunk ends. Any attention
backend then runs unchanged (the Triton kernel, SDPA, eager), forward and backward, and nothing
needs log-sum-exp merging. Why all-gather rather than a ring: docs/parallelism.md, "Context parallelism".
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed._functional_collectives import all_gather_single

from trillion.errors import ConfigError
from trillion.kernels import attention
from trillion.parallel.forward_backward import map_tensors


def check_sequence(cp: int, tp: int, seq_len: int) -> None:
    """ConfigError unless training.seq_len splits into 2 cp chunks and each rank's share over tp."""
    unit = 2 * cp * tp
    if cp == 1 or seq_len % unit == 0:
        return
    fix = f"Use a sequence length divisible by {unit} (e.g. --training.seq_len={max(unit, seq_len // unit * unit)})"
    if seq_len % (2 * cp):
        raise ConfigError(
            f"training.seq_len={seq_len} does not split into 2 x parallel.cp={cp} equal chunks; context "
            f"parallelism gives each rank a head chunk and a tail chunk of every sequence. {fix} or "
            f"another cp."
        )
    raise ConfigError(
        f"training.seq_len={seq_len} / parallel.cp={cp} = {seq_len // cp} tokens per rank is not "
        f"divisible by parallel.tp={tp} (sequence parallelism splits them). {fix}."
    )


def chunks_of(rank: int, cp: int) -> tuple[int, int]:
    """The two of 2 cp chunks that cp rank `rank` holds: a head chunk and the matching tail chunk."""
    return rank, 2 * cp - 1 - rank


def positions_of(seq_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """Global positions (seq_len / cp,) of the tokens cp rank `rank` holds of a seq_len sequence."""
    size = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in chunks_of(rank, cp)])


def shard_sequence(tensor: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """cp rank `rank`'s share of `tensor` along its sequence dimension `dim` (length divisible by 2 cp)."""
    if cp == 1:
        return tensor
    pieces = tensor.chunk(2 * cp, dim=dim)
    return torch.cat([pieces[c] for c in chunks_of(rank, cp)], dim=dim)


def shard_batch(micro_batches: list, cp_mesh) -> list:
    """This cp rank's share of every (inputs, labels) micro-batch (and of its positions); unchanged without
    context parallelism. Labels follow their inputs, so the loss counts each target token on exactly one cp
    rank. Document ids stay whole: the rank's queries are masked against every key's document."""
    if cp_mesh is None:
        return micro_batches
    rank, cp = cp_mesh.get_local_rank(), cp_mesh.size()
    return [map_tensors(mb, lambda t: shard_sequence(t, rank, cp), whole=lambda ids: ids) for mb in micro_batches]


def _gather_sequence(t: torch.Tensor, group, rank_count: int) -> torch.Tensor:
    """(b, h, s / cp, d) shards of every cp rank -> (b, h, s, d) in the sequence's own order (one copy
    beyond the gathered buffer)."""
    batch, heads, local, dim = t.shape
    gathered = all_gather_single(t.contiguous(), 0, group).view(rank_count, batch, heads, 2, local // 2, dim)
    # rank j holds chunks j (half 0) and 2 cp - 1 - j (half 1)
    order = [gathered[j, :, :, 0] for j in range(rank_count)] + [
        gathered[j, :, :, 1] for j in reversed(range(rank_count))
    ]
    return torch.cat(order, dim=2)


def attention_across_shards(
    q,
    k,
    v,
    *,
    group,
    rank: int,
    cp: int,
    impl: str = "sdpa",
    causal: bool = True,
    softmax_scale: float | None = None,
    attend=attention,
    document_ids=None,
) -> torch.Tensor:
    """Attention of this cp rank's queries (b, hq, s / cp, d), in the load-balanced layout, over the
    keys and values of the whole sequence, whose shards k, v (b, hkv, s / cp, d) every cp rank holds;
    each query chunk's attention through `attend` (kernels.attention, or what the module ran it through).
    `document_ids` (b, s): the whole sequence's, so each query chunk is masked by global positions."""
    k_all, v_all = _gather_sequence(k, group, cp), _gather_sequence(v, group, cp)
    if not causal:
        if document_ids is not None:  # the chunks' queries against every key, masked by their own documents
            raise NotImplementedError("context parallelism masks documents under causal attention only")
        return attend(q, k_all, v_all, impl=impl, causal=False, softmax_scale=softmax_scale)
    size = q.shape[2] // 2
    outs = []
    for chunk, q_chunk in zip(chunks_of(rank, cp), q.split(size, dim=2)):
        end = (chunk + 1) * size  # lower-right alignment: the chunk's last query sees the prefix's last key
        ids = None if document_ids is None else document_ids[:, :end]  # the chunk is the prefix's last positions
        outs.append(
            attend(
                q_chunk,
                k_all[:, :, :end],
                v_all[:, :, :end],
                impl=impl,
                causal=True,
                softmax_scale=softmax_scale,
                document_ids=ids,
            )
        )
    return torch.cat(outs, dim=2)


class _AcrossShards:
    """The `attend` of each attention module under context parallelism (the model calls it like
    kernels.attention); each chunk's attention runs through the module's own `attend` it replaced (a
    measuring wrapper keeps measuring: models/logit_probe.py)."""

    def __init__(self, group, rank: int, cp: int, attend=attention):
        self.group, self.rank, self.cp, self.attend = group, rank, cp, attend

    def __call__(self, q, k, v, *, impl: str = "sdpa", causal: bool = True, softmax_scale=None, document_ids=None):
        return attention_across_shards(
            q,
            k,
            v,
            group=self.group,
            rank=self.rank,
            cp=self.cp,
            impl=impl,
            causal=causal,
            softmax_scale=softmax_scale,
            attend=self.attend,
            document_ids=document_ids,
        )


def apply_context_parallel(model: nn.Module, cp_mesh) -> None:
    """Make `model` (a Transformer, or a pipeline stage of one) run on this cp rank's share of each
    sequence: attention across the cp group's shards and the global positions of the rank's tokens."""
    rank, cp, group = cp_mesh.get_local_rank(), cp_mesh.size(), cp_mesh.get_group()

    def pass_positions(_module, args, kwargs):
        if kwargs.get("positions") is None:  # a stage's input is the hidden state: its dim 1 is the sequence
            tokens = args[0] if args else kwargs["tokens"]
            kwargs["positions"] = positions_of(tokens.shape[1] * cp, rank, cp, device=tokens.device)
        return args, kwargs

    model.register_forward_pre_hook(pass_positions, with_kwargs=True)
    for block in model.blocks().values():
        block.attention.attend = _AcrossShards(group, rank, cp, block.attention.attend)
    split_sequences(model, group, cp)


def split_sequences(model: nn.Module, group, count: int) -> None:
    """Tell the parts with per-sequence statistics (models/moe.py SequenceShards) that `count` ranks, `group`, hold the
    positions of their sequences (context parallelism's cp; cp x tp where ep folds over the tp ranks)."""
    shards = _SequenceShards(group, count)
    for module in model.modules():
        if hasattr(module, "sequence_shards"):
            module.sequence_shards = shards


class _SequenceShards:
    """The cp group as the holders of every sequence's other positions: a per-sequence statistic is summed over
    it (models/moe.py, DeepSeek-V3's sequence-wise balance loss), its gradient summed back the same way."""

    def __init__(self, group, count: int):
        self.group, self.count = group, count

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return _SumOverGroup.apply(tensor, self.group)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward; the gradient of every rank's sum reaches each rank's input: all-reduce again."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return funcol.wait_tensor(funcol.all_reduce(tensor.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None
