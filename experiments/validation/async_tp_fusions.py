"""Which of a tensor-parallel block's collectives torch's async TP can fuse with a GEMM, as torch's own pass sees them.

Inductor's micro-pipeline TP pass (torch/_inductor/fx_passes/micro_pipeline_tp.py) replaces an all-gather whose
output feeds GEMMs, and a reduce-scatter whose input one GEMM produces, by symmetric-memory ops that run the
collective beside the GEMM; anything else stays an exposed collective. This script builds the block torchtitan's
Llama 3 rows ran (its TP plan at 9dec370: PrepareModuleInput, ColwiseParallel wq/wk/wv and w1/w3, RowwiseParallel
wo and w2 to Shard(1), SequenceParallel norms; with float8, torchao's float8 styles), compiles it on a fake process
group of 2 on the CPU, and runs the pass's own matchers (find_all_gather_patterns, find_reduce_scatter_patterns,
_find_consumer_matmuls, _find_producer_matmul) on the post-grad forward and backward graphs. Every op the backward
can recompute is recomputed (the partitioner's activation_memory_budget = 0), standing in for full activation
checkpointing, whose checkpoint wrapper this torch cannot compile around DTensor on the CPU (it saves a DeviceMesh).

    python experiments/validation/async_tp_fusions.py      # about a minute on 2 cores
"""

import subprocess
import sys

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._inductor.fx_passes import micro_pipeline_tp as pass_
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor import parallel as tp_styles
from torch.testing._internal.distributed.fake_pg import FakeStore

DIM, HEADS, HIDDEN, SEQ, BATCH = 256, 4, 512, 64, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """A Llama block with torchtitan's module names: separate wq, wk, wv and w1, w3, as Trillion's models too."""

    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def parallel_block(mesh, float8: bool) -> nn.Module:
    """The block under torchtitan's TP plan (parallelize_llama.py apply_tp), float8 as torchao's styles run it."""
    block = Block()
    colwise, rowwise, prepare = tp_styles.ColwiseParallel, tp_styles.RowwiseParallel, tp_styles.PrepareModuleInput
    if float8:
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel as colwise,
        )
        from torchao.float8.float8_tensor_parallel import (
            Float8RowwiseParallel as rowwise,
        )
        from torchao.float8.float8_tensor_parallel import (
            PrepareFloat8ModuleInput as prepare,
        )

        convert_to_float8_training(block)
    gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
    plan = {"attention_norm": tp_styles.SequenceParallel(), "ffn_norm": tp_styles.SequenceParallel()}
    plan |= {"attention": prepare(**gather), "feed_forward": prepare(**gather)}
    plan |= {f"attention.{w}": colwise() for w in ("wq", "wk", "wv")}
    plan |= {f"feed_forward.{w}": colwise() for w in ("w1", "w3")}
    plan |= {"attention.wo": rowwise(output_layouts=Shard(1)), "feed_forward.w2": rowwise(output_layouts=Shard(1))}
    return tp_styles.parallelize_module(block, mesh, plan)


def report(graph: torch.fx.Graph) -> None:
    """Each collective of a post-grad graph, with whether the pass finds the GEMM it would fuse it with."""
    print(f"  {'backward' if pass_._is_backward(graph) else 'forward'} graph")
    for gather in pass_.find_all_gather_patterns(graph):
        gemms = pass_._find_consumer_matmuls(gather.res_node)
        dtype = pass_._get_tensor(gather.shard_node).dtype
        print(f"    all-gather ({dtype}): {len(gemms)} GEMM(s) read it -> {'fusable' if gemms else 'EXPOSED'}")
    for scatter in pass_.find_reduce_scatter_patterns(graph):
        producer = scatter.input_node
        gemm = pass_._find_producer_matmul(producer)
        made_by = getattr(producer.target, "__name__", str(producer.target))
        print(f"    reduce-scatter of {made_by}: {'a GEMM -> fusable' if gemm else 'no GEMM -> EXPOSED'}")


def check(float8: bool) -> None:
    """One compiled forward and backward of the block, its graphs reported as they are compiled."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    functorch_config.activation_memory_budget = 0.0
    inductor_config.post_grad_custom_post_pass = report
    print("float8 (tensorwise, torchao's float8 TP styles)" if float8 else "no float8 (DTensor's TP styles)")
    block = torch.compile(parallel_block(init_device_mesh("cpu", (2,)), float8), fullgraph=True)
    x = torch.randn(BATCH, SEQ // 2, DIM, requires_grad=True)  # this rank's part of the sequence
    block(x).sum().backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:] == ["--float8"]:
        check(float8=True)
    else:  # each precision in a process of its own: a compiled DTensor block keeps its mesh for the process
        print(f"torch {torch.__version__}, tp 2, every recomputable op recomputed in the backward", flush=True)
        check(float8=False)
        subprocess.run([sys.executable, __file__, "--float8"], check=True)
