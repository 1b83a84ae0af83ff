"""The camera branch: an image encoder and the Lift-Splat view transform. Images -> per-pixel depth distribution
and context features -> lifted into a depth-weighted frustum -> splatted into the BEV voxel grid with bev.ops.
Geometry conventions come from bev.geometry only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from bev.geometry import FEATURE_STRIDE, Grid, frustum_to_ego, make_frustum, voxel_coords
from bev.models.camera import STRIDES as CAMERA_STRIDES
from bev.models.camera import CameraEncoder

SPLATS = ("bev_pool", "voxel_sum")


class LiftSplat(nn.Module):
    """Any number of cameras N (1..12, at the image size the config names) -> BEV voxel features
    (B, C * Z, X, Y) (`out_channels` = context_channels x the grid's height bins) and depth logits.

    splat="bev_pool" uses the fused depth x feature op (the (B, N, D, H, W, C) frustum tensor is
    never built); splat="voxel_sum" materialises it and sums points per voxel (the LSS way, kept
    for comparison and as a cross-check). Inside `exportable()` the splat is a plain scatter-add
    (ONNX ScatterND with reduction "add"), the formulation ONNX Runtime can run.
    `encoder` options (backbone, widths, weights, ...) go to bev.models.camera.CameraEncoder.
    """

    def __init__(
        self,
        grid: Grid | Mapping[str, Any] | None,
        image_size: tuple[int, int] = (128, 352),
        downsample: int = FEATURE_STRIDE,
        context_channels: int = 64,
        splat: str = "bev_pool",
        pool_backend: str = "auto",
        **encoder: Any,
    ):
        super().__init__()
        if splat not in SPLATS:
            raise ValueError(f"unknown splat {splat!r}; choose one of {', '.join(SPLATS)}")
        if downsample not in CAMERA_STRIDES:
            raise ValueError(
                "the camera encoder gives stride-8 or -16 features; model.net.camera.downsample must be 8 or 16, "
                f"got {downsample}"
            )
        self.grid = Grid.from_any(grid)
        self.image_size = tuple(int(s) for s in image_size)
        self.context_channels = int(context_channels)
        self.out_channels = self.context_channels * self.grid.nz
        self.splat_mode = splat
        self.pool_backend = pool_backend
        self.encoder = CameraEncoder(self.grid.depth_bins, context_channels, **{**encoder, "stride": downsample})
        self.register_buffer("frustum", make_frustum(self.image_size, downsample, self.grid), persistent=False)
        self._export_splat = False

    @contextlib.contextmanager
    def exportable(self) -> Iterator[LiftSplat]:
        """Within this block forward() splats with scatter_splat (for torch.onnx.export)."""
        before, self._export_splat = self._export_splat, True
        try:
            yield self
        finally:
            self._export_splat = before

    def voxel_coords(self, intrinsics, rots, trans, post_rots, post_trans) -> torch.Tensor:
        """(B, N, D, fH, fW, 3) int64 (z, x, y) voxel of every frustum point; out-of-grid points lie outside."""
        # Geometry in fp32 even under autocast: a half-precision solve would move points across cells.
        with torch.no_grad(), torch.autocast(self.frustum.device.type, enabled=False):
            args = [t.float() for t in (intrinsics, rots, trans, post_rots, post_trans)]
            return voxel_coords(frustum_to_ego(self.frustum, *args), self.grid)

    def splat(self, depth: torch.Tensor, feats: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        """depth (B, N, D, H, W), feats (B, N, H, W, C), coords (B, N, D, H, W, 3) -> (B, C * Z, X, Y)."""
        if self._export_splat:
            return self.scatter_splat(depth, feats, coords)
        from bev import ops  # imported here so building a model never depends on the native build

        B = depth.shape[0]
        grid_shape = (B, *self.grid.voxel_shape)
        if self.splat_mode == "bev_pool":
            out = ops.bev_pool(depth, feats, coords, grid_shape, backend=self.pool_backend)
        else:
            C = feats.shape[-1]
            points = (depth.unsqueeze(-1) * feats.unsqueeze(2)).reshape(-1, C)
            batch = torch.arange(B, device=coords.device).view(B, 1, 1, 1, 1, 1).expand(*coords.shape[:-1], 1)
            out = ops.voxel_sum(
                points, torch.cat([batch, coords], dim=-1).reshape(-1, 4), grid_shape, backend=self.pool_backend
            )
        return out.flatten(1, 2)  # (B, C, Z, X, Y) -> (B, C*Z, X, Y): height slices become channels

    def scatter_splat(self, depth: torch.Tensor, feats: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        """The splat as one scatter-add of the depth x feature products into a flat voxel table.

        Same flat keys (and so the same floor binning) as bev.ops; out-of-grid points carry the
        sentinel key V and land in a dump row that is sliced off. Builds the (P, C) products, so
        it is meant for export and inference, not training.
        """
        from bev.ops._plan import flat_keys

        B, N, D, H, W = depth.shape
        C = feats.shape[-1]
        Z, X, Y = self.grid.voxel_shape
        batch = torch.arange(B, device=coords.device).view(B, 1, 1, 1, 1)
        keys = flat_keys(batch, coords, (B, Z, X, Y))
        points = (depth.unsqueeze(-1) * feats.unsqueeze(2)).reshape(-1, C)
        table = points.new_zeros(B * Z * X * Y + 1, C).index_put((keys,), points, accumulate=True)
        out = table[: B * Z * X * Y].view(B, Z, X, Y, C).permute(0, 4, 1, 2, 3)  # (B, C, Z, X, Y)
        return out.flatten(1, 2)

    def _check_image_size(self, images: torch.Tensor) -> None:
        H, W = images.shape[-2:]
        if (H, W) != self.image_size:
            raise ValueError(
                f"images are {H}x{W} but the model was built for {self.image_size[0]}x{self.image_size[1]}"
            )

    def forward(self, images, intrinsics, rots, trans, post_rots, post_trans) -> tuple[torch.Tensor, torch.Tensor]:
        """Cameras (B, N, 3, H, W) and (B, N, ...) -> (BEV voxel features (B, C * Z, X, Y), depth logits
        (B, N, D, fH, fW))."""
        self._check_image_size(images)
        B, N = images.shape[:2]
        x = self.encoder(images.flatten(0, 1))
        D, C = self.grid.depth_bins, self.context_channels
        fH, fW = x.shape[-2:]
        depth_logits = x[:, :D].view(B, N, D, fH, fW)
        feats = x[:, D:].view(B, N, C, fH, fW).permute(0, 1, 3, 4, 2)
        coords = self.voxel_coords(intrinsics, rots, trans, post_rots, post_trans)
        return self.splat(depth_logits.softmax(dim=2), feats, coords), depth_logits
