"""The camera encoder at FIERY's stride 8 (model.net.camera.downsample=8) beside the LSS stride 16."""

from __future__ import annotations

import pytest
import torch

from bev.models import CameraEncoder
from helpers.models import GRID, SIZE, TINY_NET, lss_net, model_inputs

# Channels at strides 8 and 16 of each trunk, as torchvision builds them (EfficientNet stages 3 and 5,
# ResNet layer2 and layer3) and as the small trunk's widths[2:4] say.
STAGES = {
    "efficientnet_b0": (40, 112),
    "efficientnet_b4": (56, 160),
    "resnet18": (128, 256),
    "small": (48, 64),
}


@pytest.mark.parametrize("backbone", list(STAGES))
def test_stride8_fuses_stride16_into_stride8_features(backbone):
    torch.manual_seed(0)
    enc = CameraEncoder(depth_bins=5, context_channels=7, backbone=backbone, mid_channels=16, stride=8).eval()
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        out = enc(x)
        skip, deep = enc.trunk(x, 8)
        stem = enc.trunk.stem(x)
        s8 = enc.trunk.to16[: enc.trunk.split8](stem)  # the trunk's first stages, run by hand
    assert out.shape == (1, 12, 8, 12)
    assert (skip.shape[1], deep.shape[1]) == STAGES[backbone]
    assert skip.shape[-2:] == (8, 12) and deep.shape[-2:] == (4, 6)
    torch.testing.assert_close(skip, s8, rtol=0, atol=0)
    torch.testing.assert_close(deep, enc.trunk.to16[enc.trunk.split8 :](s8), rtol=0, atol=0)
    # The stride-32 stage never runs at stride 8: it is not built, so no parameter goes without a gradient.
    assert not hasattr(enc.trunk, "to32")
    assert enc.fuse.conv[0].in_channels == sum(STAGES[backbone])


def test_stride16_is_unchanged_by_the_option():
    enc = CameraEncoder(depth_bins=5, context_channels=7, backbone="small", widths=(8, 8, 16, 16, 24), mid_channels=16)
    assert enc.stride == 16 and hasattr(enc.trunk, "to32")
    assert enc(torch.randn(1, 3, 64, 96)).shape == (1, 12, 4, 6)
    assert enc.fuse.conv[0].in_channels == 16 + 24  # stride 16 + stride 32, as before
    assert not any(k.startswith("trunk.stem") for k in CameraEncoder(5, 7, backbone="resnet18").state_dict())


def test_lss_at_stride8_lifts_four_times_the_points():
    torch.manual_seed(0)
    nets = {s: lss_net(GRID, SIZE, downsample=s, **TINY_NET) for s in (16, 8)}
    assert nets[8].camera.frustum.shape[1:3] == (SIZE[0] // 8, SIZE[1] // 8)
    assert nets[8].camera.frustum[..., 0].numel() == 4 * nets[16].camera.frustum[..., 0].numel()
    x = model_inputs()
    out = nets[8](*x)
    out, depth = out["segmentation"], out["depth"]
    assert out.shape == (2, 1, *GRID.bev_shape)
    assert depth.shape == (2, 6, GRID.depth_bins, SIZE[0] // 8, SIZE[1] // 8)
    out.mean().backward()
    assert all(p.grad is not None for p in nets[8].camera.encoder.parameters())


@pytest.mark.parametrize("stride", [4, 32])
def test_other_strides_are_refused_with_the_choices(stride):
    with pytest.raises(ValueError, match="downsample must be 8 or 16"):
        lss_net(GRID, SIZE, downsample=stride, **TINY_NET)
    with pytest.raises(ValueError, match="stride 8 or 16"):
        CameraEncoder(5, 7, backbone="small", stride=stride)
