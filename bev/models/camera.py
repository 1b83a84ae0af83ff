"""Camera encoder: image trunk -> stride-16 (or stride-8) features -> D depth logits + C context channels.

As in Lift-Splat-Shoot, the stride-32 features are upsampled and fused with the stride-16 ones
before a 1x1 head, so every stride-16 cell sees a wide receptive field. At stride 8 (FIERY's
setting) the trunk stops at stride 16 and those features are fused with the stride-8 ones instead:
4x the frustum points of stride 16, no stride-32 stage.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.models.resnet import BasicBlock

from bev.models.fast_layers import fast_global_pools, fp32_depthwise
from bev.utils.precision import resolve_channels_last

BACKBONES = ("efficientnet_b0", "efficientnet_b4", "resnet18", "resnet50", "small")
STRIDES = (8, 16)  # feature strides the encoder gives (bev.geometry.FEATURE_STRIDE is the default)
# EfficientNet: features[3] ends stride 8, [5] stride 16, [7] stride 32 ([8] is the wide 1x1 head, unused)
EFFICIENTNET_CHANNELS = {"efficientnet_b0": (40, 112, 320), "efficientnet_b4": (56, 160, 448)}


class BackboneWeightsError(RuntimeError):
    """Pretrained weights were asked for but cannot be loaded (offline, bad file, wrong backbone)."""


class Up(nn.Module):
    """Upsample `x` to the size of `skip`, concatenate, two 3x3 conv-BN-ReLU (the LSS `Up`)."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
        )

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=True)
        return self.conv(torch.cat([skip, x], dim=1))


def resnet_stage(in_channels: int, out_channels: int, blocks: int, stride: int) -> nn.Sequential:
    """A torchvision-style ResNet stage of BasicBlocks with any width (the first block may stride)."""
    down = None
    if stride != 1 or in_channels != out_channels:
        down = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
        )
    layers = [BasicBlock(in_channels, out_channels, stride=stride, downsample=down)]
    layers += [BasicBlock(out_channels, out_channels) for _ in range(blocks - 1)]
    return nn.Sequential(*layers)


class Trunk(nn.Module):
    """stem, to16 and to32: features at strides 8 (after to16[:split8]), 16 and 32, of self.channels."""

    split8: int

    def forward(self, x: torch.Tensor, stride: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
        """(features at `stride`, at 2 x `stride`): the skip and the deep input of the encoder's fusion."""
        x = self.stem(x)
        for i, stage in enumerate(self.to16):
            if i == self.split8:
                s8 = x
            x = stage(x)
        return (s8, x) if stride == 8 else (x, self.to32(x))

    def drop_stride32(self) -> None:
        """Remove the stride-32 stage (unused at stride 8: no dead parameters for the optimiser or DDP)."""
        del self.to32


class SmallTrunk(Trunk):
    """A narrow ResNet-like trunk for CPU runs: five stride-2 stages of `widths` channels."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 48, 64, 96), blocks: int = 1):
        super().__init__()
        if len(widths) != 5:
            raise ValueError(f"small backbone needs 5 widths (strides 2..32), got {list(widths)}")
        w = list(widths)
        self.stem = nn.Sequential(
            nn.Conv2d(3, w[0], 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(w[0]), nn.ReLU(inplace=True)
        )
        self.to16 = nn.Sequential(*[resnet_stage(w[i], w[i + 1], blocks, 2) for i in range(3)])
        self.to32 = resnet_stage(w[3], w[4], blocks, 2)
        self.channels = (w[2], w[3], w[4])
        self.split8 = 2


class TorchvisionTrunk(Trunk):
    """EfficientNet-B0 / B4 or ResNet trunk from torchvision, cut at strides 16 and 32."""

    def __init__(self, name: str, weights: str | None = None, weights_path: str | None = None):
        super().__init__()
        net = _load_torchvision(name, weights, weights_path)
        if name in EFFICIENTNET_CHANNELS:
            self.stem = nn.Identity()  # no parameters: the state_dict keys are unchanged
            self.to16, self.to32 = net.features[:6], net.features[6:8]
            self.channels, self.split8 = EFFICIENTNET_CHANNELS[name], 4
        else:
            self.stem = nn.Identity()
            self.to16 = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1, net.layer2, net.layer3)
            self.to32 = net.layer4
            expansion = 4 if name == "resnet50" else 1
            self.channels, self.split8 = (128 * expansion, 256 * expansion, 512 * expansion), 6


def _load_torchvision(name: str, weights: str | None, weights_path: str | None) -> nn.Module:
    builder = getattr(torchvision.models, name)
    net = builder(weights=None)
    if weights_path:
        path = Path(weights_path).expanduser()
        if not path.is_file():
            raise BackboneWeightsError(f"weights_path {str(path)!r} does not exist.")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            state = state.get("state_dict", state)
            net.load_state_dict(state)
        except Exception as e:  # any unreadable or mismatched file gets the same clear message
            raise BackboneWeightsError(
                f"could not load {name} weights from {str(path)!r} ({type(e).__name__}: {str(e).splitlines()[0][:200]}). "
                f"Expected a torchvision {name} state_dict."
            ) from None
    elif weights:
        if str(weights).lower() != "imagenet":
            raise BackboneWeightsError(f"weights must be 'imagenet' or null, got {weights!r}")
        try:
            net = builder(weights="DEFAULT")
        except Exception as e:  # URLError, SSL, HTTP errors: all mean "could not download"
            raise BackboneWeightsError(
                f"could not get ImageNet weights for {name} ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}). "
                f"Without internet set model.net.camera.weights=null (random init) or "
                f"model.net.camera.weights_path=/path/to/{name}.pth (a torchvision state_dict)."
            ) from None
    return net


class CameraEncoder(nn.Module):
    """Images (M, 3, H, W) -> (M, D + C, H/stride, W/stride): D depth logits then C context channels.

    stride 16 (LSS) fuses the trunk's stride-32 features into its stride-16 ones; stride 8 (FIERY,
    which also narrows mid_channels to 128) fuses stride 16 into stride 8.

    channels_last runs the convolutions in NHWC (faster oneDNN/cuDNN kernels); inputs and the
    output stay in the default layout, so callers and checkpoints do not change. depthwise_fp32
    computes the gradients of the depthwise convolutions that oneDNN's bf16 backward handles slowly
    in fp32 under CPU bf16 autocast (bev.models.fast_layers); "auto", which older configs stored, means on.
    """

    def __init__(
        self,
        depth_bins: int,
        context_channels: int,
        backbone: str = "efficientnet_b0",
        weights: str | None = None,
        weights_path: str | None = None,
        widths: tuple[int, ...] = (16, 32, 48, 64, 96),
        blocks: int = 1,
        mid_channels: int = 512,
        channels_last: bool | str = False,
        depthwise_fp32: bool | str = True,
        stride: int = 16,
    ):
        super().__init__()
        if backbone not in BACKBONES:
            raise ValueError(f"unknown backbone {backbone!r}; choose one of {', '.join(BACKBONES)}")
        if stride not in STRIDES:
            raise ValueError(
                f"the camera encoder gives features at stride 8 or 16 (model.net.camera.downsample), got {stride}"
            )
        self.stride = int(stride)
        if backbone == "small":
            if weights or weights_path:
                raise BackboneWeightsError("the 'small' backbone has no pretrained weights; set weights=null")
            self.trunk = SmallTrunk(tuple(widths), blocks)
        else:
            self.trunk = TorchvisionTrunk(backbone, weights, weights_path)
        skip, deep = self.trunk.channels[:2] if stride == 8 else self.trunk.channels[1:]
        if stride == 8:
            self.trunk.drop_stride32()
        self.fuse = Up(skip + deep, mid_channels)
        self.head = nn.Conv2d(mid_channels, depth_bins + context_channels, 1)
        self.depth_bins = depth_bins
        fast_global_pools(self.trunk)
        if depthwise_fp32 not in (True, False, "auto"):
            raise ValueError(f"depthwise_fp32 must be true or false, got {depthwise_fp32!r}")
        self.fp32_depthwise = fp32_depthwise(self.trunk) if depthwise_fp32 else []
        self.channels_last = resolve_channels_last(channels_last, self)
        if self.channels_last:
            self.to(memory_format=torch.channels_last)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        skip, deep = self.trunk(images, self.stride)
        return self.head(self.fuse(deep, skip)).contiguous()
