"""The kernels as PyTorch ops: torch.compile traces them whole, DTensor runs them shard-local."""

import pytest
import torch
import torch.distributed as dist

from trillion.kernels.flash_attention_op import flash_attention
from trillion.kernels.norm import RMSNorm, layer_norm, rms_norm


class _TinyBlock(torch.nn.Module):
    """Pre-norm attention with grouped-query heads, built on the two kernels."""

    def __init__(self, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm = RMSNorm(dim, eps=1e-5)
        self.wq = torch.nn.Linear(dim, dim)
        self.wkv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.wo = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm(x)
        q = self.wq(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.wkv(h).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        out = flash_attention(q, k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return x + self.wo(out.transpose(1, 2).reshape(b, s, -1))


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    block = _TinyBlock()
    with torch.no_grad():
        block.norm.weight.normal_()
    x = torch.randn(2, 40, 64)
    compiled = torch.compile(block, fullgraph=True)  # fails on any graph break
    out_c = compiled(x)
    out_c.square().sum().backward()
    grads_c = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    out_e = block(x)
    out_e.square().sum().backward()
    torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
    for gc, p in zip(grads_c, block.parameters()):
        torch.testing.assert_close(gc, p.grad, atol=1e-4, rtol=1e-4)


@pytest.fixture
def fake_mesh_of_two():
    """A 2-rank mesh in this one process, on the fake process group: collectives do nothing,
    so only shard-local results can be checked, which is all a local op needs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_dtensor_head_sharded_attention_runs_on_the_local_shard(fake_mesh_of_two):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = fake_mesh_of_two
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 24, 16, generator=gen) for h in (2, 1, 1))  # this rank's heads

    def local_grads(k_placement):
        leaves = [
            DTensor.from_local(q, mesh, [Shard(1)]).requires_grad_(),
            DTensor.from_local(k, mesh, [k_placement]).requires_grad_(),
            DTensor.from_local(v, mesh, [k_placement]).requires_grad_(),
        ]
        out = flash_attention(*leaves)
        out.sum().backward()
        return out, leaves

    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = flash_attention(*plain)
    expected.sum().backward()
    # Tensor parallel GQA: q and kv heads both sharded; MQA: the one kv head replicated.
    for kv_placement, kv_grad_placement in ((Shard(1), Shard(1)), (Replicate(), Partial())):
        out, leaves = local_grads(kv_placement)
        assert out.placements == (Shard(1),)
        torch.testing.assert_close(out.to_local(), expected)
        for leaf, ref in zip(leaves, plain):
            torch.testing.assert_close(leaf.grad.to_local(), ref.grad)
        assert leaves[1].grad.placements == (kv_grad_placement,)


def test_dtensor_sharded_attention_takes_document_ids(fake_mesh_of_two):
    """Document ids have no head dim: replicated beside head-sharded q, k, v; sharded with the batch."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = fake_mesh_of_two
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 24, 16, generator=gen) for h in (2, 1, 1))
    ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    expected = flash_attention(q, k, v, document_ids=ids)
    for qkv, placed_ids in ((Shard(1), Replicate()), (Shard(0), Shard(0))):
        leaves = [DTensor.from_local(t, mesh, [qkv]) for t in (q, k, v)]
        out = flash_attention(*leaves, document_ids=DTensor.from_local(ids, mesh, [placed_ids]))
        assert out.placements == (qkv,)
        torch.testing.assert_close(out.to_local(), expected)


def test_dtensor_sequence_sharded_norms_run_on_the_local_shard(fake_mesh_of_two):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = fake_mesh_of_two
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 12, 32, generator=gen), torch.randn(32, generator=gen), torch.randn(32, generator=gen)
    for fn, params in ((rms_norm, (w,)), (layer_norm, (w, b))):
        dx = DTensor.from_local(x, mesh, [Shard(1)]).requires_grad_()
        dparams = [DTensor.from_local(p, mesh, [Replicate()]).requires_grad_() for p in params]
        y = fn(dx, *dparams, eps=1e-5)
        y.sum().backward()
        plain = [t.clone().requires_grad_() for t in (x, *params)]
        expected = fn(*plain, eps=1e-5)
        expected.sum().backward()
        assert y.placements == (Shard(1),) and dx.grad.placements == (Shard(1),)
        torch.testing.assert_close(y.to_local(), expected)
        torch.testing.assert_close(dx.grad.to_local(), plain[0].grad)
        for dp, p in zip(dparams, plain[1:]):
            assert dp.grad.placements == (Partial(),)
            torch.testing.assert_close(dp.grad.to_local(), p.grad)


@pytest.mark.parametrize("mode, runs_per_block", [("selective:op", 1), ("full", 2)])
def test_op_level_checkpointing_keeps_our_attention(mode, runs_per_block):
    """selective:op saves the Triton attention's outputs like SDPA's: its forward runs once per
    block (the HFU accounting assumes so); full checkpointing, the control, runs it again in backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from trillion.parallel.activation_checkpoint import apply_activation_checkpointing

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func is torch.ops.trillion.flash_attn_fwd.default
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({str(i): _TinyBlock() for i in range(2)})
    apply_activation_checkpointing(model, mode)
    x = torch.randn(1, 24, 64, requires_grad=True)
    with Count():
        h = x
        for block in model.layers.values():
            h = block(h)
        h.square().sum().backward()
    assert Count.calls == 2 * runs_per_block
