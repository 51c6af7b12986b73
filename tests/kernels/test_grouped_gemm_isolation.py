"""The grouped GEMM's row masks, asserted rather than crashed on: each group's outputs depend only on its own
rows, and no kernel reads or writes a row outside the problem it was given.

An off-by-one in a row mask reads or writes the next group's first row. The Triton interpreter runs the
programs in grid order, so inside one buffer that next group's own tile later overwrites what was written
(on a GPU, a race); at the buffer's end the read falls outside the allocation and the interpreter aborts.
Here each problem is a window of larger buffers whose other rows are a neighbour's (as rows packed for
several calls are): the rows just outside are in bounds, the output rows outside hold a sentinel that
must survive bitwise, and perturbing the first and the last row of every group, and the neighbour's rows
on either side, must leave every other group's outputs bitwise unchanged. The forward, the input-gradient
and the weight-gradient kernels each, fp32 under TRITON_INTERPRET=1, with empty and one-row groups."""

import pytest
import torch

from trillion.kernels.grouped_gemm_op import _launch

# (group sizes, window rows): the interpreter's tiles are 16 rows, so groups end inside and at tiles
LAYOUTS = {
    "groups-fill-the-window": ([0, 1, 17, 1, 0, 5, 3], 27),
    "rows-past-the-groups": ([2, 0, 16, 1, 0], 23),
}
K, N, BEFORE, AFTER = 20, 18, 3, 3  # the neighbour's rows before and after the window
SENTINEL = 1234.5
KERNELS = ("forward", "input-gradient", "weight-gradient")


def _operands(rows: int, groups: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    total = BEFORE + rows + AFTER
    return {
        "x": torch.randn(total, K, generator=gen),
        "dy": torch.randn(total, N, generator=gen),
        "weight": torch.randn(groups, K, N, generator=gen),
    }


def _run(kernel: str, operands: dict, offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """The kernel's launch on the window [BEFORE, BEFORE + rows) of the row buffers, into a window of an
    output buffer filled with SENTINEL: rows (forward, input gradient) or groups (weight gradient) around it."""
    window = slice(BEFORE, BEFORE + rows)
    x, dy, weight = operands["x"][window], operands["dy"][window], operands["weight"]
    if kernel == "weight-gradient":
        out = torch.full((weight.shape[0] + 2, K, N), SENTINEL)
        _launch("dw", x, dy, offsets, out[1:-1])
    elif kernel == "forward":
        out = torch.full((BEFORE + rows + AFTER, N), SENTINEL)
        _launch("mm", x, weight, offsets, out[window])
    else:  # the launch the backward makes for dx: dy times each group's weight transposed
        out = torch.full((BEFORE + rows + AFTER, K), SENTINEL)
        _launch("mm", dy, weight.transpose(1, 2), offsets, out[window])
    return out


def _owners(kernel: str, sizes: list[int], rows: int) -> list:
    """Which group owns each output unit (a row, or a group's weight gradient): "outside" for the sentinels,
    "past" for the rows past the last group."""
    if kernel == "weight-gradient":
        return ["outside", *range(len(sizes)), "outside"]
    groups = [g for g, size in enumerate(sizes) for _ in range(size)]
    return ["outside"] * BEFORE + groups + ["past"] * (rows - len(groups)) + ["outside"] * AFTER


def _rows_to_perturb(sizes: list[int], rows: int) -> dict[int, object]:
    """Buffer row -> its owner: every group's first and last row, the neighbour's rows beside the window
    and the first row past the groups."""
    chosen, start = {BEFORE - 1: "outside", BEFORE + rows: "outside"}, BEFORE
    for g, size in enumerate(sizes):
        if size:
            chosen |= {start: g, start + size - 1: g}
        start += size
    if start < BEFORE + rows:
        chosen[start] = "past"
    return chosen


def _reference(kernel: str, operands: dict, sizes: list[int], rows: int) -> torch.Tensor:
    window = slice(BEFORE, BEFORE + rows)
    x, dy, weight = operands["x"][window].double(), operands["dy"][window].double(), operands["weight"].double()
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    parts = [(bounds[g], bounds[g + 1]) for g in range(len(sizes))]
    if kernel == "weight-gradient":
        return torch.stack([x[a:b].T @ dy[a:b] for a, b in parts])
    if kernel == "forward":
        pieces = [x[a:b] @ weight[g] for g, (a, b) in enumerate(parts)]
    else:
        pieces = [dy[a:b] @ weight[g].T for g, (a, b) in enumerate(parts)]
    return torch.cat([*pieces, torch.zeros(rows - bounds[-1], pieces[0].shape[1], dtype=torch.float64)])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_group_depends_only_on_its_own_rows(kernel, layout):
    sizes, rows = LAYOUTS[layout]
    operands = _operands(rows, len(sizes))
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    owners = _owners(kernel, sizes, rows)
    outside = [i for i, owner in enumerate(owners) if owner == "outside"]
    base = _run(kernel, operands, offsets, rows)
    assert torch.all(base[outside] == SENTINEL), "a kernel wrote outside the rows it was given"
    inside = [i for i, owner in enumerate(owners) if owner != "outside"]
    torch.testing.assert_close(base[inside].double(), _reference(kernel, operands, sizes, rows), atol=1e-5, rtol=1e-5)
    for row, perturbed_owner in _rows_to_perturb(sizes, rows).items():
        moved = {name: t.clone() for name, t in operands.items()}
        moved["x"][row] += 1.0
        moved["dy"][row] += 1.0
        out = _run(kernel, moved, offsets, rows)
        for unit, owner in enumerate(owners):
            if owner != perturbed_owner or owner == "outside":
                assert torch.equal(out[unit], base[unit]), f"row {row} (group {perturbed_owner}) changed unit {unit}"
        if isinstance(perturbed_owner, int):  # the group's own outputs did move: the perturbation reached them
            own = [unit for unit, owner in enumerate(owners) if owner == perturbed_owner]
            assert not torch.equal(out[own], base[own])
