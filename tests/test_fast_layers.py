"""bev.models.fast_layers: the CPU-bf16 replacements compute what the layers they replace compute."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn
from torchvision.ops.misc import SqueezeExcitation

from bev.models import CameraEncoder
from bev.models.fast_layers import (
    FP32GradDepthwiseConv2d,
    GlobalAvgPool,
    _SpatialMean,
    fast_global_pools,
    fp32_depthwise,
    slow_bf16_depthwise,
    spatial_mean,
)
from bev.utils import precision as P

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "conv, slow",
    [
        (nn.Conv2d(8, 8, 5, groups=8), True),
        (nn.Conv2d(8, 8, 3, stride=2, groups=8), True),
        (nn.Conv2d(8, 8, 3, groups=8), False),  # oneDNN has a bf16 depthwise backward kernel for 3x3 stride 1
        (nn.Conv2d(8, 8, 5, groups=4), False),  # grouped, not depthwise
        (nn.Conv2d(8, 16, 5, groups=8), False),  # depth multiplier 2
        (nn.Conv2d(8, 8, 5), False),
        (nn.Linear(8, 8), False),
    ],
)
def test_which_depthwise_convolutions_get_fp32_gradients(conv, slow):
    assert slow_bf16_depthwise(conv) is slow


@pytest.mark.parametrize("bias, channels_last", [(False, True), (True, False)])
def test_fp32_depthwise_convolution_computes_its_gradients_in_fp32(bias, channels_last):
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 6, 5, stride=2, padding=2, groups=6, bias=bias)
    ref = nn.Conv2d(6, 6, 5, stride=2, padding=2, groups=6, bias=bias)
    ref.load_state_dict(conv.state_dict())
    assert fp32_depthwise(nn.Sequential(conv)) == ["0"] and type(conv) is FP32GradDepthwiseConv2d
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    conv, ref = conv.to(memory_format=fmt), ref.to(memory_format=fmt)
    x = torch.randn(2, 6, 11, 13).contiguous(memory_format=fmt)
    torch.testing.assert_close(conv(x), ref(x), rtol=0, atol=0)  # a plain Conv2d without autocast
    xb = x.bfloat16().requires_grad_()
    with torch.autocast(**BF16):
        out, plain = conv(xb), ref(xb.detach())
        with torch.no_grad():
            assert torch.equal(conv(xb), plain)  # no gradients: the plain autocast convolution
        assert conv(x).dtype == torch.bfloat16  # an fp32 input comes out bf16, as from autocast
    assert torch.equal(out, plain)  # the forward is the autocast convolution's own
    g = torch.cos(out.detach().float()).bfloat16()
    out.backward(g)
    # the gradients of an fp32 convolution of the bf16 values the forward used (input and weight
    # rounded to bf16), the input's gradient rounded to bf16
    with torch.no_grad():
        ref.weight.copy_(ref.weight.bfloat16().float())
    xf = xb.detach().float().requires_grad_()
    want = torch.autograd.grad(ref(xf), [xf, *ref.parameters()], g.float())
    assert xb.grad.dtype == torch.bfloat16 and conv.weight.grad.dtype == torch.float32
    torch.testing.assert_close(xb.grad, want[0].bfloat16(), rtol=0, atol=0)
    for got, w in zip([p.grad for p in conv.parameters()], want[1:]):
        torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6)


def test_only_plain_zero_padded_depthwise_convolutions_are_swapped():
    assert not slow_bf16_depthwise(nn.Conv2d(8, 8, 5, padding="same", groups=8))
    assert not slow_bf16_depthwise(nn.Conv2d(8, 8, 5, padding=2, padding_mode="reflect", groups=8))


@pytest.mark.parametrize("channels_last", [False, True])
def test_spatial_mean_matches_a_float64_mean(channels_last):
    torch.manual_seed(0)
    x = torch.randn(3, 20, 17, 33) + 0.5
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    assert torch.equal(spatial_mean(x), x.mean((2, 3), keepdim=True))  # fp32: ATen's own mean
    assert torch.equal(spatial_mean(x[0].bfloat16()), x[0].bfloat16().mean((1, 2), keepdim=True))  # (C, H, W) too
    xb = x.bfloat16()
    want = xb.double().mean((2, 3), keepdim=True)
    got = spatial_mean(xb)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 20, 1, 1)
    # fp32 accumulation, the sum rounded to bf16, divided in fp32, rounded again: two bf16 roundings
    # (unit roundoff 2^-8 each) from the exact mean, where ATen's bf16 mean rounds once
    assert ((got.double() - want).abs() <= want.abs() * 2 * 2**-8).all()
    assert ((xb.mean((2, 3), keepdim=True).double() - want).abs() <= want.abs() * 2**-8).all()


def test_global_pool_gradient_is_the_mean_gradient():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_SpatialMean.apply, (x,))
    g = torch.autograd.grad(_SpatialMean.apply(x).sum(), x)[0]
    assert g.stride()[2:] == (0, 0)  # expanded: no full-size tensor written before it is accumulated
    torch.testing.assert_close(g, torch.autograd.grad(x.mean((2, 3)).sum(), x)[0], rtol=0, atol=0)


@pytest.mark.parametrize("channels_last", [False, True])
def test_squeeze_excitation_with_the_fast_pool_is_unchanged(channels_last):
    torch.manual_seed(0)
    ref = SqueezeExcitation(24, 6, activation=nn.SiLU)
    se = SqueezeExcitation(24, 6, activation=nn.SiLU)
    se.load_state_dict(ref.state_dict())
    assert fast_global_pools(se) == 1 and isinstance(se.avgpool, GlobalAvgPool)
    assert se.state_dict().keys() == ref.state_dict().keys()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(2, 24, 9, 14).contiguous(memory_format=fmt)
    grads = []
    for m in (ref, se):
        xi = x.clone().requires_grad_()
        out = m(xi)
        out.backward(torch.cos(out.detach()))
        grads.append((out, xi.grad, m.fc1.weight.grad))
    for a, b in zip(*grads):  # fp32: the same arithmetic
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    xb = x.bfloat16().requires_grad_()
    with torch.autocast(**BF16):
        out, want = se(xb), ref(xb)
    torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=1e-3)
    out.float().sum().backward()
    assert xb.grad.shape == x.shape and torch.isfinite(xb.grad.float()).all()


def test_efficientnet_camera_encoder_keeps_its_parameters_and_function(monkeypatch):
    monkeypatch.setattr(P, "_cpu_flags", lambda: {"avx512_bf16"})
    torch.manual_seed(0)
    fast = CameraEncoder(5, 7, backbone="efficientnet_b0", mid_channels=16).eval()
    plain = CameraEncoder(5, 7, backbone="efficientnet_b0", mid_channels=16, depthwise_fp32=False).eval()
    # 16 squeeze-excitation pools; the 11 depthwise convolutions that are 5x5 or strided
    assert sum(isinstance(m, GlobalAvgPool) for m in fast.modules()) == 16
    assert len(fast.fp32_depthwise) == 11 and plain.fp32_depthwise == []
    reference = torchvision.models.efficientnet_b0()
    assert fast.trunk.to16.state_dict().keys() == reference.features[:6].state_dict().keys()
    plain.load_state_dict(fast.state_dict())
    x = torch.randn(1, 3, 64, 96)
    torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)


def test_depthwise_fp32_auto_of_older_configs_means_on_and_a_bad_value_is_named():
    def swapped(value):
        return len(
            CameraEncoder(5, 7, backbone="efficientnet_b0", mid_channels=16, depthwise_fp32=value).fp32_depthwise
        )

    assert swapped("auto") == swapped(True) > 0 and swapped(False) == 0
    with pytest.raises(ValueError, match="depthwise_fp32 must be true or false"):
        swapped("fp32")
