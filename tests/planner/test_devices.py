"""Device lookup: the driver's name picks the right part and peak, or none at all."""

import pytest

from trillion.devices import DEVICES, lookup_device


@pytest.mark.parametrize(
    "driver_name,device,bf16",
    [
        ("NVIDIA H100 80GB HBM3", "h100", 989.4),
        ("NVIDIA H100 PCIe", "h100-pcie", 756.5),
        ("NVIDIA H100 NVL", "h100-nvl", 835.5),
        ("NVIDIA H200", "h200", 989.4),
        ("NVIDIA H200 NVL", "h200-nvl", 835.5),
        ("NVIDIA GH200 480GB", "gh200", 989.4),
        ("NVIDIA A100-SXM4-80GB", "a100", 312.0),
        ("AMD Instinct MI250X", "mi250x-gcd", 191.5),
        ("AMD Instinct MI250", "mi250-gcd", 181.0),
        ("AMD Instinct MI300X", "mi300x", 1307.4),
    ],
)
def test_variants_get_their_own_peak(driver_name, device, bf16):
    spec = lookup_device(driver_name)
    assert spec.name == device and spec.peak_tflops_bf16 == bf16


def test_a_name_two_parts_share_is_decided_by_compute_units_or_not_at_all():
    """ROCm names both MI250X and MI250 GCDs "AMD Instinct MI250X / MI250" (PCI id 0x740C)."""
    shared = "AMD Instinct MI250X / MI250"
    assert lookup_device(shared) is None
    assert lookup_device(shared, compute_units=110).name == "mi250x-gcd"
    assert lookup_device(shared, compute_units=104).name == "mi250-gcd"
    assert lookup_device(shared, compute_units=96) is None
    assert lookup_device("Intel Arc A770") is None


def test_every_shipped_device_says_where_its_gemm_rate_comes_from():
    """A published plateau in devices.toml or the one fitted scalar of fitted.toml; no curve without a source."""
    planned = [d for d in DEVICES.values() if d.gemm_efficiency]
    assert {"h100", "h100-pcie", "h100-nvl", "h200", "h200-nvl", "a100", "mi250x-gcd", "mi250-gcd", "mi300x"} <= {
        d.name for d in planned
    }
    assert all(len(d.gemm_efficiency) == 1 for d in planned)
