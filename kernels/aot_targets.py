"""The ahead-of-time report's targets (kernels/aot.py): each GPU architecture's Triton target, its chip limits and
the matrix instructions its kernels must use. sm100 and gfx950 launch the tuned configs of the part they succeed
(kernels/_triton_setup.py SUCCEEDS)."""

# Chip limits: shared memory / LDS per block (the opt-in maximum on NVIDIA), registers per thread.
ARCHS = {
    "sm80": dict(
        target=("cuda", 80, 32),
        shared=166912,
        mma=r"\bmma\.sync\.aligned\.\S+",
        sm_warps=64,
        sm_regs=65536,
        sm_shared=167936,
    ),
    "sm90": dict(
        target=("cuda", 90, 32),
        shared=232448,
        mma=r"\bwgmma\.mma_async\.\S+|\bmma\.sync\.aligned\.\S+",
        sm_warps=64,
        sm_regs=65536,
        sm_shared=233472,
    ),
    # Blackwell (CUDA compute capability 10.0: 227 KB of shared memory per block, 228 KB per SM, 64K registers and
    # 64 warps per SM, CUDA C++ Programming Guide, "Compute Capabilities"): its tensor cores take tcgen05.mma
    # (PTX ISA 8.7, "TensorCore 5th Generation"); Hopper's wgmma is gone.
    "sm100": dict(
        target=("cuda", 100, 32),
        shared=232448,
        mma=r"\btcgen05\.mma\S*|\bmma\.sync\.aligned\.\S+",
        sm_warps=64,
        sm_regs=65536,
        sm_shared=233472,
    ),
    "gfx90a": dict(target=("hip", "gfx90a", 64), shared=65536, mma=r"\bv_mfma_\w+"),
    "gfx942": dict(target=("hip", "gfx942", 64), shared=65536, mma=r"\bv_mfma_\w+"),
    # CDNA4 (MI350X / MI355X): 160 KB of LDS per CU (AMD Instinct MI350 series ISA reference, "LDS")
    "gfx950": dict(target=("hip", "gfx950", 64), shared=163840, mma=r"\bv_mfma_\w+"),
}
