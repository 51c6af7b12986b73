"""Accelerators as data: peak dense FLOP/s per dtype, memory, bandwidth, power and kernel
efficiencies, read from devices.toml beside this file (and devices.toml in any folder of
TRILLION_HARDWARE_PATH, which overrides), with the fitted constants of fitted.toml applied. It sits
at the bottom of the package because the metrics (MFU), the planner and the dry run all look
devices up here.

An unknown device gets no peak at all, never another device's (a bug class in peer trainers
that produced MFU above 100%).
"""

import bisect
import math
import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import tomllib

from trillion.errors import ConfigError

DEVICES_FILE = Path(__file__).with_name("devices.toml")
# The formats a device's matrix units may multiply in below bf16, each with its dense peak (peak_tflops.<format>):
# OCP fp8 (e4m3, scaled per tensor or per row by software), and the block-scaled MXFP8 (32 elements share an e8m0
# scale), NVFP4 (16 share an e4m3 one) and MXFP4 (32 share an e8m0 one), whose scales the matrix units apply
LOW_PRECISION_FORMATS = ("fp8", "mxfp8", "nvfp4", "mxfp4")
FITTED_FILE = Path(__file__).with_name("fitted.toml")


@dataclass(frozen=True, eq=False)  # hashed by identity: the planner caches per profile object
class DeviceSpec:
    name: str
    peak_tflops: dict  # dtype -> dense TFLOP/s
    memory_gb: float
    name_patterns: tuple[str, ...] = ()  # lower-case substrings of torch.cuda.get_device_name()
    memory_bandwidth_gbs: float = 0.0
    power_w: float = 0.0
    gemm_efficiency: tuple[tuple[float, float], ...] = ()  # (flops of one GEMM, share of peak), ascending
    # the same per low-precision format (LOW_PRECISION_FORMATS: fp8, and the block-scaled mxfp8, nvfp4, mxfp4), each of
    # that format's peak: devices.toml's <format>_gemm_efficiency
    format_gemm_efficiency: dict = field(default_factory=dict)
    attention_efficiency: float = 0.0
    memory_efficiency: float = 0.0
    kernel_overhead_us: float = 0.0
    compute_units: int = 0  # SMs / CUs: tells apart parts that report one driver name
    # share of its microbenchmark rates (GEMM plateaus, attention efficiency) a device's compute-bound kernels keep
    # through a training step: 1 unless fitted.toml fits it for the device's family (its `why` says what it absorbs)
    sustained: float = 1.0

    @property
    def peak_tflops_bf16(self) -> float:
        return self.peak_tflops["bf16"]

    def gemm_share_of_peak(self, flops: float, dtype: str = "bf16") -> float:
        """Achieved share of the `dtype` peak (bf16, or a LOW_PRECISION_FORMATS one from its
        <format>_gemm_efficiency) for one GEMM of `flops`, interpolated in log(flops), clamped at the ends."""
        curve = self.gemm_efficiency if dtype == "bf16" else self.format_gemm_efficiency.get(dtype, ())
        if not curve:
            field = "gemm_efficiency" if dtype == "bf16" else f"{dtype}_gemm_efficiency"
            how = " or measure it with `trillion plan --calibrate`" if dtype == "bf16" else ""
            raise ConfigError(
                f"Device {self.name!r} has no {field} curve, so it cannot be planned for"
                f"{'' if dtype == 'bf16' else ' in ' + dtype}. Add one to its profile{how}."
            )
        sizes = [math.log(s) for s, _ in curve]
        x = math.log(max(flops, 1.0))
        i = bisect.bisect_left(sizes, x)
        if i == 0:
            return curve[0][1]
        if i == len(sizes):
            return curve[-1][1]
        (x0, (_, e0)), (x1, (_, e1)) = (sizes[i - 1], curve[i - 1]), (sizes[i], curve[i])
        return e0 + (e1 - e0) * (x - x0) / (x1 - x0)


def search_dirs() -> list[Path]:
    """Folders named by TRILLION_HARDWARE_PATH (colon-separated), where users add devices and machines."""
    return [Path(p) for p in os.environ.get("TRILLION_HARDWARE_PATH", "").split(os.pathsep) if p]


def read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"Cannot read hardware file {path}: {error}.") from None


def device_from_table(table: dict, where: str) -> DeviceSpec:
    try:
        return DeviceSpec(
            name=table["name"],
            peak_tflops=dict(table["peak_tflops"]),
            memory_gb=float(table["memory_gb"]),
            name_patterns=tuple(table.get("name_patterns", ())),
            memory_bandwidth_gbs=float(table.get("memory_bandwidth_gbs", 0.0)),
            power_w=float(table.get("power_w", 0.0)),
            gemm_efficiency=_curve(table.get("gemm_efficiency", ())),
            format_gemm_efficiency={
                name: _curve(table[f"{name}_gemm_efficiency"])
                for name in LOW_PRECISION_FORMATS
                if f"{name}_gemm_efficiency" in table
            },
            attention_efficiency=float(table.get("attention_efficiency", 0.0)),
            memory_efficiency=float(table.get("memory_efficiency", 0.0)),
            kernel_overhead_us=float(table.get("kernel_overhead_us", 0.0)),
            compute_units=int(table.get("compute_units", 0)),
            sustained=float(table.get("sustained", 1.0)),
        )
    except KeyError as missing:
        raise ConfigError(f"{where}: a device needs {missing.args[0]!r} (see {DEVICES_FILE}).") from None


def _curve(points) -> tuple[tuple[float, float], ...]:
    """A [[flops, share of peak], ...] table as ascending pairs."""
    return tuple(sorted((float(flops), float(share)) for flops, share in points))


def fitted_constants() -> list[dict]:
    """fitted.toml's entries: the performance model's only constants fitted to published runs."""
    return read_toml(FITTED_FILE).get("fitted", [])


def with_fitted(table: dict, fitted: list[dict]) -> dict:
    """A device table with the fitted scalars that name it filled in (a device's own value wins): those of its
    family (`devices`), or carried from the nearest fitted family to a newer part no published run is fitted on
    (`carried_to`, each with its reason in the entry's `carried`)."""
    table = dict(table)
    for entry in fitted:
        if table["name"] not in (*entry["devices"], *entry.get("carried_to", ())):
            continue
        if entry["field"] == "gemm_plateau" and "gemm_efficiency" not in table:
            table["gemm_efficiency"] = [[1e12, entry["value"]]]
        elif entry["field"] == "sustained" and "sustained" not in table:
            table["sustained"] = entry["value"]
    return table


@cache
def _devices() -> dict[str, DeviceSpec]:
    devices, fitted = {}, fitted_constants()
    for path in [DEVICES_FILE] + [d / DEVICES_FILE.name for d in reversed(search_dirs())]:  # user files override
        if path.is_file():
            for table in read_toml(path).get("device", []):
                devices[table["name"]] = device_from_table(with_fitted(table, fitted), str(path))
    return devices


DEVICES: dict[str, DeviceSpec] = _devices()


def lookup_device(device_name: str, compute_units: int = 0) -> DeviceSpec | None:
    """The spec whose name pattern occurs in the driver's device name, or None.

    The longest matching pattern names the device ("GH200" also holds "h200", "H100 NVL" holds
    "h100"). A name in which another device's pattern still occurs outside that match names two
    parts ("AMD Instinct MI250X / MI250": the MI250's GCDs report it too); then the compute-unit
    count decides, and without one that matches, no device is better than the wrong peak.
    """
    lowered = device_name.lower()

    def matched(text: str) -> list[tuple[int, DeviceSpec, str]]:
        return sorted(
            ((len(p), s, p) for s in DEVICES.values() for p in s.name_patterns if p in text), key=lambda m: -m[0]
        )

    matches = matched(lowered)
    if not matches:
        return None
    _, best, pattern = matches[0]
    others = {s.name: s for _, s, _ in matched(lowered.replace(pattern, " ")) if s is not best}
    if not others:
        return best
    candidates = [best, *others.values()]
    return next((s for s in candidates if compute_units and s.compute_units == compute_units), None)
