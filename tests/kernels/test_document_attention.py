"""Document masking in the Triton flash attention (kernels/flash_attention_op.py), on CPU through the Triton
interpreter: forward and every gradient against float64 SDPA with the explicit block-diagonal causal mask, the
tiles it skips counted in an instrumented interpreter run, the kernel without documents unchanged, the torch
fallbacks, and the bad inputs.

Tolerance as in test_flash_attention.py: at most twice PyTorch's own error computing the same masked attention
in the inputs' precision, plus 1e-5 in fp32 or one ulp at the tensor's largest value in fp16.
"""

import collections
import contextlib

import pytest
import torch
import torch.nn.functional as F

from trillion.kernels import attention, flash_attention_launch
from trillion.kernels.flash_attention_configs import configs
from trillion.kernels.flash_attention_op import flash_attention


def document_ids(lengths: list[list[int]]) -> torch.Tensor:
    """(batch, sum of a row's lengths) ids: row r holds documents of lengths[r], numbered from an offset."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)) + 7, torch.tensor(row)) for row in lengths])


def masked_sdpa(q, k, v, ids, causal=True, softmax_scale=None):
    """SDPA with the explicit mask: a query (the last q_len positions) sees keys of its own document only."""
    q_len, kv_len = q.shape[2], k.shape[2]
    keep = ids[:, None, kv_len - q_len :, None] == ids[:, None, None, :]
    if causal:
        keep = keep & torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=softmax_scale)


def run(fn, q, k, v, grad, dtype=None, **kw):
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, **kw)
    out.backward(grad.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


def inputs(batch, q_heads, kv_heads, q_len, kv_len, dims, dtype, seed=0):
    d, dv = (dims, dims) if isinstance(dims, int) else dims
    gen = torch.Generator().manual_seed(seed)
    shapes = ((q_heads, q_len, d), (kv_heads, kv_len, d), (kv_heads, kv_len, dv), (q_heads, q_len, dv))
    return [torch.randn(batch, *shape, generator=gen, dtype=dtype) for shape in shapes]


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


# (name, documents per row, q_len (None: the whole window), q/k and v head dims, heads, dtype). The interpreter's
# blocks are 64 x 32 (forward, dQ) and 32 x 64 (dK/dV): lengths cross them at odd places.
LAYOUTS = [
    ("length-1 documents", [[1, 40, 1, 1, 56, 1], [100]], None, 32, (2, 1), torch.float32),
    ("one document spans the window", [[129]], None, 64, (2, 2), torch.float16),
    (
        "many tiny documents",
        [[3, 1, 2, 5, 4, 1, 7, 2, 3, 6, 2, 1, 8, 5, 3, 2, 9, 4, 1, 10, 3, 2, 6, 1]],
        None,
        16,
        (4, 2),
        torch.float32,
    ),
    ("lengths off the blocks", [[31, 33, 65, 1], [63, 67]], None, (48, 32), (2, 2), torch.float16),
    ("queries after a prefix", [[17, 80, 33]], 70, 64, (2, 1), torch.float32),
    ("latent attention's 192/128", [[50, 14, 65]], None, (192, 128), (2, 2), torch.float32),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name, lengths, q_len, dims, heads, dtype", LAYOUTS, ids=[row[0] for row in LAYOUTS])
def test_documents_match_float64_sdpa_with_the_block_diagonal_mask(name, lengths, q_len, dims, heads, dtype, causal):
    ids = document_ids(lengths)
    kv_len = ids.shape[1]
    q, k, v, grad = inputs(len(lengths), *heads, q_len or kv_len, kv_len, dims, dtype)
    ours = run(flash_attention, q, k, v, grad, causal=causal, document_ids=ids)
    exact = run(masked_sdpa, q, k, v, grad, dtype=torch.float64, ids=ids, causal=causal)
    torch_same_precision = run(masked_sdpa, q, k, v, grad, ids=ids, causal=causal)
    for label, mine, truth, theirs in zip(("out", "dq", "dk", "dv"), ours, exact, torch_same_precision):
        assert mine.dtype == dtype and torch.isfinite(mine).all(), label
        fixed = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps * truth.abs().max().item()
        bound = 2 * max_err(theirs, truth) + fixed
        assert max_err(mine, truth) <= bound, f"{label}: error {max_err(mine, truth):.3g} > bound {bound:.3g}"


def test_one_document_per_row_is_the_kernel_without_documents_bitwise():
    """The masked loops of a whole-window document see every key its causal mask does, so the results are
    bit for bit those of document_ids=None (whose code the kernels compile apart: HAS_DOCS = False)."""
    q, k, v, grad = inputs(2, 4, 2, 100, 100, 32, torch.float32, seed=5)
    plain = run(flash_attention, q, k, v, grad)
    single = run(flash_attention, q, k, v, grad, document_ids=torch.zeros(2, 100, dtype=torch.long))
    for a, b in zip(plain, single):
        assert torch.equal(a, b)


@contextlib.contextmanager
def counted_dots():
    """Counts the interpreter's dot products per kernel launch ("fwd", "dkdv", "dq")."""
    from triton.runtime.interpreter import InterpreterBuilder

    counts, current = collections.Counter(), []
    create_dot, launch = InterpreterBuilder.create_dot, flash_attention_launch._launch

    def counting_dot(self, *args, **kwargs):
        counts[current[-1]] += 1
        return create_dot(self, *args, **kwargs)

    def labelled_launch(kernel, *args, **kwargs):
        current.append(kernel)
        return launch(kernel, *args, **kwargs)

    InterpreterBuilder.create_dot = counting_dot
    flash_attention_launch._launch = labelled_launch
    try:
        yield counts
    finally:
        InterpreterBuilder.create_dot, flash_attention_launch._launch = create_dot, launch


def causal_tiles(ids: torch.Tensor, q_len: int, rows: int, cols: int, by_key: bool):
    """(causal tiles visited, those whose query and key blocks share no document) of one head: query blocks of
    `rows` x key blocks of `cols`, as the forward and dQ (by query block) or dK/dV (by key block) walk them."""
    kv_len = ids.shape[1]
    diag, visited, apart = kv_len - q_len, 0, 0
    for b in range(ids.shape[0]):
        for m in range(0, q_len, rows):
            for n in range(0, kv_len, cols):
                if by_key:  # dK/dV: from the query block that holds the first that sees key n
                    seen = m >= max(n - diag, 0) // rows * rows
                else:  # forward, dQ: key blocks below the last row's causal limit
                    seen = n < min(kv_len, m + rows + diag)
                if seen:
                    visited += 1
                    queries = set(ids[b, m + diag : min(m + rows, q_len) + diag].tolist())
                    apart += not queries & set(ids[b, n : n + cols].tolist())
    return visited, apart


@pytest.mark.parametrize(
    "lengths, q_len",
    [([[40, 1, 90, 5, 64]], None), ([[2] * 40 + [120]], None), ([[50, 60, 70, 20]], 150)],
    ids=["mixed", "tiny then long", "queries after a prefix"],
)
def test_tiles_whose_blocks_share_no_document_are_never_visited(lengths, q_len):
    """Counted in the interpreter: each kernel visits the causal tiles minus exactly those whose query and key
    blocks share no document (a dot product per matmul of a visited tile, none for a skipped one)."""
    ids = document_ids(lengths)
    kv_len = ids.shape[1]
    q, k, v, grad = inputs(1, 2, 2, q_len or kv_len, kv_len, 32, torch.float32)
    with counted_dots() as plain:
        run(flash_attention, q, k, v, grad)
    with counted_dots() as masked:
        run(flash_attention, q, k, v, grad, document_ids=ids)
    heads = 2
    for kernel in ("fwd", "dq", "dkdv"):
        (config,) = configs(kernel, "interpreter", 32, 32)
        rows, cols = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
        visited, apart = causal_tiles(ids, q_len or kv_len, rows, cols, by_key=kernel == "dkdv")
        assert apart > 0, kernel  # the layout has tiles to skip
        dots_per_tile, rest = divmod(plain[kernel], heads * visited)
        assert rest == 0 and dots_per_tile >= 2, (kernel, plain[kernel], visited)
        assert masked[kernel] == dots_per_tile * heads * (visited - apart), (kernel, masked[kernel], visited, apart)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_torch_backends_mask_documents_like_the_kernel(impl):
    ids = document_ids([[1, 30, 3, 66], [100]])
    q, k, v, grad = inputs(2, 4, 2, 100, 100, 32, torch.float32, seed=2)
    exact = run(masked_sdpa, q, k, v, grad, dtype=torch.float64, ids=ids)
    theirs = run(attention, q, k, v, grad, impl=impl, document_ids=ids)
    ours = run(attention, q, k, v, grad, impl="triton", document_ids=ids)
    for a, b, truth in zip(theirs, ours, exact):
        assert max_err(a, truth) < 1e-5 and max_err(b, truth) < 1e-5


def test_the_op_passes_opcheck_with_documents_and_compiles_whole():
    q, k, v, _ = inputs(1, 2, 1, 20, 24, 16, torch.float32)
    ids = document_ids([[5, 1, 18]])
    args = tuple(t.requires_grad_() for t in (q, k, v)) + (True, 0.25, ids)
    torch.library.opcheck(torch.ops.trillion.flash_attn_fwd.default, args)
    compiled = torch.compile(lambda *t: flash_attention(*t, document_ids=ids), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), flash_attention(q, k, v, document_ids=ids), atol=0, rtol=0)


@pytest.mark.parametrize(
    "ids, message",
    [
        (torch.zeros(1, 23, dtype=torch.long), r"must be \(batch, kv_len\) = \(1, 24\)"),
        (torch.zeros(24, dtype=torch.long), "must be"),
        (torch.zeros(1, 24), "must hold integers"),
        (
            torch.tensor([[0] * 10 + [1] * 10 + [0] * 4]),
            "non-decreasing along each row; row 0 goes from 1 to 0 at position 20",
        ),
    ],
    ids=["length", "one dim", "float", "decreasing"],
)
def test_bad_document_ids_raise_value_errors_naming_the_problem(ids, message):
    q, k, v, _ = inputs(1, 2, 1, 24, 24, 16, torch.float32)
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, v, document_ids=ids)


def test_document_ids_need_queries_no_more_than_keys():
    q, k, v, _ = inputs(1, 2, 1, 30, 24, 16, torch.float32)
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        flash_attention(q, k, v, document_ids=torch.zeros(1, 24, dtype=torch.long))
