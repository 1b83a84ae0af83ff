"""3D semantic occupancy from the cameras: Lift-Splat features -> (B, 18, 200, 200, 16) Occ3D logits, indexed
[x, y, z] as Occ3D's arrays (bev.tasks.occupancy.grid). Two ways, `occupancy.kind`:

- voxel3d (BEVDet-Occ): the lift pools into a 3D grid with height bins (the op's z axis), a 3D voxel encoder
  (residual Conv3d stages at strides 1, 2, 2, the coarser levels upsampled and fused: BEVDet-Occ's
  CustomResNet3D + LSSFPN3D in small) and a per-voxel classifier (a 3x3x3 conv, then Linear-Softplus-Linear as
  BEVDet-Occ's BEVOCCHead3D predicter, here 1x1x1 convs).
- channel_to_height (FlashOcc): the lift keeps a BEV grid (usually one height bin), the 2D BEV encoder of LSS
  gives `channels` features per cell, and a per-cell predictor (Linear-Softplus-Linear, as FlashOcc's
  BEVOCCHead2D) gives 18 x 16 numbers reshaped into the height axis: no 3D convolution.

The lift grid must span Occ3D's range; its cells may be coarser than 0.4 m (an integer number of Occ3D voxels,
the cheap CPU settings): the logits are then upsampled (trilinear, or bilinear in x, y) to 200 x 200 x 16.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bev.geometry import FEATURE_STRIDE, Grid
from bev.models.bev_encoder import BevEncoder
from bev.models.lss import LiftSplatShoot
from bev.tasks.occupancy.grid import NUM_CLASSES, OCC_RANGE, OCC_SHAPE, VOXEL_SIZE

KINDS = ("voxel3d", "channel_to_height")


def check_grid(grid: Grid, kind: str) -> None:
    """The lift grid must cover Occ3D's range with cells of a whole number of Occ3D voxels (and, for voxel3d, as
    many height bins as divide 16); else one error saying what to set."""
    lo, hi = OCC_RANGE[:3], OCC_RANGE[3:]
    bounds = (grid.xbound, grid.ybound, grid.zbound)
    fix = (
        f"model.net.occupancy.kind={kind} needs grid.xbound, ybound [-40, 40, step] and zbound [-1, 5.4, step] "
        f"with steps that are whole multiples of {VOXEL_SIZE} m (Occ3D's voxels)"
    )
    for a, (b_lo, b_hi, step) in enumerate(bounds):
        if kind == "channel_to_height" and a == 2:
            continue  # the height axis comes from the channels: any z binning of the lift
        ratio = step / VOXEL_SIZE
        n = OCC_SHAPE[a] / ratio if abs(ratio - round(ratio)) < 1e-6 else math.nan
        if not (math.isclose(b_lo, lo[a]) and math.isclose(b_hi, hi[a]) and n == int(n)):
            raise ValueError(f"{fix}; got grid {'xyz'[a]}bound {list(bounds[a])}")


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


class VoxelEncoder3d(nn.Module):
    """(B, Cin, Z, X, Y) -> (B, out_channels, Z, X, Y): stages of ResBlock3d at strides 1, 2, 2 (widths, blocks
    per stage), each coarser level upsampled (trilinear) to the first, all concatenated and fused by a 3x3x3
    conv-BN-ReLU (BEVDet-Occ: numC_Trans 32, widths 32/64/128, blocks 1/2/4)."""

    def __init__(self, in_channels: int, widths=(32, 64, 128), blocks=(1, 2, 4), out_channels: int = 32):
        super().__init__()
        if len(widths) != len(blocks) or not widths:
            raise ValueError(
                f"model.net.occupancy: widths {list(widths)} and blocks {list(blocks)} need one entry per stage"
            )
        stages, cin = [], in_channels
        for s, (w, n) in enumerate(zip(widths, blocks)):
            layers = [ResBlock3d(cin, w, 1 if s == 0 else 2)] + [ResBlock3d(w, w) for _ in range(int(n) - 1)]
            stages.append(nn.Sequential(*layers))
            cin = w
        self.stages = nn.ModuleList(stages)
        self.fuse = nn.Sequential(
            nn.Conv3d(sum(widths), out_channels, 3, padding=1, bias=False), nn.BatchNorm3d(out_channels), nn.ReLU(True)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        levels = []
        for stage in self.stages:
            x = stage(x)
            levels.append(x)
        size = levels[0].shape[-3:]
        up = [levels[0]] + [F.interpolate(f, size=size, mode="trilinear", align_corners=False) for f in levels[1:]]
        return self.fuse(torch.cat(up, 1))


class Voxel3dHead(nn.Module):
    """(B, Cin, Z, X, Y) voxel features -> (B, 18, Z, X, Y) logits: 3x3x3 conv-ReLU, then per voxel
    Linear(C, 2C)-Softplus-Linear(2C, 18) as 1x1x1 convs (BEVDet-Occ's BEVOCCHead3D)."""

    def __init__(self, in_channels: int, channels: int = 32, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.final_conv = nn.Sequential(nn.Conv3d(in_channels, channels, 3, padding=1), nn.ReLU(True))
        self.predicter = nn.Sequential(
            nn.Conv3d(channels, 2 * channels, 1), nn.Softplus(), nn.Conv3d(2 * channels, num_classes, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.predicter(self.final_conv(x))


class ChannelToHeightHead(nn.Module):
    """(B, Cin, X, Y) BEV features -> (B, 18, X, Y, heights) logits: per cell Linear(C, 2C)-Softplus-
    Linear(2C, heights x 18) (1x1 convs), the channels read as (height, class) as FlashOcc's view(..., Dz, n_cls)."""

    def __init__(self, in_channels: int, heights: int = OCC_SHAPE[2], num_classes: int = NUM_CLASSES):
        super().__init__()
        self.heights, self.num_classes = int(heights), int(num_classes)
        self.predicter = nn.Sequential(
            nn.Conv2d(in_channels, 2 * in_channels, 1),
            nn.Softplus(),
            nn.Conv2d(2 * in_channels, heights * num_classes, 1),
        )

    def forward(self, x: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        out = self.predicter(x)  # (B, Z * K, X, Y)
        if size is not None and tuple(out.shape[-2:]) != tuple(size):
            out = F.interpolate(out, size=size, mode="bilinear", align_corners=False)
        B, _, X, Y = out.shape
        return out.view(B, self.heights, self.num_classes, X, Y).permute(0, 2, 3, 4, 1)  # (B, K, X, Y, Z)


class OccupancyNet(LiftSplatShoot):
    """Cameras -> (B, 18, 200, 200, 16) Occ3D logits indexed [x, y, z] (module doc). The camera encoder, the lift
    and the splat are LiftSplatShoot's; `occupancy` chooses the rest:
      kind: voxel3d | channel_to_height
      channels: voxel3d: the 3D encoder's output and the head's width; channel_to_height: what the 2D BEV
        encoder gives each cell (FlashOcc's out_dim)
      widths, blocks: voxel3d's VoxelEncoder3d stages (ignored by channel_to_height)
    `bev` configures the 2D BEV encoder of channel_to_height (LSS's BevEncoder); voxel3d has none."""

    def __init__(
        self,
        grid: Grid | Mapping[str, Any] | None,
        image_size: tuple[int, int] = (256, 704),
        downsample: int = FEATURE_STRIDE,
        context_channels: int = 64,
        camera: Mapping[str, Any] | None = None,
        bev: Mapping[str, Any] | None = None,
        splat: str = "bev_pool",
        pool_backend: str = "auto",
        occupancy: Mapping[str, Any] | None = None,
    ):
        occ = dict(occupancy or {})
        kind = occ.pop("kind", "voxel3d")
        if kind not in KINDS:
            raise ValueError(f"model.net.occupancy.kind must be one of {', '.join(KINDS)}, got {kind!r}")
        super().__init__(grid, image_size, downsample, context_channels, 1, camera, bev, splat, pool_backend)
        check_grid(self.grid, kind)
        self.kind, self.num_classes = kind, NUM_CLASSES
        C, Z = context_channels, self.grid.nz
        _refuse(occ, {"widths", "blocks", "channels"})
        if kind == "voxel3d":
            channels = int(occ.get("channels", 32))
            self.bev_encoder = None  # no 2D encoder: the voxels keep their heights
            self.voxel_encoder = VoxelEncoder3d(
                C, occ.get("widths", (32, 64, 128)), occ.get("blocks", (1, 2, 4)), channels
            )
            self.occ_head = Voxel3dHead(channels, channels)
        else:  # widths and blocks are voxel3d's: ignored, so that one override switches the kind
            channels = int(occ.get("channels", 256))
            self.bev_encoder = BevEncoder(C * Z, channels, **dict(bev or {}))  # its 1x1 head gives `channels`
            self.occ_head = ChannelToHeightHead(channels)

    def occupancy_logits(self, voxels: torch.Tensor) -> torch.Tensor:
        """The splat's (B, C * Z, X, Y) -> (B, 18, 200, 200, 16) logits."""
        if self.kind == "channel_to_height":
            return self.occ_head(self.bev_encoder(voxels), OCC_SHAPE[:2])
        B, _, X, Y = voxels.shape
        # The 3D part in fp32 even under autocast: with bf16-mixed on a CPU it diverged to NaN within 5 steps
        # of experiment=synthetic_occ_cpu (fp32 and channel_to_height under bf16 did not).
        with torch.autocast(voxels.device.type, enabled=False):
            feats = self.voxel_encoder(voxels.float().view(B, self.context_channels, self.grid.nz, X, Y))
            logits = self.occ_head(feats)  # (B, K, Z, X, Y)
        target = (OCC_SHAPE[2], *OCC_SHAPE[:2])
        if tuple(logits.shape[-3:]) != target:
            logits = F.interpolate(logits, size=target, mode="trilinear", align_corners=False)
        return logits.permute(0, 1, 3, 4, 2)  # (B, K, X, Y, Z)

    def forward(self, images, intrinsics, rots, trans, post_rots, post_trans, return_depth: bool = False):
        """(B, 18, 200, 200, 16) logits; with return_depth also the depth logits (B, N, D, fH, fW)."""
        voxels, depth_logits = self.lift_splat(images, intrinsics, rots, trans, post_rots, post_trans, True)
        out = self.occupancy_logits(voxels)
        return (out, depth_logits) if return_depth else out


def _refuse(options: Mapping[str, Any], known: set[str]) -> None:
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown model.net.occupancy key(s) {unknown}; known: kind, {', '.join(sorted(known))}")


__all__ = ["KINDS", "ChannelToHeightHead", "OccupancyNet", "Voxel3dHead", "VoxelEncoder3d", "check_grid"]
