"""The Triton grouped GEMM (kernels/grouped_gemm_op.py) on CPU through the Triton interpreter, against a
float64 reference written row by row (each row times its group's weight, found by a search over the
offsets), forward and both gradients; and `kernels.grouped_gemm=triton` as the dispatch and the
trainer take it. Tolerance as in the attention tests: at most twice PyTorch's own error in the
inputs' precision against float64, plus 1e-5 (fp32) or one ulp of the largest value (fp16)."""

import logging

import pytest
import torch

from trillion.kernels.grouped_gemm import backend_unavailable, grouped_mm
from trillion.kernels.grouped_gemm_op import triton_grouped_mm

# (group sizes, rows, K, N): the interpreter's tiles are 16 x 16 x 16, so K and N are off them and
# groups span zero, one and several row tiles.
CASES = {
    "uneven": ([5, 37, 1, 20], 63, 41, 23),
    "empty-first-middle-last": ([0, 17, 0, 0, 33, 0], 50, 16, 40),
    "rows-past-the-groups": ([3, 0, 19], 40, 24, 9),
    "all-empty": ([0, 0, 0], 7, 20, 18),
    "one-group": ([34], 34, 7, 33),
    # more groups than the interpreter's search block of 8: the search spans three blocks
    "many-groups": ([3, 0, 1, 7, 0, 0, 2, 5, 16, 1, 0, 4, 0, 9, 1, 1, 0, 2, 6, 0, 3], 70, 18, 20),
}


def _reference(x, weight, offsets):
    """float64, one row at a time: row r belongs to the first group whose end is past r."""
    group_of_row = torch.searchsorted(offsets.long(), torch.arange(x.shape[0]), right=True)
    used = group_of_row < weight.shape[0]
    out = torch.zeros(x.shape[0], weight.shape[2], dtype=x.dtype)
    out[used] = torch.bmm(x[used].unsqueeze(1), weight[group_of_row[used]]).squeeze(1)
    return out


def _run(fn, x, weight, offsets, grad, dtype=None):
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (x, weight)]
    out = fn(*leaves, offsets)
    out.backward(grad.to(out.dtype))
    return [out.detach(), *(t.grad for t in leaves)]


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference_forward_and_gradients(case, dtype):
    sizes, rows, k, n = CASES[case]
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(rows, k, generator=gen), torch.randn(len(sizes), k, n, generator=gen)
    grad = torch.randn(rows, n, generator=gen)
    x, weight, grad = x.to(dtype), weight.to(dtype), grad.to(dtype)
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    ours = _run(triton_grouped_mm, x, weight, offsets, grad)
    exact = _run(_reference, x, weight, offsets, grad, dtype=torch.float64)
    same_precision = _run(_reference, x, weight, offsets, grad)
    for name, mine, truth, theirs in zip(("out", "dx", "dweight"), ours, exact, same_precision):
        assert mine.dtype == dtype and mine.shape == truth.shape, name
        fixed = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps * truth.abs().max().item()
        bound = 2 * _max_err(theirs, truth) + fixed
        assert _max_err(mine, truth) <= bound, f"{name}: error {_max_err(mine, truth):.3g} > bound {bound:.3g}"
    used = offsets[-1]
    assert not ours[0][used:].any() and not ours[1][used:].any()  # rows past the groups: zeros, zero gradients
    empty = [g for g, size in enumerate(sizes) if size == 0]
    assert not ours[2][empty].any()  # an empty group's weight gets a zero gradient


def test_strided_operands_and_the_dispatch_name():
    """x a column slice, weight a transposed view; grouped_mm(impl="triton") runs the same kernel."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(30, 50, generator=gen)[:, 5:45]
    weight = torch.randn(3, 20, 40, generator=gen).transpose(1, 2)
    offsets = torch.tensor([10, 10, 26], dtype=torch.int32)
    out = grouped_mm(x, weight, offsets, "triton")
    assert torch.equal(out, triton_grouped_mm(x.contiguous(), weight.contiguous(), offsets))
    torch.testing.assert_close(out.double(), _reference(x.double(), weight.double(), offsets), atol=1e-5, rtol=1e-5)


def test_custom_ops_pass_opcheck():
    # The schema, the fake (meta) implementations and the autograd registration: what torch.compile uses.
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(20, 16, generator=gen), torch.randn(3, 16, 8, generator=gen)
    offsets = torch.tensor([4, 4, 17], dtype=torch.int32)
    torch.library.opcheck(torch.ops.trillion.grouped_mm.default, (x.requires_grad_(), weight.requires_grad_(), offsets))
    torch.library.opcheck(torch.ops.trillion.grouped_mm_dw.default, (x.detach(), torch.randn(20, 8), offsets))


def test_triton_falls_back_to_the_loop_where_it_cannot_run_and_says_why(monkeypatch, caplog):
    x, weight = torch.randn(6, 8), torch.randn(2, 8, 4)
    offsets = torch.tensor([2, 5], dtype=torch.int32)
    assert backend_unavailable("triton", x, weight) is None  # under the interpreter it runs, but not float64:
    assert "not torch.float64" in backend_unavailable("triton", x.double(), weight.double())
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU tensor without the interpreter: Triton cannot run
    assert "Triton needs a CUDA or ROCm GPU" in backend_unavailable("triton", x, weight)
    with caplog.at_level(logging.WARNING, logger="kernels"):
        out = grouped_mm(x, weight, offsets, "triton")
    assert "kernels.grouped_gemm=triton falls back to PyTorch: Triton needs a CUDA or ROCm GPU" in caplog.text
    torch.testing.assert_close(out, grouped_mm(x, weight, offsets, "loop"))


@pytest.mark.parametrize("interpret", ["0", "1"], ids=["no-triton-here", "interpreter"])
def test_the_trainer_refuses_triton_only_where_it_cannot_run(interpret, tmp_path, monkeypatch, capsys):
    import dataclasses

    from trillion.errors import ConfigError
    from trillion.models import get_preset
    from trillion.models.moe import check_grouped_gemm
    from trillion.trainer.cli.main import main

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    preset = get_preset("debug-moe")
    args = dataclasses.replace(preset, moe=dataclasses.replace(preset.moe, experts_impl="triton"))
    if interpret == "1":
        check_grouped_gemm(args, torch.device("cpu"), torch.float32)  # the interpreter runs it: no refusal
        return
    with pytest.raises(ConfigError, match="kernels.grouped_gemm=triton cannot run here"):
        check_grouped_gemm(args, torch.device("cpu"), torch.float32)
    argv = ["train", "--model.name=debug-moe", "--training.steps=1", "--kernels.grouped_gemm=triton"]
    assert main([*argv, f"--job.output_dir={tmp_path}/r"]) == 2
    err = capsys.readouterr().err
    named = ("kernels.grouped_gemm=triton cannot run here", "CUDA or ROCm GPU", "--kernels.grouped_gemm=auto")
    assert "Traceback" not in err and all(fragment in err for fragment in named), err


def test_moe_layer_with_the_triton_experts_matches_the_loop():
    """models/moe.py's routed experts through kernels.grouped_gemm=triton: output and every gradient."""
    from trillion.models.args import MoEArgs
    from trillion.models.moe import MoE

    def run(impl):
        torch.manual_seed(0)
        layer = MoE(24, MoEArgs(n_experts=4, top_k=2, expert_ffn_dim=20, experts_impl=impl))
        for param in layer.parameters():
            torch.nn.init.normal_(param, std=0.3)
        x = torch.randn(2, 9, 24, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = layer(x)
        out.square().sum().backward()
        return [out, x.grad, *(p.grad for p in layer.parameters())]

    for ours, reference in zip(run("triton"), run("loop"), strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)  # fp32 sums in another order


def test_the_triton_dispatch_compiles_without_a_graph_break():
    torch.compiler.reset()
    x, weight = torch.randn(20, 16, requires_grad=True), torch.randn(3, 16, 8, requires_grad=True)
    offsets = torch.tensor([4, 4, 17], dtype=torch.int32)
    compiled = torch.compile(lambda x, w: grouped_mm(x, w, offsets, "triton"), fullgraph=True, backend="aot_eager")
    out = compiled(x, weight)
    out.sum().backward()
    assert torch.equal(out, triton_grouped_mm(x, weight, offsets)) and weight.grad is not None
