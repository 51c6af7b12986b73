"""Accelerators and the machines built from them, as data (PAPER.md "Hardware figures").

Devices (peak dense FLOP/s per dtype, memory, power, kernel efficiencies) live in
hardware_profiles/devices.toml; machines (a device, GPUs per node, the links inside a node and
between nodes, power overheads, price) in hardware_profiles/<name>.toml. Users add machines by
putting TOML files in a folder named by TRILLION_HARDWARE_PATH (colon-separated) or by passing
a file's path; `trillion plan --calibrate` writes one for the machine it runs on.

The metrics use `lookup_device` for MFU; an unknown device gets no peak at all, never another
device's (a bug class in peer trainers that produced MFU above 100%).
"""
import bisect
import math
import os
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from trainer.errors import ConfigError

PROFILE_DIR = Path(__file__).with_name("hardware_profiles")
DEVICES_FILE = "devices.toml"


@dataclass(frozen=True, eq=False)  # hashed by identity: the planner caches per profile object
class DeviceSpec:
    name: str
    peak_tflops: dict  # dtype -> dense TFLOP/s
    memory_gb: float
    name_patterns: tuple[str, ...] = ()  # lower-case substrings of torch.cuda.get_device_name()
    memory_bandwidth_gbs: float = 0.0
    power_w: float = 0.0
    gemm_efficiency: tuple[tuple[float, float], ...] = ()  # (flops of one GEMM, share of peak), ascending
    attention_efficiency: float = 0.0
    memory_efficiency: float = 0.0
    kernel_overhead_us: float = 0.0

    @property
    def peak_tflops_bf16(self) -> float:
        return self.peak_tflops["bf16"]

    def gemm_share_of_peak(self, flops: float) -> float:
        """Achieved share of peak for one GEMM of `flops`, interpolated in log(flops), clamped at the ends."""
        if not self.gemm_efficiency:
            raise ConfigError(f"Device {self.name!r} has no gemm_efficiency curve, so it cannot be planned for. "
                              f"Add one to its profile or measure it with `trillion plan --calibrate`.")
        sizes = [math.log(s) for s, _ in self.gemm_efficiency]
        x = math.log(max(flops, 1.0))
        i = bisect.bisect_left(sizes, x)
        if i == 0:
            return self.gemm_efficiency[0][1]
        if i == len(sizes):
            return self.gemm_efficiency[-1][1]
        (x0, (_, e0)), (x1, (_, e1)) = (sizes[i - 1], self.gemm_efficiency[i - 1]), (sizes[i], self.gemm_efficiency[i])
        return e0 + (e1 - e0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class Link:
    group: int  # collectives among at most this many GPUs of one node
    bandwidth_gbs: float  # per GPU per direction


@dataclass(frozen=True, eq=False)
class HardwareProfile:
    name: str
    description: str
    device: DeviceSpec
    gpus_per_node: int
    intra_node: tuple[Link, ...]
    node_bandwidth_gbs: float  # network bandwidth of one node per direction, shared by its GPUs
    link_latency_us: float
    network_latency_us: float
    collective_efficiency: float  # achieved share of link bandwidth for large collectives
    node_overhead_w: float
    pue: float
    price_per_gpu_hour: float
    source: str = ""  # the file it came from

    def collective_link(self, group: int, span_nodes: bool) -> tuple[float, float]:
        """(bytes/s, latency s) per GPU for a collective among `group` GPUs.

        A group that spans nodes is limited by each GPU's share of its node's network; one inside a
        node by the slowest link of the smallest listed group that holds it.
        """
        if span_nodes:
            return (self.node_bandwidth_gbs / self.gpus_per_node * 1e9 * self.collective_efficiency,
                    self.network_latency_us * 1e-6)
        link = next((l for l in sorted(self.intra_node, key=lambda l: l.group) if l.group >= group), None)
        if link is None:
            raise ConfigError(f"Hardware profile {self.name!r}: no intra_node link holds a group of {group} GPUs "
                              f"({self.gpus_per_node} per node).")
        return link.bandwidth_gbs * 1e9 * self.collective_efficiency, self.link_latency_us * 1e-6


def _search_dirs() -> list[Path]:
    extra = [Path(p) for p in os.environ.get("TRILLION_HARDWARE_PATH", "").split(os.pathsep) if p]
    return extra + [PROFILE_DIR]


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"Cannot read hardware file {path}: {error}.") from None


def _device_from_table(table: dict, where: str) -> DeviceSpec:
    try:
        return DeviceSpec(
            name=table["name"], peak_tflops=dict(table["peak_tflops"]), memory_gb=float(table["memory_gb"]),
            name_patterns=tuple(table.get("name_patterns", ())),
            memory_bandwidth_gbs=float(table.get("memory_bandwidth_gbs", 0.0)), power_w=float(table.get("power_w", 0.0)),
            gemm_efficiency=tuple(sorted((float(s), float(e)) for s, e in table.get("gemm_efficiency", ()))),
            attention_efficiency=float(table.get("attention_efficiency", 0.0)),
            memory_efficiency=float(table.get("memory_efficiency", 0.0)),
            kernel_overhead_us=float(table.get("kernel_overhead_us", 0.0)),
        )
    except KeyError as missing:
        raise ConfigError(f"{where}: a device needs {missing.args[0]!r} (see {PROFILE_DIR / DEVICES_FILE}).") from None


@cache
def _devices() -> dict[str, DeviceSpec]:
    devices = {}
    for directory in reversed(_search_dirs()):  # user folders come last so they override
        path = directory / DEVICES_FILE
        if path.is_file():
            for table in _read_toml(path).get("device", []):
                devices[table["name"]] = _device_from_table(table, str(path))
    return devices


DEVICES: dict[str, DeviceSpec] = _devices()


def lookup_device(device_name: str) -> DeviceSpec | None:
    """The spec whose name pattern occurs in the driver's device name, or None."""
    lowered = device_name.lower()
    matches = [s for s in DEVICES.values() if any(p in lowered for p in s.name_patterns)]
    # "GH200" also contains "h200": the longest matching pattern is the specific one.
    matches.sort(key=lambda s: -max(len(p) for p in s.name_patterns if p in lowered))
    return matches[0] if matches else None


def profile_names() -> list[str]:
    names = {p.stem for d in _search_dirs() if d.is_dir() for p in d.glob("*.toml") if p.name != DEVICES_FILE}
    return sorted(names)


def load_profile(name_or_path: str) -> HardwareProfile:
    """A machine by name (searched in TRILLION_HARDWARE_PATH, then the shipped profiles) or by file path."""
    path = Path(name_or_path)
    if not (name_or_path.endswith(".toml") and path.is_file()):
        path = next((d / f"{name_or_path}.toml" for d in _search_dirs() if (d / f"{name_or_path}.toml").is_file()), None)
        if path is None or name_or_path == Path(DEVICES_FILE).stem:
            raise ConfigError(f"--hardware {name_or_path!r} is not a known hardware profile. Use one of: "
                              f"{', '.join(profile_names())}, or the path of a profile TOML file.")
    table = _read_toml(path)
    device = table.get("device")
    if isinstance(device, dict):  # a calibrated profile carries its own measured device
        spec = _device_from_table(device, str(path))
    elif device in DEVICES:
        spec = DEVICES[device]
    else:
        raise ConfigError(f"{path}: device {device!r} is not in {DEVICES_FILE}. Known devices: {', '.join(DEVICES)}.")
    try:
        return HardwareProfile(
            name=path.stem, description=table.get("description", ""), device=spec,
            gpus_per_node=int(table["gpus_per_node"]),
            intra_node=tuple(Link(int(l["group"]), float(l["bandwidth_gbs"])) for l in table["intra_node"]),
            node_bandwidth_gbs=float(table["node_bandwidth_gbs"]),
            link_latency_us=float(table.get("link_latency_us", 5.0)),
            network_latency_us=float(table.get("network_latency_us", 10.0)),
            collective_efficiency=float(table.get("collective_efficiency", 0.8)),
            node_overhead_w=float(table.get("node_overhead_w", 0.0)), pue=float(table.get("pue", 1.0)),
            price_per_gpu_hour=float(table.get("price_per_gpu_hour", 0.0)), source=str(path),
        )
    except KeyError as missing:
        raise ConfigError(f"{path}: a hardware profile needs {missing.args[0]!r} "
                          f"(see {PROFILE_DIR / 'frontier.toml'} for an example).") from None
