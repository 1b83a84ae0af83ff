"""BEV decoders: BEV features from the view transform (and the fuser) -> the features the task heads read.

- BevDecoder (kind "bev"): the LSS ResNet-18 trunk (conv1, layer1-3) with two up-sampling steps back to full size
  (LSS's BevEncode without its last 1x1 conv, which is the segmentation head); optionally a second up path for the
  detection head (BEVFusion's neck per task), the trunk shared.
- VoxelDecoder3d (kind "voxel3d"): residual Conv3d stages on the (B, C, Z, X, Y) voxels, the coarser levels
  upsampled and fused (BEVDet-Occ's CustomResNet3D + LSSFPN3D in small), for the volumetric occupancy head.

Both give {"shared": features} and, with a branch per task, {task: its features}; `out_channels` is their width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bev.models.camera import Up, resnet_stage
from bev.utils.precision import resolve_channels_last

KINDS = ("bev", "voxel3d")


class BevDecoder(nn.Module):
    """(B, Cin, X, Y) -> {"shared": (B, out_channels, X, Y)} (and "detection" with task_decoders).

    With widths (64, 128, 256) and blocks 2 this is LSS's BevEncode (ResNet-18 conv1 + layer1-3) before its last
    conv; narrower widths give the cheap CPU variant with the same shape. channels_last: as in
    bev.models.camera.CameraEncoder (NHWC convolutions, default-layout input).
    """

    volumetric = False

    def __init__(
        self,
        in_channels: int,
        widths: Sequence[int] = (64, 128, 256),
        blocks: int = 2,
        channels_last: bool | str = False,
        task_decoders: bool = False,
        stem_kernel: int = 7,
        half_res_tail: bool = False,
    ):
        super().__init__()
        if len(widths) != 3:
            raise ValueError(f"model.net.decoder needs 3 widths, got {list(widths)}")
        if stem_kernel not in (3, 5, 7):
            raise ValueError(f"model.net.decoder.stem_kernel must be 3, 5 or 7, got {stem_kernel!r}")
        w0, w1, w2 = widths
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, w0, stem_kernel, stride=2, padding=stem_kernel // 2, bias=False),
            nn.BatchNorm2d(w0),
            nn.ReLU(inplace=True),
        )
        # half_res_tail: the last conv at half the grid, its features upsampled to it (a quarter of its cost)
        self.half_res_tail = bool(half_res_tail)
        self.layer1 = resnet_stage(w0, w0, blocks, 1)
        self.layer2 = resnet_stage(w0, w1, blocks, 2)
        self.layer3 = resnet_stage(w1, w2, blocks, 2)
        self.up1 = Up(w2 + w0, w2)
        self.up2 = self._tail(w2, w1)
        self.out_channels = w1
        # task_decoders: a second up path of the same shape for the detection head (BEVFusion's neck per task).
        self.det_up1 = Up(w2 + w0, w2) if task_decoders else None
        self.det_up2 = self._tail(w2, w1) if task_decoders else None
        # Zero-init the last BN of each residual block (torchvision's zero_init_residual), as LSS does.
        for m in self.modules():
            if hasattr(m, "bn2") and isinstance(m.bn2, nn.BatchNorm2d):
                nn.init.zeros_(m.bn2.weight)
        self.channels_last = resolve_channels_last(channels_last, self)
        if self.channels_last:
            self.to(memory_format=torch.channels_last)

    @staticmethod
    def _tail(w2: int, w1: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(w2, w1, 3, padding=1, bias=False), nn.BatchNorm2d(w1), nn.ReLU(inplace=True))

    def widen_input(self, copies: int) -> None:
        """Take `copies` inputs concatenated on channels (BEVDet4D's aligned frames, the present last): the stem
        conv reads all of them, its weights on the last copy as before and zero on the others, so the decoder
        starts out reading the last copy alone."""
        old = self.stem[0]
        new = nn.Conv2d(
            old.in_channels * copies, old.out_channels, old.kernel_size, old.stride, old.padding, bias=False
        )
        with torch.no_grad():
            new.weight.zero_()
            new.weight[:, -old.in_channels :] = old.weight
        self.stem[0] = new.to(memory_format=torch.channels_last) if self.channels_last else new

    def load_last_copy(self, weight: torch.Tensor, copies: int) -> bool:
        """A single-input decoder's stem weight (O, C, k, k) on the last of `copies` inputs (the present frame)
        and zero on the others, so the decoder starts as that one; False if it does not fit."""
        conv = self.stem[0]
        present = conv.in_channels // copies
        if tuple(weight.shape) != (conv.out_channels, present, *conv.kernel_size):
            return False
        with torch.no_grad():
            conv.weight.zero_()
            conv.weight[:, -present:] = weight.to(conv.weight.dtype)
        return True

    def copy_shared_to_detection(self) -> None:
        """Start the detection up path as a copy of the shared one (a checkpoint without one has only that)."""
        with torch.no_grad():
            for mine, theirs in ((self.det_up1, self.up1), (self.det_up2, self.up2)):
                for a, b in zip(mine.state_dict().values(), theirs.state_dict().values()):
                    a.copy_(b)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        size = x.shape[-2:]
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x1 = self.layer1(self.stem(x))
        x3 = self.layer3(self.layer2(x1))
        out = {"shared": self._up(self.up1(x3, x1), self.up2, size)}
        if self.det_up1 is not None:
            out["detection"] = self._up(self.det_up1(x3, x1), self.det_up2, size)
        return out

    def _up(self, x: torch.Tensor, tail: nn.Module, size) -> torch.Tensor:
        if self.half_res_tail:
            return F.interpolate(tail(x), size=size, mode="bilinear", align_corners=True)
        return tail(F.interpolate(x, size=size, mode="bilinear", align_corners=True))


class ResBlock3d(nn.Module):
    """A 3D BasicBlock: two 3x3x3 conv-BN, a 1x1x1 projection when the shape changes, ReLU after the sum."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv3d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm3d(cout)
        self.conv2 = nn.Conv3d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm3d(cout)
        nn.init.zeros_(self.bn2.weight)  # each block starts as the identity (zero_init_residual)
        same = cin == cout and stride == 1
        self.skip = (
            nn.Identity() if same else nn.Sequential(nn.Conv3d(cin, cout, 1, stride, bias=False), nn.BatchNorm3d(cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)), inplace=True)))
        return F.relu(y + self.skip(x), inplace=True)


class VoxelDecoder3d(nn.Module):
    """(B, C * Z, X, Y) lifted voxels, read as (B, C, Z, X, Y) -> {"shared": (B, out_channels, Z, X, Y)}: stages of
    ResBlock3d at strides 1, 2, 2 (widths, blocks per stage), each coarser level upsampled (trilinear) to the
    first, all concatenated and fused by a 3x3x3 conv-BN-ReLU (BEVDet-Occ: widths 32/64/128, blocks 1/2/4).
    In fp32 even under autocast: with CPU bf16 the 3D part diverged to NaN within a few steps."""

    volumetric = True

    def __init__(
        self,
        in_channels: int,
        heights: int,
        widths: Sequence[int] = (32, 64, 128),
        blocks: Sequence[int] = (1, 2, 4),
        channels: int = 32,
        channels_last: bool | str = False,
    ):
        super().__init__()
        if channels_last not in (False, "auto"):  # auto: where NHWC pays, which is not measured for 3D convs
            raise ValueError("model.net.decoder.channels_last: the voxel3d decoder runs NCDHW; set false or auto")
        if len(widths) != len(blocks) or not widths:
            raise ValueError(
                f"model.net.decoder: widths {list(widths)} and blocks {list(blocks)} need one entry per stage"
            )
        if in_channels % heights:
            raise ValueError(f"{in_channels} input channels are not a whole number per height bin ({heights})")
        self.heights, self.out_channels = int(heights), int(channels)
        stages, cin = [], in_channels // heights
        for s, (w, n) in enumerate(zip(widths, blocks)):
            layers = [ResBlock3d(cin, w, 1 if s == 0 else 2)] + [ResBlock3d(w, w) for _ in range(int(n) - 1)]
            stages.append(nn.Sequential(*layers))
            cin = w
        self.stages = nn.ModuleList(stages)
        self.fuse = nn.Sequential(
            nn.Conv3d(sum(widths), channels, 3, padding=1, bias=False), nn.BatchNorm3d(channels), nn.ReLU(True)
        )

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        B, _, X, Y = x.shape
        with torch.autocast(x.device.type, enabled=False):
            x = x.float().view(B, -1, self.heights, X, Y)
            levels = []
            for stage in self.stages:
                x = stage(x)
                levels.append(x)
            size = levels[0].shape[-3:]
            up = [levels[0]] + [F.interpolate(f, size=size, mode="trilinear", align_corners=False) for f in levels[1:]]
            return {"shared": self.fuse(torch.cat(up, 1))}


def build_decoder(in_channels: int, heights: int, kind: str = "bev", **options) -> nn.Module:
    """The decoder of model.net.decoder: kind "bev" (BevDecoder's options) or "voxel3d" (VoxelDecoder3d's)."""
    if kind == "bev":
        return BevDecoder(in_channels, **options)
    if kind == "voxel3d":
        return VoxelDecoder3d(in_channels, heights, **options)
    raise ValueError(f"model.net.decoder.kind must be one of {', '.join(KINDS)}, got {kind!r}")
