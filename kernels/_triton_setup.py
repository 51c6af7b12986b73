"""Where Triton can run, which GPU architecture we are on, and one-time logging for fallbacks.

Kept free of `import triton` at module level so that callers can ask "can Triton run here?"
on machines without Triton installed.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

logger = logging.getLogger(__name__)

# Architectures with their own tuned config sets. "interpreter" means TRITON_INTERPRET=1 on CPU,
# where only a single fixed config is allowed (the interpreter cannot autotune).
ARCHS = ("sm80", "sm90", "sm100", "gfx90a", "gfx942", "interpreter")
# Newer targets without a tuned set of their own run the set of the part they succeed, whose tiles fit their
# chips (gfx950: 160 KB of LDS per CU against gfx942's 64 KB). The ahead-of-time report compiles exactly these
# launches for them (kernels/aot.py). sm100 has its own: sm90's spill there in places.
SUCCEEDS = {"gfx950": "gfx942"}
# Warps of the backward's delta kernel (one row sum per query; 4 unless named): on sm100 a build that lands on 48
# registers spills 20-24 bytes under ptxas 13.4 (4 warps at head dim 64, 8 at 128 and 192/128); 16 warps stay at 26-32
# registers at every head dim (RESOURCES.md)
DELTA_WARPS = {"sm100": 16}


def config_set(arch: str) -> str:
    """The tuned config set (one of ARCHS) a target launches: its own, or that of the part it succeeds."""
    return SUCCEEDS.get(arch, arch)


def interpreting() -> bool:
    """True when Triton kernels will be run by the CPU interpreter.

    Triton reads TRITON_INTERPRET when a kernel is decorated, so this must already be set
    when the kernel modules are imported; tests set it in tests/kernels/conftest.py.
    """
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def unavailable_reason(device: torch.device | str) -> str | None:
    """None if our Triton kernels can run on tensors of `device`, else a sentence saying why not."""
    device = torch.device(device)
    if not has_triton():
        return "the triton package is not installed"
    if interpreting():
        if device.type != "cpu":
            return f"TRITON_INTERPRET=1 runs kernels on CPU tensors only, got a {device.type} tensor"
        return None
    if device.type != "cuda":  # ROCm GPUs are also "cuda" devices in PyTorch
        return (
            f"Triton needs a CUDA or ROCm GPU, got a {device.type} tensor "
            "(set TRITON_INTERPRET=1 before start-up to run the kernels slowly on CPU)"
        )
    if torch.version.hip is None and torch.cuda.get_device_capability(device)[0] < 8:
        return f"{torch.cuda.get_device_name(device)} is older than Ampere (sm80), which the kernels need"
    return None


def device_arch(device: torch.device | str) -> str:
    """Name of the config set to use on `device`: one of ARCHS.

    GPUs without a set of their own get the nearest older one, which is always safe
    because the autotuner skips configs that do not fit a chip's shared memory or registers.
    """
    device = torch.device(device)
    if interpreting():
        return "interpreter"
    return _gpu_arch(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _gpu_arch(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip is not None:
        gcn = props.gcnArchName.split(":")[0]
        if gcn in ("gfx90a", "gfx942", "gfx950"):
            return config_set(gcn)
        chosen = "gfx942" if gcn.startswith("gfx9") and gcn >= "gfx940" else "gfx90a"
        logger.info("no Triton configs tuned for %s; using the %s set", gcn, chosen)
        return chosen
    major, minor = props.major, props.minor
    if major >= 10:
        chosen = "sm100"
    elif major == 9:
        chosen = "sm90"
    elif major == 8:
        chosen = "sm80"
    else:
        raise RuntimeError(f"{props.name} (sm{major}{minor}) is older than sm80; see unavailable_reason()")
    if (major, minor) not in ((8, 0), (9, 0), (10, 0)):
        logger.info("no Triton configs tuned for sm%d%d; using the %s set", major, minor, chosen)
    return chosen


def use_triton(what: str, device_type: str, other_reason: str = "") -> bool:
    """Whether `what` (a kernel choice such as "kernels.attention=triton") can run Triton on this
    device type; if not, says why once in the log. torch.compile treats the answer as a constant
    (see below), so dispatch code that asks traces without a graph break."""
    reason = other_reason or unavailable_reason(device_type)
    if reason:
        log_once("kernels", f"{what} falls back to PyTorch: {reason}")
    return not reason


# What torch.compiler.assume_constant_result(use_triton) does, without importing torch._dynamo
# here: that import takes seconds, and model code imports this module. Tested by compiling the
# fallback path with fullgraph=True (tests/kernels/test_kernel_dispatch.py).
use_triton._dynamo_marked_constant = True


@functools.cache
def log_once(logger_name: str, message: str) -> None:
    """Log `message` at warning level the first time it is seen (fallback reasons, mostly)."""
    logging.getLogger(logger_name).warning(message)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
