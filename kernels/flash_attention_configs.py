"""The flash attention kernels' tuned configs per GPU architecture (and the interpreter's fixed one):
what the autotuner of kernels/flash_attention_op.py times, and what the ahead-of-time report
(kernels/aot.py) compiles."""

from __future__ import annotations

import triton


# Per architecture and kernel, the configs for q/k widths as the kernels run them (padded to a power of two,
# or two: kernels/head_dims.py block_dims_for) up to 64, up to 128 and up to 256, and for latent attention's
# q/k 192 (128 + 64, unpadded) and v 128, whose 256 class spills: (BLOCK_M, BLOCK_N, num_warps, num_stages[,
# AMD options]). The autotuner times those of the head dim's class once per shape and keeps the best. Every
# config for head dims 64, 128 and 192/128, document masking's included (_DOCUMENT_CONFIGS), compiles without
# spills or scratch and within the chip's shared memory (experiments/kernels/RESOURCES.md, checked by
# tests/kernels/test_aot.py; the 192/128 sets chosen by `python -m trillion.kernels.report --search`). On AMD
# CDNA, waves_per_eu caps occupancy to leave registers per wave, matrix_instr_nonkdim picks the 16x16 MFMA.
def _amd(waves: int) -> dict:
    return {"waves_per_eu": waves, "matrix_instr_nonkdim": 16}


_CONFIGS: dict[str, dict[str, dict[int | tuple, list[tuple]]]] = {
    "sm80": {
        "fwd": {
            64: [(128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
            128: [(128, 32, 8, 3), (64, 64, 8, 3), (64, 32, 4, 3)],
            256: [(64, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 2)],
            (192, 128): [(128, 32, 8, 2), (64, 64, 8, 3), (64, 32, 4, 2)],
        },
        "dkdv": {
            64: [(32, 128, 8, 2), (32, 64, 8, 2), (32, 32, 4, 2)],
            128: [(32, 64, 8, 2), (64, 64, 8, 2), (32, 32, 4, 2)],
            256: [(32, 64, 4, 2), (16, 64, 4, 2)],
            (192, 128): [(64, 32, 8, 2), (32, 32, 8, 2), (16, 64, 8, 2)],
        },
        "dq": {
            64: [(128, 64, 8, 2), (64, 64, 8, 3), (64, 32, 4, 3)],
            128: [(64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2)],
            256: [(64, 32, 4, 2), (32, 32, 4, 2)],
            (192, 128): [(32, 64, 8, 2), (32, 32, 4, 2), (16, 64, 8, 2)],
        },
    },
    "sm90": {
        "fwd": {
            64: [(128, 128, 8, 4), (128, 64, 4, 4), (64, 64, 4, 4)],
            128: [(128, 64, 8, 4), (128, 64, 8, 2), (64, 64, 4, 4), (64, 32, 4, 3)],
            256: [(128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3)],
            (192, 128): [(128, 64, 8, 2), (64, 32, 4, 3)],
        },
        "dkdv": {
            64: [(64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 8, 2)],
            128: [(32, 64, 8, 3), (64, 32, 8, 2)],
            256: [(32, 64, 4, 2), (16, 64, 4, 2)],
            (192, 128): [(64, 32, 8, 2), (32, 32, 8, 2), (16, 64, 8, 2)],
        },
        "dq": {
            64: [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
            128: [(128, 64, 8, 2), (64, 64, 8, 2), (128, 32, 8, 3), (64, 32, 4, 2)],
            256: [(64, 32, 4, 2), (32, 32, 4, 2)],
            (192, 128): [(64, 32, 8, 2), (32, 32, 4, 2)],
        },
    },
    # Blackwell: sm90's configs less those that spill on sm100 (ptxas 13.4, the ahead-of-time report of
    # experiments/kernels/RESOURCES.md: fwd 64 at 128 x 64 with 4 warps, fwd 128 at 64 x 64 with 4 warps and 4 stages,
    # dkdv 64 at 64 x 128 and 32 x 64, dkdv 128 at 32 x 64, dq 128 at 128 x 32); sm90's wgmma tiles compile to tcgen05.
    "sm100": {
        "fwd": {
            64: [(128, 128, 8, 4), (64, 64, 4, 4)],
            128: [(128, 64, 8, 4), (128, 64, 8, 2), (64, 32, 4, 3)],
            256: [(128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3)],
            (192, 128): [(128, 64, 8, 2), (64, 32, 4, 3)],
        },
        "dkdv": {
            64: [(64, 64, 8, 2)],
            128: [(64, 32, 8, 2)],
            256: [(32, 64, 4, 2), (16, 64, 4, 2)],
            (192, 128): [(64, 32, 8, 2), (32, 32, 8, 2), (16, 64, 8, 2)],
        },
        "dq": {
            64: [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
            128: [(128, 64, 8, 2), (64, 64, 8, 2), (64, 32, 4, 2)],
            256: [(64, 32, 4, 2), (32, 32, 4, 2)],
            (192, 128): [(64, 32, 8, 2), (32, 32, 4, 2)],
        },
    },
    "gfx90a": {
        "fwd": {
            64: [(128, 64, 8, 1, _amd(1)), (64, 64, 4, 1, _amd(3)), (128, 32, 4, 1, _amd(2))],
            128: [(128, 32, 4, 1, _amd(2)), (64, 32, 4, 1, _amd(2)), (128, 64, 8, 1, _amd(1))],
            256: [(64, 32, 4, 1, _amd(2)), (32, 32, 4, 1, _amd(2))],
            (192, 128): [(64, 32, 4, 1, _amd(2)), (32, 32, 4, 1, _amd(2))],
        },
        "dkdv": {
            64: [(32, 64, 4, 1, _amd(2)), (64, 64, 4, 1, _amd(1))],
            128: [(32, 64, 4, 1, _amd(2)), (64, 64, 4, 1, _amd(1))],
            256: [(32, 32, 4, 1, _amd(1)), (16, 32, 4, 1, _amd(2))],
            (192, 128): [(64, 64, 4, 1, _amd(1)), (32, 32, 4, 1, _amd(1)), (16, 32, 4, 1, _amd(2))],
        },
        "dq": {
            64: [(64, 32, 4, 1, _amd(2)), (64, 64, 4, 1, _amd(1))],
            128: [(64, 32, 4, 1, _amd(2)), (64, 64, 4, 1, _amd(1))],
            256: [(32, 32, 4, 1, _amd(1)), (32, 16, 4, 1, _amd(2))],
            (192, 128): [(64, 32, 4, 1, _amd(2)), (64, 64, 4, 1, _amd(1)), (32, 32, 4, 1, _amd(1))],
        },
    },
    "gfx942": {
        "fwd": {
            64: [(128, 64, 8, 2, _amd(1)), (128, 64, 4, 2, _amd(2)), (64, 64, 4, 2, _amd(3))],
            128: [(128, 64, 8, 2, _amd(1)), (64, 64, 4, 2, _amd(2)), (64, 32, 4, 1, _amd(2))],
            256: [(64, 64, 4, 2, _amd(2)), (64, 32, 4, 1, _amd(2))],
            (192, 128): [(64, 32, 4, 1, _amd(2)), (32, 32, 4, 1, _amd(2))],
        },
        "dkdv": {
            64: [(16, 64, 4, 1, _amd(2)), (32, 64, 4, 1, _amd(2))],
            128: [(32, 64, 4, 1, _amd(2)), (16, 64, 4, 1, _amd(2)), (32, 32, 4, 1, _amd(2))],
            256: [(32, 64, 4, 1, _amd(1)), (16, 64, 4, 1, _amd(2))],
            (192, 128): [(32, 64, 4, 1, _amd(1)), (32, 32, 4, 1, _amd(1))],
        },
        "dq": {
            64: [(128, 32, 4, 2, _amd(1)), (32, 64, 4, 1, _amd(2)), (64, 32, 4, 1, _amd(2))],
            128: [(128, 32, 4, 2, _amd(1)), (64, 32, 4, 1, _amd(1)), (64, 32, 4, 1, _amd(2))],
            256: [(64, 32, 4, 1, _amd(1)), (32, 32, 4, 1, _amd(2))],
            (192, 128): [(64, 32, 4, 1, _amd(1)), (32, 32, 4, 1, _amd(1))],
        },
    },
    # The interpreter runs one fixed config: blocks as large as keep test sequences (up to ~200)
    # spanning several blocks, since its cost is per block step; BLOCK_M != BLOCK_N on purpose.
    "interpreter": {"fwd": {256: [(64, 32, 4, 1)]}, "dkdv": {256: [(32, 64, 4, 1)]}, "dq": {256: [(64, 32, 4, 1)]}},
}

# Document masking's own configs where the plain ones do not fit it: its launches hold more scalars (the
# documents' bounds, a masked loop over every tile), and on AMD CDNA, whose plain configs already use up to
# 100-106 of the SGPRs, these spill in some of the plain configs (the ahead-of-time report's search). The
# class's other configs are the plain ones.
_DOCUMENT_CONFIGS: dict[str, dict[str, dict[int | tuple, list[tuple]]]] = {
    "gfx90a": {
        "fwd": {
            64: [(128, 64, 8, 1, _amd(1)), (128, 32, 8, 1, _amd(2)), (64, 32, 4, 1, _amd(2))],
            128: [(128, 32, 8, 1, _amd(1)), (64, 32, 4, 1, _amd(2)), (64, 32, 8, 1, _amd(1))],
        },
        "dkdv": {
            64: [(32, 64, 4, 1, _amd(2)), (32, 128, 8, 1, _amd(1)), (16, 64, 4, 1, _amd(2))],
            128: [(32, 64, 4, 1, _amd(2)), (32, 128, 8, 1, _amd(1)), (16, 64, 4, 1, _amd(2))],
        },
    },
    "gfx942": {
        "fwd": {
            64: [(128, 64, 8, 1, _amd(1)), (128, 32, 8, 2, _amd(1)), (64, 64, 4, 1, _amd(2))],
            128: [(128, 64, 8, 1, _amd(1)), (64, 64, 4, 1, _amd(2)), (64, 32, 4, 1, _amd(2))],
        },
    },
}


def configs(
    kernel: str, arch: str, block_d: int, block_dv: int | None = None, documents: bool = False
) -> list[triton.Config]:
    """The configs `kernel` ("fwd", "dkdv" or "dq") is tuned over on `arch` for the q/k width as the kernels
    run it and v's padded head dim (where it differs): the pair's own where it has some, else the class of
    the larger; with document masking, the class's own for it where it has one (_DOCUMENT_CONFIGS)."""
    by_class = {**_CONFIGS[arch][kernel], **(_DOCUMENT_CONFIGS.get(arch, {}).get(kernel, {}) if documents else {})}
    size = max(block_d, block_dv or block_d)
    rows = by_class.get((block_d, block_dv)) or by_class[min(c for c in by_class if isinstance(c, int) and c >= size)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, **(extra[0] if extra else {})}, num_warps=w, num_stages=s)
        for bm, bn, w, s, *extra in rows
    ]
