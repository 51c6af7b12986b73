"""FSDP2 (`fully_shard`) per transformer block, then the root, with the paper's ZeRO stages as modes.

Every mode keeps the optimizer state and the fp32 master parameters sharded over dp_shard (they
are the bulk of the memory: 12-16 bytes per parameter). What differs is what stays gathered
between uses, traded against communication, per optimizer step of M micro-batches:

The modes' rules are the table in modes.py (ZERO_MODES); what they cost, per dp_shard_mode:

- zero3: parameters resharded after forward and after backward; gradients reduce-scattered every
  micro-batch; communication per step: 2 all-gathers + 1 reduce-scatter per micro-batch.
- zero2: parameters kept gathered from forward to backward, and across micro-batches until the
  last; gradients reduce-scattered every micro-batch (sharded gradient accumulates);
  communication per step: 1 all-gather per step + 1 reduce-scatter per micro-batch.
- zero1: parameters kept gathered for the whole step; gradients accumulated unsharded,
  reduce-scattered once on the last micro-batch; communication per step: 1 all-gather + 1
  reduce-scatter per step.

zero3 holds 1/dp_shard of the parameters outside a block's use; zero2 and zero1 hold the full
parameters (in compute dtype) through the step, and zero1 also the full gradients. With one
micro-batch per step zero1 and zero2 are the same. `set_micro_batch` applies the per-micro-batch
part; the trainer calls it before each forward.

dp_replicate > 1 gives HSDP: shards within a dp_shard group, replicas across groups (an extra
all-reduce of the sharded gradients). Gradients are summed, not averaged, over data-parallel
ranks: the loss is already normalized by the token count of the global batch.

Expert parallelism: the routed experts of a block, DTensors on the ep mesh (with parallel.etp = tp on the 2-D
(ep, etp) one), are an FSDP group of their own over `expert_mesh` (ParallelDims.expert_fsdp_mesh: the
data-parallel ranks ep leaves, folded over tp or not; HSDP when 2-D), wrapped before their block, which then
leaves them alone; each ep rank's experts are sharded on the expert dimension, or on the next one when there are
fewer local experts than shards.

Mixed precision: parameters are gathered in the compute dtype (bf16 on GPUs) and gradients are
reduced in fp32; on CPU everything is fp32.
"""

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from trillion.parallel.expert_parallel import expert_parallel_modules
from trillion.parallel.modes import zero_mode


def apply_fsdp(
    model: nn.Module,
    fsdp_mesh,
    mode: str,
    param_dtype: torch.dtype = torch.float32,
    *,
    keep_gathered_after_forward: bool = False,
    expert_mesh=None,
) -> None:
    """`keep_gathered_after_forward`: no block reshards after forward whatever the mode (pipeline
    stages under split-backward schedules, see pipeline.py). `expert_mesh`: the routed experts' (ep > 1)."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    reshard_after_forward = zero_mode(mode).reshard_after_forward and not keep_gathered_after_forward
    for block in model.units():  # each block, and each multi-token prediction module like a block
        for experts in expert_parallel_modules(block) if expert_mesh is not None else ():
            fully_shard(
                experts,
                mesh=expert_mesh,
                mp_policy=policy,
                reshard_after_forward=reshard_after_forward,
                shard_placement_fn=_expert_placement(expert_mesh.size(expert_mesh.ndim - 1)),
            )
        fully_shard(block, mesh=fsdp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # The root holds embeddings, final norm and output; its parameters are needed first in backward,
    # so it is never resharded after forward.
    fully_shard(model, mesh=fsdp_mesh, mp_policy=policy, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum over ranks; the loss carries the 1/tokens
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)


def _expert_placement(shards: int):
    """Each ep rank's experts sharded on the expert dimension, or on the next when too few to split evenly."""
    return lambda param: Shard(0) if param.to_local().shape[0] % shards == 0 else Shard(1)


def set_micro_batch(model: nn.Module, mode: str, is_last: bool) -> None:
    """Before each micro-batch's forward: what to keep gathered and whether to reduce gradients."""
    zero = zero_mode(mode)
    if not isinstance(model, FSDPModule) or not zero.gathered_across_microbatches:
        return
    model.set_reshard_after_backward(is_last, recurse=True)
    if not zero.sync_every_microbatch:
        model.set_requires_gradient_sync(is_last, recurse=True)
