"""The one place a meta-device model becomes a parallel one, in a fixed order:

    float8 swap -> context parallelism -> tensor parallelism -> expert parallelism -> deferred weight
    gradients -> activation checkpointing -> torch.compile -> FSDP2

The float8 swap first (float8.py): it replaces the blocks' nn.Linear modules by torchao's Float8Linear
(and gives the routed experts their float8 grouped product, float8_experts.py; float8 dispatch,
float8_dispatch.py, is the wire expert parallelism's rows travel in), which TP then shards with float8-aware
styles and FSDP gathers in float8; everything after must see the swapped modules (torchtitan's order). CP
next: it only swaps each block's attention for attention across sequence shards and passes the rank's
token positions, so everything after wraps the same modules. TP next, because it changes what a parameter
is (a DTensor over the tp axis) and inserts the collectives the later wrappers must see (an MoE layer's by
parallel.etp: folded over tp or its experts split over it, expert_tensor_parallel.py); expert parallelism next
(expert_parallel.py: the routed experts become DTensors on the ep mesh, whole on their rank or split over etp, and
the dispatch all-to-alls; the shared experts and attention keep TP's layout); deferred weight gradients next
(parallel.defer_weight_grads, deferred_weight_grads.py), once float8 and TP have decided which products are plain
ones; AC next, so
recomputation replays those collectives; compile then traces the parallel blocks (with async TP after symmetric
memory and Inductor's pass that fuses TP's collectives with their GEMMs are on: async_tp.py); FSDP last, so it shards
the TP shards again over dp and its hooks wrap everything (the routed experts under ep apart, over the
data-parallel ranks ep leaves). Call it before `to_empty` + `init_weights`, which then give the same
values whatever the layout (see models.transformer.Transformer.init_weights)."""

import dataclasses

import torch
from torch import nn

from trillion.errors import ConfigError
from trillion.parallel import async_tp
from trillion.parallel.activation_checkpoint import apply_activation_checkpointing
from trillion.parallel.compile import apply_compile
from trillion.parallel.context_parallel import apply_context_parallel, split_sequences
from trillion.parallel.deferred_weight_grads import defer_weight_grads
from trillion.parallel.dims import ParallelDims
from trillion.parallel.ep_routing import Payload
from trillion.parallel.expert_overlap import apply_pairing_gates, pairs_micro_batches
from trillion.parallel.expert_parallel import apply_expert_parallel, cache_routes_for_recompute, expert_dispatches
from trillion.parallel.expert_tensor_parallel import sum_expert_gradients
from trillion.parallel.float8 import convert as convert_to_float8
from trillion.parallel.float8_dispatch import Float8Wire
from trillion.parallel.fsdp import apply_fsdp
from trillion.parallel.modes import checkpointed_blocks, pairs_across_stages, schedule, zero_mode
from trillion.parallel.tensor_parallel import apply_tensor_parallel


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    *,
    param_dtype: torch.dtype = torch.float32,
    fsdp: bool = True,
    compile_backend: str = "inductor",
) -> nn.Module:
    """Apply the layout of `dims` (whose mesh is built) to `model`, in place; returns it. Every setting comes from
    `dims.layout`: with pp > 1 `model` is a pipeline stage of its schedule, under one that splits the backward no
    block reshards after forward (pipeline.py says why); `float8` trains the linears in float8. `fsdp=False`:
    everything but FSDP2 (what `trillion estimate` measures activations on: FSDP changes none of them)."""
    layout = dims.layout
    zero_mode(layout.dp_shard_mode)
    ep_mesh = dims.ep_mesh
    float8 = layout.float8
    if float8 is not None and not (fsdp and dims.fsdp_enabled):  # no FSDP2 here: nothing gathers in float8
        float8 = dataclasses.replace(float8, fsdp_all_gather=False)
    if float8 is not None:
        convert_to_float8(model, float8, tp=dims.tp_mesh.size() if dims.tp_enabled else 1)
    if dims.cp > 1:
        apply_context_parallel(model, dims.cp_mesh)
    if dims.tp_enabled:
        apply_tensor_parallel(
            model,
            dims.tp_mesh,
            float8_tp=float8 is not None and float8.float8_tp,
            expert_parallel=ep_mesh is not None,
            folded=layout.folded,
            overlap_chunks=layout.tp_overlap,
        )
    if layout.folded:  # each tp rank routes its own positions of the sequences
        split_sequences(model, dims.routed_sequence_group, dims.cp * dims.tp)
    if ep_mesh is not None:
        wire = Float8Wire(float8.experts, float8.emulate) if float8 and float8.dispatch else None
        payload = Payload(wire=wire, gradient_wire=wire if wire and float8.combine_gradient else None)
        mode, ranks_per_node = layout.ep_dispatch, layout.ranks_per_node
        apply_expert_parallel(model, ep_mesh, mode, ranks_per_node, dims.ep_node_mesh, payload, dims.expert_tp_mesh)
        pairs = pairs_across_stages(layout) or pairs_micro_batches(layout)
        for dispatch in expert_dispatches(model):  # parallel.ep_overlap: beside what, expert_overlap.py
            dispatch.overlap, dispatch.pairs = layout.ep_overlap, pairs
    if dims.tp_enabled and layout.expert_tp > 1:  # the experts split over tp: their gradients are partial sums
        sum_expert_gradients(model, dims.tp_mesh)
    if layout.defer_weight_grads:  # after float8 and tp, which decide what defers; the stage runs the queue
        model.weight_grad_queue = defer_weight_grads(model)
    apply_activation_checkpointing(model, layout.activation_checkpoint)
    if ep_mesh is not None:
        blocks = list(model.layers.values())
        for index in checkpointed_blocks(layout.activation_checkpoint, len(blocks)):
            cache_routes_for_recompute(blocks[index])
    if layout.async_tp and dims.tp_enabled:
        _enable_async_tp(dims, layout.compile, compile_backend)
    if layout.compile:
        apply_compile(model, backend=compile_backend)
    if fsdp and dims.fsdp_enabled:
        split_backward = dims.pp > 1 and schedule(layout.pp_schedule).split_backward
        apply_fsdp(
            model,
            dims.fsdp_mesh,
            layout.dp_shard_mode,
            param_dtype,
            # paired across stages too: resharded after a paired forward, the routed experts' weights were not
            # gathered again before a later backward read them (the zero3 case of tests/pipeline/
            # test_interleaved_pairing.py; inside FSDP2's hooks, not traced)
            keep_gathered_after_forward=split_backward or pairs_across_stages(layout),
            expert_mesh=dims.expert_fsdp_mesh if ep_mesh is not None else None,
        )
    if layout.ep_overlap and dims.pp == 1:
        apply_pairing_gates(model)  # last, outside every other hook (FSDP's); harmless while nothing pairs
    return model


def _enable_async_tp(dims: ParallelDims, compile: bool, compile_backend: str) -> None:
    """Async TP for the blocks compiled next: a pass of Inductor's, so it needs compile with that backend."""
    if not compile or compile_backend != "inductor":
        raise ConfigError(
            "parallel.async_tp=true is a pass of torch.compile's Inductor backend, but the blocks are "
            f"{'compiled with ' + compile_backend if compile else 'not compiled'}. Compile them with Inductor "
            f"(--compile.enabled=true), or drop parallel.async_tp. {async_tp.FALLBACK}"
        )
    async_tp.enable(dims.tp_mesh)
