"""Machines built from accelerators, as data (experiments/frontier/PAPER.md "Hardware figures"): a device from
trillion/devices.toml, GPUs per node, the links inside a node and between nodes, power overheads,
price, in hardware_profiles/<name>.toml. Users add machines by putting TOML files in a folder
named by TRILLION_HARDWARE_PATH (colon-separated) or by passing a file's path; `trillion plan
--calibrate` writes one for the machine it runs on.

A node is a host: its GPUs share its NICs (node_bandwidth_gbs) and its power overhead. The scale-up domain
(`scale_up_gpus`, default the node) is the GPUs its `intra_node` links join at their speed: one node on a DGX or
an MI355X platform, 72 GPUs of 18 hosts on an NVL72 rack, whose NVLink switches join them all. The planner's
collectives, tensor- and context-parallel degrees and expert dispatch see the domain; only a group that spans
domains goes over the network, through the NICs of the GPUs it holds.
"""

from dataclasses import dataclass
from pathlib import Path

from trillion.devices import (
    DEVICES,
    DEVICES_FILE,
    LOW_PRECISION_FORMATS,
    DeviceSpec,
    device_from_table,
    read_toml,
    search_dirs,
)
from trillion.errors import ConfigError

PROFILE_DIR = Path(__file__).with_name("hardware_profiles")


COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Link:
    group: int  # collectives among at most this many GPUs of one node
    bandwidth_gbs: float  # per GPU per direction
    # ((kind, bandwidth_gbs, latency_us), ...) measured for one collective kind by `trillion plan
    # --calibrate --model` (TP's all-gather and reduce-scatter as the trainer issues them); a kind
    # not listed follows the all-reduce figures (ring model)
    kinds: tuple = ()


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
    compute_dtype: str = "bf16"  # what activations are computed in: bf16 on GPUs, fp32 on a CPU
    # (forward, backward) host seconds DTensor adds to a block under TP beyond its collectives:
    # measured by `trillion plan --calibrate --model` (measure.tp_layer_host_seconds), else 0
    tp_layer_host_s: tuple[float, float] = (0.0, 0.0)
    # collectives run beside compute (copy engines, NICs); false on a CPU, whose cores do both
    overlaps_collectives: bool = True
    scale_up_gpus: int = 0  # GPUs the intra_node links join (an NVLink domain); 0: one node's

    @property
    def scale_up(self) -> int:
        """GPUs joined at the intra_node links' speed: the scale-up domain, one node unless the profile names more."""
        return self.scale_up_gpus or self.gpus_per_node

    @property
    def element_bytes(self) -> int:
        return 4 if self.compute_dtype == "fp32" else 2

    def collective_link(self, group: int, span_nodes: bool, kind: str = "all_reduce") -> tuple[float, float]:
        """(bytes/s, latency s) per GPU for a collective of `kind` among `group` GPUs.

        A group that spans scale-up domains is limited by each GPU's share of its node's network; one inside a
        domain by the slowest link of the smallest listed group that holds it, with the figures
        measured for that kind of collective when the link has them.
        """
        if span_nodes:
            return (
                self.node_bandwidth_gbs / self.gpus_per_node * 1e9 * self.collective_efficiency,
                self.network_latency_us * 1e-6,
            )
        link = next((c for c in sorted(self.intra_node, key=lambda c: c.group) if c.group >= group), None)
        if link is None:
            raise ConfigError(
                f"Hardware profile {self.name!r}: no intra_node link holds a group of {group} GPUs "
                f"({self.scale_up} in its scale-up domain)."
            )
        bandwidth_gbs, latency_us = next(
            ((b, lat) for k, b, lat in link.kinds if k == kind), (link.bandwidth_gbs, self.link_latency_us)
        )
        return bandwidth_gbs * 1e9 * self.collective_efficiency, latency_us * 1e-6


FORMAT_NAMES = {"fp8": "float8 (fp8)"}  # how a refusal names a format


def low_precision_peak_tflops(hw: HardwareProfile, fmt: str = "fp8", setting: str = "--float8") -> float:
    """The device's dense peak in `fmt` (devices.toml peak_tflops.<fmt>: fp8, mxfp8, nvfp4, mxfp4), checked to come
    with its GEMM plateau; a ConfigError naming the hardware, the format and the fix where its matrix units lack the
    format (A100 and MI250X have no float8 at all, Hopper and CDNA3 no block-scaled formats, CDNA4 no NVFP4)."""
    device = hw.device
    peak = device.peak_tflops.get(fmt, 0.0)
    if peak <= 0:
        having = [n for n, d in DEVICES.items() if d.peak_tflops.get(fmt)]
        its = [f for f in LOW_PRECISION_FORMATS if device.peak_tflops.get(f)]
        raise ConfigError(
            f"{setting}: hardware profile {hw.name!r} ({device.name}) has no {FORMAT_NAMES.get(fmt, fmt)} matrix "
            f"units (no {fmt} peak in "
            f"{DEVICES_FILE} or its profile), so its GEMMs cannot run in {fmt}. "
            + (f"Its formats below bf16: {', '.join(its)}; choose one of those, or " if its else "Use bf16, or ")
            + f"hardware that has {fmt} ({', '.join(having) or 'none shipped'})."
        )
    if not device.format_gemm_efficiency.get(fmt):
        raise ConfigError(
            f"{setting}: hardware profile {hw.name!r} ({device.name}) has a {fmt} peak but no {fmt}_gemm_efficiency "
            f"(the large {fmt} GEMM's share of that peak); add one to its device table, with its source."
        )
    return float(peak)


def _link(entry: dict, path: Path) -> Link:
    kinds = tuple(
        (kind, float(entry[kind]["bandwidth_gbs"]), float(entry[kind]["latency_us"]))
        for kind in COLLECTIVE_KINDS
        if kind in entry
    )
    unknown = set(entry) - {"group", "bandwidth_gbs", *COLLECTIVE_KINDS}
    if unknown:
        raise ConfigError(
            f"{path}: intra_node entry has {', '.join(sorted(unknown))}; an entry holds group, "
            f"bandwidth_gbs and optionally {', '.join(COLLECTIVE_KINDS)} (each bandwidth_gbs, latency_us)."
        )
    return Link(int(entry["group"]), float(entry["bandwidth_gbs"]), kinds)


def _search_dirs() -> list[Path]:
    return search_dirs() + [PROFILE_DIR]


def profile_names() -> list[str]:
    names = {p.stem for d in _search_dirs() if d.is_dir() for p in d.glob("*.toml") if p.name != DEVICES_FILE.name}
    return sorted(names)


def load_profile(name_or_path: str) -> HardwareProfile:
    """A machine by name (searched in TRILLION_HARDWARE_PATH, then the shipped profiles) or by file path."""
    path = Path(name_or_path)
    if not (name_or_path.endswith(".toml") and path.is_file()):
        path = next(
            (d / f"{name_or_path}.toml" for d in _search_dirs() if (d / f"{name_or_path}.toml").is_file()), None
        )
        if path is None or name_or_path == DEVICES_FILE.stem:
            raise ConfigError(
                f"--hardware {name_or_path!r} is not a known hardware profile. Use one of: "
                f"{', '.join(profile_names())}, or the path of a profile TOML file."
            )
    table = read_toml(path)
    device = table.get("device")
    if isinstance(device, dict):  # a calibrated profile carries its own measured device
        spec = device_from_table(device, str(path))
    elif device in DEVICES:
        spec = DEVICES[device]
    else:
        raise ConfigError(f"{path}: device {device!r} is not in {DEVICES_FILE}. Known devices: {', '.join(DEVICES)}.")
    try:
        return HardwareProfile(
            name=path.stem,
            description=table.get("description", ""),
            device=spec,
            gpus_per_node=int(table["gpus_per_node"]),
            intra_node=tuple(_link(entry, path) for entry in table["intra_node"]),
            node_bandwidth_gbs=float(table["node_bandwidth_gbs"]),
            link_latency_us=float(table.get("link_latency_us", 5.0)),
            network_latency_us=float(table.get("network_latency_us", 10.0)),
            collective_efficiency=float(table.get("collective_efficiency", 0.8)),
            node_overhead_w=float(table.get("node_overhead_w", 0.0)),
            pue=float(table.get("pue", 1.0)),
            price_per_gpu_hour=float(table.get("price_per_gpu_hour", 0.0)),
            source=str(path),
            compute_dtype=str(table.get("compute_dtype", "bf16")),
            overlaps_collectives=bool(table.get("overlaps_collectives", True)),
            scale_up_gpus=int(table.get("scale_up_gpus", 0)),
            tp_layer_host_s=tuple(
                float(table.get("tp_layer_host_us", {}).get(p, 0.0)) * 1e-6 for p in ("forward", "backward")
            ),
        )
    except KeyError as missing:
        raise ConfigError(
            f"{path}: a hardware profile needs {missing.args[0]!r} "
            f"(see {PROFILE_DIR / 'frontier.toml'} for an example)."
        ) from None
