"""The LiDAR branch: points -> pillars on the BEV grid (PointPillars, dynamic voxelisation) -> a 2D backbone.

    points   (P, 6) rows (batch index, x, y, z, intensity, time lag s) in the ego frame, as batches collate them
             (bev.data.lidar.collate_points); points outside the grid or not finite are ignored
    pillars  one per BEV cell of the camera branch's grid (the grid's x / y cells, its whole z range); no cap on
             pillars or points per pillar (dynamic voxelisation, as CenterPoint-Pillar / OpenPCDet's
             DynamicPillarVFE)
    PFN      per point its 5 features, the offsets to its pillar's mean (3) and to the pillar's centre (3), through
             Linear-BN-ReLU layers (PointPillars' PFN); each layer but the last appends the pillar's max
    scatter  one feature vector per pillar into the (B, C, X, Y) canvas: max over the pillar's points (PointPillars;
             torch's scatter_reduce "amax" with a cheaper backward, PillarMax: bev.ops offers sums only) or mean
             (bev.ops.voxel_sum / counts)
    backbone SECOND + SECONDFPN: conv stages at growing strides, each upsampled back to the grid, concatenated

The pillar means are sums by bev.ops.voxel_sum (the op the camera branch splats with) divided by the counts.
Inside `exportable()` the branch uses plain scatters instead (scatter_sum: ONNX ScatterND "add"; scatter_max:
ScatterElements "max"), keeping every point with the ones forward() drops routed to a dump row, so the graph has no
data-dependent shape (for torch.onnx.export and torch.export with a dynamic point count).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bev.geometry import Grid

POINT_FEATURES = 5  # x, y, z, intensity, time lag (bev.data.lidar.POINT_COLUMNS)
REDUCTIONS = ("max", "mean")


def pillar_keys(points: torch.Tensor, grid: Grid, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, 6) points -> (cells (P', 3) int64 (batch, x index, y index), kept (P,) bool) of the points that are
    finite, of a batch in [0, batch_size), and inside the grid (floor binning, bev.geometry's convention)."""
    kept = kept_points(points, grid, batch_size)
    return _cells(points[kept], grid), kept


def kept_points(points: torch.Tensor, grid: Grid, batch_size: int) -> torch.Tensor:
    """(P,) bool: the points that are finite, of a batch in [0, batch_size), and inside the grid."""
    (xlo, xhi, _), (ylo, yhi, _), (zlo, zhi, _) = grid.xbound, grid.ybound, grid.zbound
    b, x, y, z = points[:, 0], points[:, 1], points[:, 2], points[:, 3]
    kept = torch.isfinite(points[:, :4]).all(1) & (b >= 0) & (b < batch_size)
    return kept & (x >= xlo) & (x < xhi) & (y >= ylo) & (y < yhi) & (z >= zlo) & (z < zhi)


def _cells(p: torch.Tensor, grid: Grid) -> torch.Tensor:
    """(P, 3) int64 (batch, x index, y index) of points inside the grid (floor binning)."""
    (xlo, _, xs), (ylo, _, ys) = grid.xbound, grid.ybound
    ix = torch.floor((p[:, 1] - xlo) / xs).long().clamp(0, grid.nx - 1)  # clamp: x just below xhi in fp32
    iy = torch.floor((p[:, 2] - ylo) / ys).long().clamp(0, grid.ny - 1)
    return torch.stack([p[:, 0].long(), ix, iy], 1)


def scatter_sum(x: torch.Tensor, flat: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows + 1, C) sums of x (P, C) per row index flat (P,) in [0, rows]: row `rows` is the dump row of points
    that go nowhere. One index_put with accumulate (ONNX ScatterND, reduction "add"): bev.ops.voxel_sum for export."""
    return x.new_zeros(rows + 1, x.shape[1]).index_put((flat,), x, accumulate=True)


def scatter_max(x: torch.Tensor, flat: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows + 1, C) max of x (P, C) per row index flat (P,) in [0, rows], 0 where no point: PillarMax's forward
    for export. The table starts at -inf, so include_self adds nothing (ONNX ScatterElements, reduction "max",
    opset 18, which has no include_self=False), and rows left at -inf become 0."""
    table = x.new_full((rows + 1, x.shape[1]), float("-inf"))
    table = table.scatter_reduce(0, flat[:, None].expand_as(x), x, "amax", include_self=True)
    return torch.where(torch.isneginf(table), torch.zeros_like(table), table)


class PillarMax(torch.autograd.Function):
    """(rows, C) max of x (P, C) per row index flat (P,), 0 where no point: scatter_reduce "amax" forward; the
    backward splits each max's gradient evenly among the points equal to it, as scatter_reduce's own does, in
    gathers and one index_add_ (300k points x 64 channels: about 2x faster, a quarter of the memory; see
    scripts/bench_lidar.py)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, flat: torch.Tensor, rows: int) -> torch.Tensor:
        out = x.new_zeros(rows, x.shape[1])
        out = out.scatter_reduce(0, flat[:, None].expand_as(x), x, "amax", include_self=False)
        ctx.save_for_backward(x, flat, out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, flat, out = ctx.saved_tensors
        hit = (x == out.index_select(0, flat)).to(grad.dtype)
        ties = torch.zeros_like(out).index_add_(0, flat, hit).clamp_(min=1)
        return (grad / ties).index_select(0, flat).mul_(hit), None, None


class PFNLayer(nn.Module):
    """Linear (no bias) - BatchNorm1d - ReLU over the points; a cloud of fewer than 2 points normalises with the
    running statistics (batch statistics of one point are undefined, of none NaN)."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.linear = nn.Linear(cin, cout, bias=False)
        self.norm = nn.BatchNorm1d(cout, eps=1e-3, momentum=0.01)  # PointPillars' BN settings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        if self.training and x.shape[0] < 2:
            n = self.norm
            x = F.batch_norm(x, n.running_mean, n.running_var, n.weight, n.bias, False, 0.0, n.eps)
        else:
            x = self.norm(x)
        return F.relu(x)


def _conv_bn_relu(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout, eps=1e-3), nn.ReLU(inplace=True)]


class SecondBackbone(nn.Module):
    """(B, Cin, X, Y) -> (B, sum(up_channels), X, Y): SECOND's stages (a strided 3x3 conv, then `blocks` 3x3
    convs, each BN-ReLU) and SECONDFPN's upsampling of each stage back to the input size, concatenated."""

    def __init__(
        self,
        in_channels: int,
        widths: Sequence[int] = (64, 128, 256),
        blocks: Sequence[int] = (3, 5, 5),
        strides: Sequence[int] = (1, 2, 2),
        up_channels: Sequence[int] = (128, 128, 128),
    ):
        super().__init__()
        if not (len(widths) == len(blocks) == len(strides) == len(up_channels) > 0):
            raise ValueError(
                f"model.net.lidar: widths {list(widths)}, blocks {list(blocks)}, strides {list(strides)} and "
                f"up_channels {list(up_channels)} need one entry per stage"
            )
        self.stages, self.ups = nn.ModuleList(), nn.ModuleList()
        cin, total = in_channels, 1
        for w, n, s, u in zip(widths, blocks, strides, up_channels):
            layers = _conv_bn_relu(cin, w, s)
            for _ in range(int(n)):
                layers += _conv_bn_relu(w, w)
            self.stages.append(nn.Sequential(*layers))
            total *= int(s)
            up = nn.ConvTranspose2d(w, u, total, total, bias=False) if total > 1 else nn.Conv2d(w, u, 1, bias=False)
            self.ups.append(nn.Sequential(up, nn.BatchNorm2d(u, eps=1e-3), nn.ReLU(inplace=True)))
            cin = w
        self.out_channels = int(sum(up_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size, outs = x.shape[-2:], []
        for stage, up in zip(self.stages, self.ups):
            x = stage(x)
            y = up(x)
            # A grid side that the strides do not divide comes back a few cells short: resampled to the grid.
            outs.append(y if y.shape[-2:] == size else F.interpolate(y, size=size, mode="bilinear"))
        return torch.cat(outs, 1)


class PillarEncoder(nn.Module):
    """(P, 6) points -> (B, C, X, Y) pillar features on `grid`'s BEV cells (module doc): PFN, scatter, no backbone.

    pfn_channels: the PFN layers' widths (PointPillars: [64]); reduce: "max" (PointPillars) or "mean" per pillar;
    pool_backend: bev.ops' backend for the pillar sums."""

    def __init__(
        self,
        grid: Grid,
        pfn_channels: Sequence[int] = (64,),
        reduce: str = "max",
        pool_backend: str = "auto",
        in_features: int = POINT_FEATURES,
    ):
        super().__init__()
        if reduce not in REDUCTIONS:
            raise ValueError(f"model.net.lidar.reduce must be one of {', '.join(REDUCTIONS)}, got {reduce!r}")
        if not pfn_channels:
            raise ValueError("model.net.lidar.pfn_channels needs at least one width (PointPillars: [64])")
        self.grid, self.reduce, self.pool_backend = grid, reduce, pool_backend
        cin, layers = in_features + 6, []  # + offsets to the pillar's mean and centre
        for k, c in enumerate(pfn_channels):
            last = k == len(pfn_channels) - 1
            layers.append(PFNLayer(cin, int(c) if last else int(c) // 2))  # non-last: [point, pillar max] = c
            cin = int(c)
        self.pfn = nn.ModuleList(layers)
        self.out_channels = int(pfn_channels[-1])
        self._export_scatter = False

    @contextlib.contextmanager
    def exportable(self) -> Iterator[PillarEncoder]:
        """Within this block forward() pools with scatter_sum / scatter_max (module doc)."""
        before, self._export_scatter = self._export_scatter, True
        try:
            yield self
        finally:
            self._export_scatter = before

    def forward(self, points: torch.Tensor, batch_size: int) -> torch.Tensor:
        if self._export_scatter:
            return self._scatter_forward(points, batch_size)
        cells, kept = pillar_keys(points, self.grid, batch_size)
        pts = points[kept, 1:].to(self.pfn[0].linear.weight.dtype)
        flat = (cells[:, 0] * self.grid.nx + cells[:, 1]) * self.grid.ny + cells[:, 2]
        x = torch.cat([pts, self._offsets(pts, cells, flat, batch_size)], 1)
        for layer in self.pfn[:-1]:
            x = layer(x)
            x = torch.cat([x, self._pillar_max(x, flat, batch_size)[flat]], 1)
        x = self.pfn[-1](x)
        if self.reduce == "mean":
            return self._pillar_mean(x, cells, batch_size)
        canvas = self._pillar_max(x, flat, batch_size)
        return canvas.view(batch_size, self.grid.nx, self.grid.ny, -1).permute(0, 3, 1, 2).contiguous()

    def _scatter_forward(self, points: torch.Tensor, batch_size: int) -> torch.Tensor:
        """forward() in plain scatters, of the same floor binning: every point goes through the PFN, those forward()
        drops (not finite, another batch, outside the grid) into the dump row, sliced off the canvas."""
        rows = batch_size * self.grid.nx * self.grid.ny
        kept = kept_points(points, self.grid, batch_size)
        # Zeros for dropped rows: a NaN there would still reach the dump row only, but keep the binning finite.
        p = torch.where(kept[:, None], points, torch.zeros_like(points))
        cells = _cells(p, self.grid)
        flat = (cells[:, 0] * self.grid.nx + cells[:, 1]) * self.grid.ny + cells[:, 2]
        flat = torch.where(kept, flat, torch.full_like(flat, rows))
        pts = p[:, 1:].to(self.pfn[0].linear.weight.dtype)
        xyz = pts[:, :3]
        sums = scatter_sum(torch.cat([xyz, torch.ones_like(xyz[:, :1])], 1), flat, rows)[flat]
        mean = sums[:, :3] / sums[:, 3:].clamp(min=1)
        x = torch.cat([pts, xyz - mean, xyz - self._centres(cells, xyz.dtype)], 1)
        for layer in self.pfn[:-1]:
            x = layer(x)
            x = torch.cat([x, scatter_max(x, flat, rows)[flat]], 1)
        x = self.pfn[-1](x)
        if self.reduce == "mean":
            sums = scatter_sum(torch.cat([x, torch.ones_like(x[:, :1])], 1), flat, rows)[:rows]
            canvas = sums[:, :-1] / sums[:, -1:].clamp(min=1)
        else:
            canvas = scatter_max(x, flat, rows)[:rows]
        return canvas.view(batch_size, self.grid.nx, self.grid.ny, -1).permute(0, 3, 1, 2).contiguous()

    def _centres(self, cells: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(P, 3) the centre of each point's pillar: its cell's x, y centre, the grid's middle height."""
        (xlo, _, xs), (ylo, _, ys), (zlo, zhi, _) = self.grid.xbound, self.grid.ybound, self.grid.zbound
        cx = xlo + (cells[:, 1].to(dtype) + 0.5) * xs
        cy = ylo + (cells[:, 2].to(dtype) + 0.5) * ys
        return torch.stack([cx, cy, torch.full_like(cx, (zlo + zhi) / 2)], 1)

    def _sums(self, feats: torch.Tensor, cells: torch.Tensor, batch_size: int) -> torch.Tensor:
        """Per-pillar sums of feats (P, C) by bev.ops.voxel_sum -> (B, C, X, Y)."""
        from bev import ops  # imported here so building a model never depends on the native build

        coords = torch.stack([cells[:, 0], torch.zeros_like(cells[:, 0]), cells[:, 1], cells[:, 2]], 1)
        shape = (batch_size, 1, self.grid.nx, self.grid.ny)
        return ops.voxel_sum(feats, coords, shape, backend=self.pool_backend)[:, :, 0]

    def _offsets(self, pts: torch.Tensor, cells: torch.Tensor, flat: torch.Tensor, batch_size: int) -> torch.Tensor:
        """(P, 6): each point's xyz minus its pillar's mean xyz, and minus the pillar's centre."""
        with torch.no_grad():  # coordinates carry no gradient
            xyz = pts[:, :3]
            sums = self._sums(torch.cat([xyz, torch.ones_like(xyz[:, :1])], 1), cells, batch_size)
            per_pillar = sums.permute(0, 2, 3, 1).reshape(-1, 4)[flat]
            mean = per_pillar[:, :3] / per_pillar[:, 3:].clamp(min=1)
            return torch.cat([xyz - mean, xyz - self._centres(cells, xyz.dtype)], 1)

    def _pillar_max(self, x: torch.Tensor, flat: torch.Tensor, batch_size: int) -> torch.Tensor:
        """(B * X * Y, C) max of each pillar's rows of x (0 for empty pillars)."""
        return PillarMax.apply(x, flat, batch_size * self.grid.nx * self.grid.ny)

    def _pillar_mean(self, x: torch.Tensor, cells: torch.Tensor, batch_size: int) -> torch.Tensor:
        sums = self._sums(torch.cat([x, torch.ones_like(x[:, :1])], 1), cells, batch_size)
        return sums[:, :-1] / sums[:, -1:].clamp(min=1)


class LidarEncoder(nn.Module):
    """points (P, 6) (batch index, x, y, z, intensity, time lag) -> (B, out_channels, X, Y) on `grid`'s BEV cells:
    PillarEncoder, then SecondBackbone (module doc). Options: pfn_channels, reduce, pool_backend (PillarEncoder),
    widths, blocks, strides, up_channels (SecondBackbone)."""

    def __init__(
        self,
        grid: Grid,
        pfn_channels: Sequence[int] = (64,),
        reduce: str = "max",
        pool_backend: str = "auto",
        widths: Sequence[int] = (64, 128, 256),
        blocks: Sequence[int] = (3, 5, 5),
        strides: Sequence[int] = (1, 2, 2),
        up_channels: Sequence[int] = (128, 128, 128),
    ):
        super().__init__()
        self.grid = Grid.from_any(grid)
        self.pillars = PillarEncoder(self.grid, pfn_channels, reduce, pool_backend)
        self.backbone = SecondBackbone(self.pillars.out_channels, widths, blocks, strides, up_channels)
        self.out_channels = self.backbone.out_channels

    def exportable(self) -> contextlib.AbstractContextManager[PillarEncoder]:
        """Within this block forward() pools with plain scatters (PillarEncoder.exportable)."""
        return self.pillars.exportable()

    def forward(self, points: torch.Tensor, batch_size: int) -> torch.Tensor:
        if points.dim() != 2 or points.shape[1] != POINT_FEATURES + 1:
            raise ValueError(
                f"points must be (P, {POINT_FEATURES + 1}) rows (batch index, x, y, z, intensity, time lag) as "
                f"bev.data.lidar.collate_points gives them, got {tuple(points.shape)}"
            )
        return self.backbone(self.pillars(points, batch_size))


__all__ = [
    "LidarEncoder",
    "PFNLayer",
    "PillarEncoder",
    "PillarMax",
    "SecondBackbone",
    "kept_points",
    "pillar_keys",
    "scatter_max",
    "scatter_sum",
]
