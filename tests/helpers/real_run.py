"""The real side of the estimate's exactness checks: one rank of a gloo run of a layout, built with
the trainer's own functions, one real optimizer step, then the bytes it actually holds.

Without pipelining: the model is parallelized as `trillion train` does, one forward/backward and
an AdamW step; activations are measured on a plain TP + checkpointed copy (FSDP does not change them).
With pipelining: the rank's stages are built as `trillion train` builds them and one real
`train_step` runs the schedule. Right before each stage's gradient reduce-scatter the unsharded
gradients FSDP accumulated and the parameters it still holds gathered are read off its parameters;
the schedule's receive buffers are read off the stages. Activations are the peak of the storages
created during a second step of the same schedule on TP-only stages (the first sets it up).
"""

import contextlib
import json
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from trillion.models import Transformer
from trillion.parallel.activation_checkpoint import apply_activation_checkpointing
from trillion.parallel.parallelize import parallelize
from trillion.parallel.pipeline import Pipeline
from trillion.parallel.tensor_parallel import apply_tensor_parallel, loss_context
from trillion.trainer.assemble import build_model_args, build_parallel_dims, resolve_layout
from trillion.trainer.config.schema import load_config
from trillion.trainer.launch.env import LaunchEnv
from trillion.trainer.optim import build_optimizer
from trillion.trainer.step import train_step
from trillion.trainer.tools.estimate.activations import measure_micro_batch
from trillion.trainer.tools.estimate.dry_run import storage_bytes


def measure_rank(rank: int, world_size: int, overrides: list, out_path: str) -> None:
    config = load_config(None, overrides)
    env = LaunchEnv(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"))
    layout = resolve_layout(config, world_size)
    args = build_model_args(config, 0, layout)
    dims = build_parallel_dims(layout, args, config.training.seq_len, env)
    t = config.training
    micro, count = layout.micro_batch_size, layout.microbatches
    torch.manual_seed(rank)
    tokens = torch.randint(0, args.vocab_size, (count, micro, t.seq_len + 1))
    micro_batches = [(x[:, :-1], x[:, 1:]) for x in tokens]
    record = (_pipeline_rank if dims.pp > 1 else _plain_rank)(config, args, dims, micro_batches)
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(record, f)


def _plain_rank(config, args, dims, micro_batches) -> dict:
    """1. the real layout (TP + AC + FSDP2), one micro-batch and a real AdamW step: parameters, gradients,
    optimizer state"""
    inputs, labels = micro_batches[0]
    with torch.device("meta"):
        model = Transformer(args)
    parallelize(model, dims)
    model.to_empty(device="cpu")
    model.init_weights(0)
    optimizer = build_optimizer(model, config.optimizer, "cpu")
    logits = model(inputs)
    with loss_context(dims.tp_enabled):
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum").backward()
    optimizer.step()
    params = list(model.parameters())
    record = {
        "parameters": storage_bytes(params),
        "gradient_shards": storage_bytes([p.grad for p in params]),
        "optimizer": _optimizer_bytes(optimizer),
    }

    # 2. activations on real tensors: the same TP plan and checkpointing (FSDP does not change them)
    plain = _tp_only(Transformer(args), dims)
    plain.init_weights(0)
    record["activations"] = measure_micro_batch(plain, inputs, labels, dims.tp_enabled, last=True).peak
    return record


def _tp_only(model: nn.Module, dims) -> nn.Module:
    if dims.tp_enabled:
        apply_tensor_parallel(model, dims.tp_mesh)
    apply_activation_checkpointing(model, dims.layout.activation_checkpoint)
    return model


def _optimizer_bytes(optimizer) -> int:
    return storage_bytes([v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)])


def _build_pipeline(config, args, dims, layout) -> Pipeline:
    """This rank's stages as trainer/train.py builds them, materialized and wrapped in the schedule."""
    with torch.device("meta"):
        model = Transformer(args)
    pipeline = Pipeline(model, dims, torch.device("cpu"), parallelize_fn=layout)
    for part in pipeline.parts:
        part.to_empty(device="cpu")
        part.init_weights(config.job.seed)
    pipeline.build()
    return pipeline


def _pipeline_rank(config, args, dims, micro_batches) -> dict:
    pipeline = _build_pipeline(config, args, dims, lambda part: parallelize(part, dims))
    model = pipeline.model
    optimizer = build_optimizer(model, config.optimizer, "cpu")
    held = {"gradient_accumulation": 0, "fsdp_gathered": 0}
    for stage in pipeline.stages:
        stage.perform_reduce_grad = _recording_before(stage.perform_reduce_grad, stage.submod, held)
    record = {}
    optimizer.register_step_pre_hook(
        lambda *_: record.update(
            gradient_shards=storage_bytes([q.grad for q in model.parameters() if q.grad is not None])
        )
    )
    train_step(
        pipeline,
        micro_batches,
        optimizer,
        torch.amp.GradScaler("cpu", enabled=False),
        contextlib.nullcontext(),
        config.training.max_grad_norm,
        dims,
    )
    record.update(
        parameters=storage_bytes(model.parameters()),
        optimizer=_optimizer_bytes(optimizer),
        pipeline_receive=storage_bytes(_receive_buffers(pipeline)),
        **held,
    )

    # activations: the same schedule over TP-only stages, measured in its second step
    tp_pipeline = _build_pipeline(config, args, dims, lambda part: _tp_only(part, dims))
    record["activations"] = _schedule_peak(tp_pipeline, micro_batches)
    return record


def _recording_before(reduce, module: nn.Module, held: dict):
    """`reduce` (a stage's perform_reduce_grad) after adding up what FSDP holds unsharded right before it."""
    from torch.distributed.fsdp import FSDPModule

    def record(*args, **kwargs):
        fsdp_params = [
            fp
            for m in module.modules()
            if isinstance(m, FSDPModule)
            for group in m._get_fsdp_state()._fsdp_param_groups
            for fp in group.fsdp_params
        ]
        held["gradient_accumulation"] += storage_bytes(
            [
                fp.unsharded_accumulated_grad if fp.unsharded_accumulated_grad is not None else fp.unsharded_param.grad
                for fp in fsdp_params
                if fp.unsharded_accumulated_grad is not None or fp.unsharded_param.grad is not None
            ]
        )
        held["fsdp_gathered"] += storage_bytes([fp.unsharded_param for fp in fsdp_params])
        return reduce(*args, **kwargs)

    return record


def _receive_buffers(pipeline: Pipeline) -> list[torch.Tensor]:
    infos = [
        info
        for stage in pipeline.stages
        for recv in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
        for info in recv
    ]
    return [info.buffer for info in infos if info.buffer is not None]


def _schedule_peak(pipeline: Pipeline, micro_batches) -> int:
    """The peak bytes of storages created during a second step of the schedule above what exists
    before it (parameters, any receive buffers the first step kept); weight gradients are dropped as
    they accumulate, as in trainer/tools/estimate/activations.py."""
    tokens = torch.tensor(sum(y.numel() for _, y in micro_batches))
    pipeline.step(micro_batches, tokens)
    params = [q for part in pipeline.parts for q in part.parameters()]
    for q in params:
        q.grad = None
        q.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
    with _LiveBytes(
        [*params, *(b for part in pipeline.parts for b in part.buffers()), *_receive_buffers(pipeline)]
    ) as live:
        pipeline.step(micro_batches, tokens)
    return live.peak


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops create under it while they live, and their peak: MemTracker's
    accounting without its module tracking, whose backward hooks on every module's inputs keep each
    micro-batch's received activation alive through the step (and break split-backward schedules)."""

    def __init__(self, existing):
        super().__init__()
        self.current = self.peak = 0
        self._seen = WeakIdKeyDictionary()  # storage -> its bytes while counted
        for tensor in existing:
            for storage in get_untyped_storages(tensor):
                self._seen[storage] = 0  # there before: a receive writing into it allocates nothing

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                for storage in get_untyped_storages(tensor):
                    self._count(storage)
        return out

    def _count(self, storage) -> None:
        if storage in self._seen or not storage.nbytes():
            return
        self._seen[storage] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, storage.nbytes())

    def _free(self, nbytes: int) -> None:
        self.current -= nbytes
