"""Accelerators by name: dense peak FLOP/s and memory (PAPER.md "Hardware figures").

The metrics use this table for MFU; an unknown device gets no peak at all, never another
device's (a bug class in peer trainers that produced MFU above 100%).
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_tflops_bf16: float  # dense, no sparsity
    memory_gb: float
    name_patterns: tuple[str, ...]  # lower-case substrings of torch.cuda.get_device_name()


DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec("mi250x-gcd", 191.5, 64, ("mi250x", "mi250")),
        DeviceSpec("mi300x", 1307.4, 192, ("mi300x",)),
        DeviceSpec("a100", 312.0, 80, ("a100",)),
        DeviceSpec("h100", 989.4, 80, ("h100",)),
        DeviceSpec("h200", 989.4, 141, ("h200",)),
        DeviceSpec("gh200", 989.4, 96, ("gh200",)),
        DeviceSpec("b200", 2250.0, 180, ("b200",)),
        DeviceSpec("l40s", 362.1, 48, ("l40s",)),
    )
}


def lookup_device(device_name: str) -> DeviceSpec | None:
    """The spec whose name pattern occurs in the driver's device name, or None."""
    lowered = device_name.lower()
    matches = [s for s in DEVICES.values() if any(p in lowered for p in s.name_patterns)]
    # "GH200" also contains "h200": the longest matching pattern is the specific one.
    matches.sort(key=lambda s: -max(len(p) for p in s.name_patterns if p in lowered))
    return matches[0] if matches else None
