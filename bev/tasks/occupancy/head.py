"""Occupancy heads: decoder features -> (B, 18, 200, 200, 16) Occ3D logits indexed [x, y, z] as Occ3D's arrays
(bev.tasks.occupancy.grid). Two kinds, after the decoder they read:

- voxel3d (BEVDet-Occ's BEVOCCHead3D): on a 3D decoder's (B, C, Z, X, Y) features a 3x3x3 conv-ReLU, then per
  voxel Linear-Softplus-Linear as 1x1x1 convs.
- channel_to_height (FlashOcc's BEVOCCHead2D): on a 2D decoder's (B, C, X, Y) features a 1x1 conv to `channels`,
  then per cell Linear-Softplus-Linear to 16 heights x 18 classes, reshaped into the height axis: no 3D conv.

A lift grid coarser than 0.4 m (an integer number of Occ3D voxels, the cheap CPU settings) is upsampled
(trilinear, or bilinear in x, y) to 200 x 200 x 16.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bev.geometry import Grid
from bev.tasks.occupancy.grid import NUM_CLASSES, OCC_RANGE, OCC_SHAPE, VOXEL_SIZE

KINDS = ("voxel3d", "channel_to_height")


def check_grid(grid: Grid, kind: str) -> None:
    """The lift grid must cover Occ3D's range with cells of a whole number of Occ3D voxels (and, for voxel3d, as
    many height bins as divide 16); else one error saying what to set."""
    lo, hi = OCC_RANGE[:3], OCC_RANGE[3:]
    bounds = (grid.xbound, grid.ybound, grid.zbound)
    fix = (
        f"an occupancy head of kind {kind} needs grid.xbound, ybound [-40, 40, step] and zbound [-1, 5.4, step] "
        f"with steps that are whole multiples of {VOXEL_SIZE} m (Occ3D's voxels)"
    )
    for a, (b_lo, b_hi, step) in enumerate(bounds):
        if kind == "channel_to_height" and a == 2:
            continue  # the height axis comes from the channels: any z binning of the lift
        ratio = step / VOXEL_SIZE
        n = OCC_SHAPE[a] / ratio if abs(ratio - round(ratio)) < 1e-6 else math.nan
        if not (math.isclose(b_lo, lo[a]) and math.isclose(b_hi, hi[a]) and math.isfinite(n) and n == int(n)):
            raise ValueError(f"{fix}; got grid {'xyz'[a]}bound {list(bounds[a])}")


class Voxel3dHead(nn.Module):
    """(B, Cin, Z, X, Y) voxel features -> (B, 18, X', Y', Z') logits at Occ3D's shape (fp32 even under autocast:
    the 3D part diverged under CPU bf16)."""

    volumetric = True

    def __init__(self, in_channels: int, channels: int = 32, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.final_conv = nn.Sequential(nn.Conv3d(in_channels, channels, 3, padding=1), nn.ReLU(True))
        self.predicter = nn.Sequential(
            nn.Conv3d(channels, 2 * channels, 1), nn.Softplus(), nn.Conv3d(2 * channels, num_classes, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            logits = self.predicter(self.final_conv(x.float()))  # (B, K, Z, X, Y)
        target = (OCC_SHAPE[2], *OCC_SHAPE[:2])
        if tuple(logits.shape[-3:]) != target:
            logits = F.interpolate(logits, size=target, mode="trilinear", align_corners=False)
        return logits.permute(0, 1, 3, 4, 2)  # (B, K, X, Y, Z)


class ChannelToHeightHead(nn.Module):
    """(B, Cin, X, Y) BEV features -> (B, 18, 200, 200, heights) logits: a 1x1 conv to `channels`, then per cell
    Linear(C, 2C)-Softplus-Linear(2C, heights x 18) (1x1 convs), the channels read as (height, class) as
    FlashOcc's view(..., Dz, n_cls)."""

    volumetric = False

    def __init__(self, in_channels: int, channels: int = 256, heights: int = OCC_SHAPE[2], classes: int = NUM_CLASSES):
        super().__init__()
        self.heights, self.num_classes = int(heights), int(classes)
        self.proj = nn.Conv2d(in_channels, channels, 1)
        self.predicter = nn.Sequential(
            nn.Conv2d(channels, 2 * channels, 1), nn.Softplus(), nn.Conv2d(2 * channels, heights * classes, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.predicter(self.proj(x).contiguous())  # (B, Z * K, X, Y)
        if tuple(out.shape[-2:]) != tuple(OCC_SHAPE[:2]):
            out = F.interpolate(out, size=OCC_SHAPE[:2], mode="bilinear", align_corners=False)
        B, _, X, Y = out.shape
        return out.view(B, self.heights, self.num_classes, X, Y).permute(0, 2, 3, 4, 1)  # (B, K, X, Y, Z)


def build(in_channels: int, grid: Grid, kind: str = "voxel3d", channels: int | None = None) -> nn.Module:
    """The occupancy head of `kind` (model.net.heads.occupancy) on `in_channels` features; the grid checked."""
    if kind not in KINDS:
        raise ValueError(f"model.net.heads.occupancy.kind must be one of {', '.join(KINDS)}, got {kind!r}")
    check_grid(grid, kind)
    if kind == "voxel3d":
        return Voxel3dHead(in_channels, int(channels or 32))
    return ChannelToHeightHead(in_channels, int(channels or 256))
