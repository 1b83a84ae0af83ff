"""Depth-bin targets from LIDAR_TOP, to supervise the camera encoder's depth distribution (as BEVDepth).

Each lidar point is projected into each (augmented) camera image with bev.geometry.ego_to_image.
Feature cell (i, j) at the camera stride covers pixels [j*s, (j+1)*s) x [i*s, (i+1)*s) (the
frustum's cells, bev.geometry.make_frustum); its target is the depth bin nearest to the depth of
the closest point that lands in it (the first surface along the ray), -1 where no point lands or
that depth lies outside dbound (ignored by the loss).
"""

from __future__ import annotations

import numpy as np
import torch

from bev.geometry import Grid, ego_to_image

LIDAR_COLUMNS = 5  # nuScenes .pcd.bin: x, y, z, intensity, ring index (float32)
# Far beyond any LiDAR's reach (nuScenes' returns end near 100 m): a coordinate this large, NaN or infinite
# is a damaged record, dropped before any product (where it would poison sums and print numpy's warnings).
MAX_LIDAR_COORD_M = 1000.0


def load_lidar(path: str) -> np.ndarray:
    """(P, 3) float32 lidar points (sensor frame) of a nuScenes .pcd.bin file; points with a NaN, infinite or
    absurd (MAX_LIDAR_COORD_M) coordinate are dropped, counted in one warning naming the file."""
    try:
        raw = np.fromfile(path, dtype=np.float32)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"lidar file {path!r} is missing (listed in sample_data; needed by data.depth_target=true); "
            "re-download the sweep files or set data.depth_target=false"
        ) from None
    if raw.size == 0:
        raise ValueError(
            f"lidar file {path!r} is empty (0 bytes): the file is damaged; re-download it (or regenerate the "
            "synthetic set), or set data.depth_target=false"
        )
    if raw.size % LIDAR_COLUMNS:
        raise ValueError(
            f"lidar file {path!r} has {raw.size} floats, not a multiple of {LIDAR_COLUMNS} "
            "(x, y, z, intensity, ring): the file is damaged"
        )
    return _plausible_points(raw.reshape(-1, LIDAR_COLUMNS)[:, :3], path)


def _plausible_points(points: np.ndarray, path: str) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # NaN compares False: dropped below
        ok = (np.abs(points) < MAX_LIDAR_COORD_M).all(axis=1)
    if ok.all():
        return points
    import warnings

    warnings.warn(
        f"lidar file {path!r}: dropped {int((~ok).sum())} of {len(points)} points with a NaN, infinite or absurd "
        f"(>= {MAX_LIDAR_COORD_M:g} m) coordinate; the file is damaged: re-download it (or regenerate the "
        "synthetic set)",
        stacklevel=3,
    )
    return points[ok]


def depth_targets(
    points: torch.Tensor,
    intrinsics: torch.Tensor,
    rots: torch.Tensor,
    trans: torch.Tensor,
    post_rots: torch.Tensor,
    post_trans: torch.Tensor,
    image_size: tuple[int, int],
    stride: int,
    grid: Grid,
    raw_sizes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ego points (P, 3) and N cameras -> (N, H/stride, W/stride) int64 depth bins, -1 = no target.

    raw_sizes (N, 2): each camera's (height, width) before augmentation; points outside it are
    dropped, so padding that rotation or a crop brings into view gets no target.
    """
    H, W = image_size
    fH, fW = H // stride, W // stride
    N = intrinsics.shape[0]
    eye, zero = torch.eye(3).expand(N, 3, 3), torch.zeros(N, 3)
    uv_raw, depth = ego_to_image(
        points.float().unsqueeze(0), intrinsics.float(), rots.float(), trans.float(), eye, zero
    )
    uvd = torch.cat([uv_raw, depth.unsqueeze(-1)], -1) @ post_rots.float().transpose(
        -1, -2
    ) + post_trans.float().unsqueeze(-2)
    u, v = uvd[..., 0], uvd[..., 1]  # (N, P) in the augmented image
    seen = (depth > 1e-3) & (u >= 0) & (u < W) & (v >= 0) & (v < H)
    if raw_sizes is not None:
        raw_h, raw_w = raw_sizes.float().unsqueeze(-1).unbind(-2)
        seen &= (uv_raw[..., 0] >= 0) & (uv_raw[..., 0] < raw_w) & (uv_raw[..., 1] >= 0) & (uv_raw[..., 1] < raw_h)
    cam = torch.arange(N).view(N, 1).expand_as(depth)
    cell = (cam * fH + (v / stride).floor().long().clamp(0, fH - 1)) * fW + (u / stride).floor().long().clamp(0, fW - 1)
    nearest = torch.full((N * fH * fW,), float("inf"))
    nearest.scatter_reduce_(0, cell[seen], depth[seen], "amin")
    lo, _, step = grid.dbound
    bins = torch.round((nearest - lo) / step)
    ok = torch.isfinite(bins) & (bins >= 0) & (bins < grid.depth_bins)
    return torch.where(ok, bins, torch.full_like(bins, -1)).long().view(N, fH, fW)
