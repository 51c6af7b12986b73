"""MXFP8 (float8.recipe=mxfp8): the routed experts' grouped GEMM against a float64 reference of the same quantisation
(the OCP MX format written out here, apart from kernels/float8_scaling.py), its block scales against torchao's own
MXFP8 cast, the dispatch's wire with one-byte e8m0 scales, the linears it converts and keeps, and the refusals: a GPU
before Blackwell, tensor parallelism, a hardware profile without the format, the 4-bit recipes the trainer cannot
train. Under expert parallelism it is one process's quantisation: tests/float8/test_experts_parity.py."""

import logging

import pytest
import torch

from tests.float8.test_config import fake_gpu, refusal
from trillion.errors import ConfigError
from trillion.kernels import float8_scaling as scaling
from trillion.kernels.float8_grouped_gemm import Float8GroupedMM
from trillion.models import Transformer, get_preset
from trillion.parallel import float8_mx
from trillion.parallel.float8 import convert
from trillion.parallel.float8_dispatch import from_wire, to_wire, wire_bytes_per_row
from trillion.parallel.float8_recipes import check_block_scaled_layout
from trillion.parallel.layout import resolve_float8

E4M3_MAX = 448.0
MX = ["--float8.enabled=true", "--float8.recipe=mxfp8"]


def mx_quantized(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The OCP MX quantisation of x along `dim` in float64: blocks of 32 (the last one short), each scaled by the
    power of two 2^ceil(log2(amax / 448)) (torchao's RCEIL), its elements rounded to e4m3, then scaled back."""
    x = x.double().movedim(dim, -1)
    length = x.shape[-1]
    if x.numel() == 0:
        return x.movedim(-1, dim)
    padded = torch.nn.functional.pad(x, (0, -length % 32))
    blocks = padded.reshape(*padded.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    exponent = torch.ceil(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)) / E4M3_MAX))
    scale = torch.where(amax > 0, 2.0**exponent, torch.ones_like(amax))
    elements = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double()
    return (elements * scale).reshape(padded.shape)[..., :length].movedim(-1, dim)


def grouped_reference(x, weight, dy, ends):
    """(out, dx, dw) in float64 of each group's GEMMs on MX-quantised operands: x and dy along their rows' K and N,
    the weight along K for the output and along N for dx, and the weight gradient's operands along the tokens in
    tiles of 32 restarting at each group."""
    starts = [0, *ends[:-1]]
    out, dx, dw = [], [], []
    for g, (start, end) in enumerate(zip(starts, ends)):
        xg, dyg = x[start:end], dy[start:end]
        out.append(mx_quantized(xg, 1) @ mx_quantized(weight[g], 0))
        dx.append(mx_quantized(dyg, 1) @ mx_quantized(weight[g].t(), 0))
        dw.append(mx_quantized(xg, 0).t() @ mx_quantized(dyg, 0))
    return torch.cat(out), torch.cat(dx), torch.stack(dw)


def test_the_grouped_gemm_is_its_float64_reference_forward_and_both_gradients():
    """Groups of 45, 0, 70 and 13 rows (tiles short and restarting), K 80 and N 48 (blocks of 32 short at the end),
    in fp32: the emulated product's forward, input and weight gradients are the float64 reference's to fp32 rounding;
    and they are not the unquantised product's."""
    torch.manual_seed(0)
    ends = [45, 45, 115, 128]
    x = torch.randn(128, 80, requires_grad=True)
    weight = (torch.randn(4, 80, 48) * 0.2).requires_grad_()
    dy = torch.randn(128, 48)
    out = Float8GroupedMM("mxfp8", emulate=True, impl="loop")(x, weight, torch.tensor(ends, dtype=torch.int32))
    out.backward(dy)
    want_out, want_dx, want_dw = grouped_reference(x.detach(), weight.detach(), dy, ends)
    for got, want in ((out, want_out), (x.grad, want_dx), (weight.grad, want_dw)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    plain = torch.cat([x[s:e] @ weight[g] for g, (s, e) in enumerate(zip([0, *ends[:-1]], ends))])
    assert (out - plain).abs().max() > 1e-2  # the quantisation shows: the comparison above is not vacuous


def test_block_scales_and_elements_are_torchaos_mxfp8_cast():
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    torch.manual_seed(1)
    x = torch.randn(16, 256) * torch.logspace(-3, 3, 256)  # blocks of very different ranges
    data, scale = scaling.quantize_blocks(x, 1, scaling.MX_BLOCK, torch.float8_e4m3fn)
    theirs = MXTensor.to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    assert torch.equal(data.view(torch.uint8), theirs.qdata.view(torch.uint8))
    assert torch.equal(scale, theirs.scale.float().reshape(scale.shape))


def test_the_dispatch_wire_carries_one_e8m0_byte_per_32_elements():
    rows = torch.randn(5, 7168)
    wire = to_wire(rows, "mxfp8", torch.float8_e4m3fn)
    assert wire.shape == (5, 7168 + 224) == (5, wire_bytes_per_row(7168, "mxfp8"))  # 1 + 1/32 bytes per element
    back = from_wire(wire, 7168, "mxfp8", torch.float8_e4m3fn, torch.float32)
    torch.testing.assert_close(back.double(), mx_quantized(rows, 1), rtol=0, atol=0)


def test_linears_of_32_convert_and_the_rest_stay_named(caplog):
    with torch.device("meta"):
        model = Transformer(get_preset("debug-deepseek"))
    with caplog.at_level(logging.INFO, logger="trillion"):
        decisions = convert(model, resolve_float8("mxfp8", fsdp_enabled=False, emulate=True))
    assert isinstance(model.layers["0"].attention.wq_a, float8_mx.MXFP8Linear)
    assert decisions["layers.0.attention.wkv_a"] == "80 x 256: not multiples of the 32-element MX block"
    assert decisions["output"] == "the output projection" and decisions["layers.1.feed_forward.router.gate"]
    assert "float8.experts=mxfp8" in caplog.text and "12 grouped GEMMs" in caplog.text
    assert "MXFP8 (mxfp8 recipe, emulated" in caplog.text and "layers.0.attention.wkv_a (80 x 256" in caplog.text
    only_experts = resolve_float8("mxfp8", fsdp_enabled=False, emulate=True, linears=False)
    with torch.device("meta"):
        model = Transformer(get_preset("debug-deepseek"))
    assert all(reason for reason in convert(model, only_experts).values())  # every linear kept, the experts in MX


def test_an_mxfp8_linear_is_torchaos_and_keeps_nn_linears_state():
    torch.manual_seed(2)
    linear = torch.nn.Linear(64, 96)
    state = {k: v.clone() for k, v in linear.state_dict().items()}
    x = torch.randn(8, 64)
    plain = linear(x)
    linear.__class__, linear.mx_emulated = float8_mx.MXFP8Linear, True
    out = linear(x)
    assert linear.state_dict().keys() == state.keys()
    want = mx_quantized(x, 1) @ mx_quantized(linear.weight.detach(), 1).t() + linear.bias.detach().double()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, plain, atol=1e-3)


def test_mxfp8_is_refused_before_blackwell_and_under_tp(monkeypatch, capsys, tmp_path):
    fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", capability=(9, 0))
    with pytest.raises(ConfigError) as refused:
        float8_mx.check_device(torch.device("cuda", 0), emulate=False)
    assert "NVIDIA Blackwell (sm100" in str(refused.value) and "--float8.emulate=true" in str(refused.value)
    float8_mx.check_device(torch.device("cuda", 0), emulate=True)
    err = refusal(capsys, tmp_path, *MX)  # a CPU without emulation
    assert "float8.recipe=mxfp8 on a cpu" in err and "--float8.recipe=tensorwise" in err
    with pytest.raises(ConfigError, match=r"parallel.tp=2: torchao's MXFP8 linear takes no DTensor"):
        check_block_scaled_layout(2, 4096)
    with pytest.raises(ConfigError, match=r"holds 100 tokens per rank .* not a multiple of the 32-token"):
        check_block_scaled_layout(1, 100)


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--job.hardware=dgx-h100"], "hardware profile 'dgx-h100' (h100) has no mxfp8 matrix units"),
        (["--float8.recipe=nvfp4"], "the trainer cannot train in nvfp4 (torchao 0.18's NVFP4 training runs Triton"),
        (["--float8.recipe=mxfp4"], "the trainer cannot train in mxfp4 (torchao 0.18 has no MXFP4 training path"),
    ],
)
def test_a_format_the_hardware_or_the_trainer_lacks_is_refused_in_one_paragraph(flags, named, capsys, tmp_path):
    err = refusal(capsys, tmp_path, *MX, "--float8.emulate=true", *flags)
    assert named in err and ("choose one of those" in err or "Train with one of" in err), err
