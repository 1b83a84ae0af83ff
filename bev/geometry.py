"""The one home of the geometric conventions: every other module imports them from here.

Ego frame: x forward, y left, z up (nuScenes; the ego pose of the sample's LIDAR_TOP
sample_data). Extrinsics are camera->ego: p_ego = R @ p_cam + t. Quaternions are (w, x, y, z).
Cameras are ordered as CAMERA_NAMES. Pixel coordinates follow OpenCV/nuScenes intrinsics
(the centre of pixel (i, j) is at u=j, v=i).

Image augmentation is tracked as post_rot (3x3) / post_tran (3) acting on (u, v, d):
(u', v', d) = post_rot @ (u, v, d) + post_tran, with post_rot[2] = (0, 0, 1) and
post_tran[2] = 0, so depth is untouched and geometry stays exact after resize/crop/flip/rotate.

Grid: bounds [lo, hi, step] per axis. Cell i covers [lo + i*step, lo + (i+1)*step): indices
come from floor, never truncation toward zero. BEV arrays are indexed [x_index, y_index]
(row = forward axis); voxel grids handed to bev.ops are (Z, X, Y).

3D boxes (detection) are rows of BOX_FIELDS in the ego frame of the sample's LIDAR_TOP: the centre
(x, y, z) in metres (z at the box's centre), the size (w, l, h) as nuScenes gives it (l along the
heading), yaw the heading of the box's length axis, counter-clockwise from ego x toward ego y, in
[-pi, pi), and the velocity (vx, vy) in m/s along ego x and y. No legacy yaw offsets (mmdet3d's
-yaw - pi/2 does not apply here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

CAMERA_NAMES: tuple[str, ...] = (
    "CAM_FRONT_LEFT",
    "CAM_FRONT",
    "CAM_FRONT_RIGHT",
    "CAM_BACK_LEFT",
    "CAM_BACK",
    "CAM_BACK_RIGHT",
)


BOX_FIELDS = ("x", "y", "z", "w", "l", "h", "yaw", "vx", "vy")
# Their columns, named once: boxes[:, BOX_SIZE] is (w, l, h), boxes[:, BOX_VELOCITY] (vx, vy).
BOX_CENTER, BOX_SIZE, BOX_YAW, BOX_VELOCITY = slice(0, 3), slice(3, 6), 6, slice(7, 9)
# The devkit scores at most this many boxes per sample (max_boxes_per_sample of detection_cvpr_2019): decoding
# keeps as many, and the targets and the reader's padded ground truth hold as many.
MAX_BOXES = 500

# Per-camera calibration + augmentation tensors of a sample, in the order the model takes them.
CAMERA_GEOMETRY = ("intrinsics", "rots", "trans", "post_rots", "post_trans")
# Stride of the camera features (frustum cells) in input pixels: the camera encoder's output.
FEATURE_STRIDE = 16
# Limits on grid sizes: past them a config typo (a step in mm instead of m) would ask for tensors of
# many GiB, and flat int32 voxel indices (2**31 - 1) would overflow.
MAX_CELLS_PER_AXIS = 2**16
MAX_VOXELS = 2**31 - 1


def _cells(name: str, bound: Sequence[float], whole: bool = True) -> int:
    if len(bound) != 3:
        raise ValueError(f"{name} must be [lo, hi, step], got {list(bound)}")
    lo, hi, step = (float(b) for b in bound)
    if not all(math.isfinite(b) for b in (lo, hi, step)):
        raise ValueError(f"{name} must be finite numbers [lo, hi, step], got {[lo, hi, step]}")
    if not step > 0:
        raise ValueError(f"{name} step must be > 0, got {step}")
    if not hi > lo:
        raise ValueError(f"{name} needs hi > lo, got lo={lo}, hi={hi}")
    n = (hi - lo) / step
    if n > MAX_CELLS_PER_AXIS + 1e-6:
        raise ValueError(
            f"{name} {[lo, hi, step]} gives {math.ceil(n - 1e-6)} cells, over the limit of {MAX_CELLS_PER_AXIS} "
            f"cells per axis: use a larger step or a smaller range (steps are in metres)"
        )
    if not whole:  # depth bins follow arange(lo, hi, step), as in LSS
        return int(math.ceil(n - 1e-6))
    if abs(n - round(n)) > 1e-6:
        raise ValueError(f"{name}: (hi - lo) / step = {n} is not a whole number of cells")
    return int(round(n))


@dataclass(frozen=True)
class Grid:
    """BEV voxel grid and depth bins. Defaults are the Lift-Splat-Shoot ones (200x200x1, D=41)."""

    xbound: tuple[float, float, float] = (-50.0, 50.0, 0.5)
    ybound: tuple[float, float, float] = (-50.0, 50.0, 0.5)
    zbound: tuple[float, float, float] = (-10.0, 10.0, 20.0)
    dbound: tuple[float, float, float] = (4.0, 45.0, 1.0)

    def __post_init__(self) -> None:
        for name in ("xbound", "ybound", "zbound", "dbound"):
            bound = tuple(float(b) for b in getattr(self, name))
            _cells(name, bound, whole=name != "dbound")
            object.__setattr__(self, name, bound)
        if self.nx * self.ny * self.nz > MAX_VOXELS:
            raise ValueError(
                f"the grid has {self.nz} x {self.nx} x {self.ny} = {self.nx * self.ny * self.nz} voxels, over the "
                f"limit of {MAX_VOXELS}: use larger steps in xbound/ybound/zbound"
            )

    @classmethod
    def from_any(cls, grid: Grid | dict | None) -> Grid:
        """Accept a Grid, a mapping of bounds (e.g. a Hydra config node) or None (defaults)."""
        if grid is None:
            return cls()
        if isinstance(grid, cls):
            return grid
        try:
            return cls(**{k: tuple(v) for k, v in dict(grid).items()})
        except TypeError as e:
            raise ValueError(
                f"bad grid config {dict(grid)}: expected keys xbound, ybound, zbound, dbound ({e})"
            ) from None

    @property
    def nx(self) -> int:
        return _cells("xbound", self.xbound)

    @property
    def ny(self) -> int:
        return _cells("ybound", self.ybound)

    @property
    def nz(self) -> int:
        return _cells("zbound", self.zbound)

    @property
    def depth_bins(self) -> int:
        return _cells("dbound", self.dbound, whole=False)

    @property
    def bev_shape(self) -> tuple[int, int]:
        """(X, Y): shape of BEV targets and predictions, indexed [x_index, y_index]."""
        return self.nx, self.ny

    @property
    def voxel_shape(self) -> tuple[int, int, int]:
        """(Z, X, Y): the per-sample grid shape handed to bev.ops."""
        return self.nz, self.nx, self.ny

    def depths(self) -> torch.Tensor:
        """Depth of each bin, metres: lo, lo + step, ... (D values)."""
        lo, _, step = self.dbound
        return lo + step * torch.arange(self.depth_bins, dtype=torch.float32)

    def cell_centers(self) -> np.ndarray:
        """(X, Y, 2) ego (x, y) of every BEV cell centre."""
        xs = self.xbound[0] + (np.arange(self.nx) + 0.5) * self.xbound[2]
        ys = self.ybound[0] + (np.arange(self.ny) + 0.5) * self.ybound[2]
        return np.stack(np.meshgrid(xs, ys, indexing="ij"), axis=-1)

    def xy_to_index(self, xy: np.ndarray) -> np.ndarray:
        """(..., 2) ego metres -> (..., 2) integer (x_index, y_index) by floor (may be out of range)."""
        xy = np.asarray(xy, dtype=np.float64)
        lo = np.array([self.xbound[0], self.ybound[0]])
        step = np.array([self.xbound[2], self.ybound[2]])
        return np.floor((xy - lo) / step).astype(np.int64)


def box_corners(boxes) -> np.ndarray:
    """(N, 9) boxes of BOX_FIELDS -> (N, 8, 3) ego corners: the bottom face counter-clockwise
    from the front-left corner (seen from above), then the top face in the same order."""
    b = np.asarray(torch.as_tensor(boxes).detach().cpu(), dtype=np.float64).reshape(-1, 9)
    half_l, half_w, half_h = b[:, 4:5] / 2, b[:, 3:4] / 2, b[:, 5:6] / 2
    # Box frame: x along the length (heading), y to its left.
    lx = np.concatenate([half_l, -half_l, -half_l, half_l], axis=1)  # front-left, rear-left, rear-right, front-right
    ly = np.concatenate([half_w, half_w, -half_w, -half_w], axis=1)
    c, s = np.cos(b[:, 6:7]), np.sin(b[:, 6:7])
    x = b[:, 0:1] + c * lx - s * ly
    y = b[:, 1:2] + s * lx + c * ly
    bottom = np.stack([x, y, np.broadcast_to(b[:, 2:3] - half_h, x.shape)], axis=-1)
    top = bottom.copy()
    top[..., 2] += 2 * half_h
    return np.concatenate([bottom, top], axis=1)


def quaternion_to_matrix(q: Sequence[float]) -> np.ndarray:
    """Unit quaternion (w, x, y, z) -> 3x3 rotation matrix (normalises the input)."""
    w, x, y, z = np.asarray(q, dtype=np.float64) / np.linalg.norm(q)
    return np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
            [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
            [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
        ]
    )


def matrix_to_quaternion(R: np.ndarray) -> np.ndarray:
    """3x3 rotation matrix -> unit quaternion (w, x, y, z) with w >= 0 (Shepperd: the largest of the four
    squared components is taken first, so the result stays accurate near 180 degrees)."""
    R = np.asarray(R, dtype=np.float64)
    t = np.trace(R)
    squares = [1 + t, 1 + 2 * R[0, 0] - t, 1 + 2 * R[1, 1] - t, 1 + 2 * R[2, 2] - t]  # 4 w^2, 4 x^2, ...
    k = int(np.argmax(squares))
    r = math.sqrt(max(squares[k], 0.0))
    off = [R[2, 1] - R[1, 2], R[0, 2] - R[2, 0], R[1, 0] - R[0, 1]]  # 4 w x, 4 w y, 4 w z
    sym = [R[0, 1] + R[1, 0], R[0, 2] + R[2, 0], R[1, 2] + R[2, 1]]  # 4 x y, 4 x z, 4 y z
    if k == 0:
        q = [r, off[0] / r, off[1] / r, off[2] / r]
    elif k == 1:
        q = [off[0] / r, r, sym[0] / r, sym[1] / r]
    elif k == 2:
        q = [off[1] / r, sym[0] / r, r, sym[2] / r]
    else:
        q = [off[2] / r, sym[1] / r, sym[2] / r, r]
    q = np.asarray(q) / np.linalg.norm(q)
    return q if q[0] >= 0 else -q


def yaw_to_quaternion(yaw: float) -> list[float]:
    """Rotation by `yaw` radians about +z as (w, x, y, z)."""
    return [math.cos(yaw / 2), 0.0, 0.0, math.sin(yaw / 2)]


def make_frustum(image_size: tuple[int, int], downsample: int, grid: Grid) -> torch.Tensor:
    """(D, fH, fW, 3) frustum of (u, v, d) in the augmented image.

    Feature cell (i, j) at stride `downsample` covers pixels [j*s, (j+1)*s) so its centre is
    u = j*s + (s-1)/2 (likewise v); d runs over grid.depths().
    """
    H, W = image_size
    if H % downsample or W % downsample:
        raise ValueError(f"image_size {image_size} must be divisible by downsample={downsample}")
    fH, fW = H // downsample, W // downsample
    s = float(downsample)
    us = torch.arange(fW, dtype=torch.float32) * s + (s - 1) / 2
    vs = torch.arange(fH, dtype=torch.float32) * s + (s - 1) / 2
    ds = grid.depths()
    d, v, u = torch.meshgrid(ds, vs, us, indexing="ij")
    return torch.stack([u, v, d], dim=-1)


def inverse_3x3(m: torch.Tensor) -> torch.Tensor:
    """Inverse of (..., 3, 3) matrices in closed form (adjugate / determinant).

    Elementwise ops only, so the geometry exports to ONNX (which has no matrix inverse) and runs
    the same in eager, torch.export and ONNX Runtime.
    """
    a, b, c = m[..., 0, 0], m[..., 0, 1], m[..., 0, 2]
    d, e, f = m[..., 1, 0], m[..., 1, 1], m[..., 1, 2]
    g, h, i = m[..., 2, 0], m[..., 2, 1], m[..., 2, 2]
    cof = torch.stack(
        [
            e * i - f * h,
            c * h - b * i,
            b * f - c * e,
            f * g - d * i,
            a * i - c * g,
            c * d - a * f,
            d * h - e * g,
            b * g - a * h,
            a * e - b * d,
        ],
        dim=-1,
    ).reshape(*m.shape)
    det = a * cof[..., 0, 0] + b * cof[..., 1, 0] + c * cof[..., 2, 0]
    return cof / det[..., None, None]


def frustum_to_ego(
    frustum: torch.Tensor,
    intrinsics: torch.Tensor,
    rots: torch.Tensor,
    trans: torch.Tensor,
    post_rots: torch.Tensor,
    post_trans: torch.Tensor,
) -> torch.Tensor:
    """Ego-frame (x, y, z) of every frustum point: (D, fH, fW, 3) + (B, N, ...) cams -> (B, N, D, fH, fW, 3)."""
    B, N = trans.shape[:2]
    # Undo the image augmentation, then unproject (u, v, d) -> camera -> ego.
    pts = frustum.view(1, 1, *frustum.shape) - post_trans.view(B, N, 1, 1, 1, 3)
    pts = inverse_3x3(post_rots) @ pts.reshape(B, N, -1, 3).transpose(-1, -2)  # (B, N, 3, P)
    pts = torch.cat([pts[:, :, :2] * pts[:, :, 2:3], pts[:, :, 2:3]], dim=2)
    cam_to_ego = rots @ inverse_3x3(intrinsics)
    pts = cam_to_ego @ pts + trans.unsqueeze(-1)
    return pts.transpose(-1, -2).reshape(B, N, *frustum.shape[:3], 3)


def ego_to_image(
    points: torch.Tensor,
    intrinsics: torch.Tensor,
    rots: torch.Tensor,
    trans: torch.Tensor,
    post_rots: torch.Tensor,
    post_trans: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Project ego points (..., P, 3) into one camera (..., 3, 3)/(..., 3): augmented (u, v) and depth.

    The inverse of frustum_to_ego; used for rendering and as an independent check in tests.
    """
    cam = (points - trans.unsqueeze(-2)) @ rots  # rows: R^T (p - t)
    depth = cam[..., 2]
    pix = cam @ intrinsics.transpose(-1, -2)
    uvd = torch.stack([pix[..., 0] / depth, pix[..., 1] / depth, depth], dim=-1)
    uvd = uvd @ post_rots.transpose(-1, -2) + post_trans.unsqueeze(-2)
    return uvd[..., :2], depth


def depth_bins_in_grid(
    grid: Grid,
    image_size: tuple[int, int],
    intrinsics: torch.Tensor,
    rots: torch.Tensor,
    trans: torch.Tensor,
    post_rots: torch.Tensor,
    post_trans: torch.Tensor,
    downsample: int = FEATURE_STRIDE,
) -> torch.Tensor:
    """(D,) bool: whether depth bin d puts any frustum point of these cameras ((B, N, ...) tensors) inside the grid."""
    frustum = make_frustum(image_size, downsample, grid)
    idx = voxel_coords(frustum_to_ego(frustum, intrinsics, rots, trans, post_rots, post_trans), grid)
    inside = ((idx >= 0) & (idx < torch.tensor([grid.nz, grid.nx, grid.ny]))).all(-1)  # (B, N, D, fH, fW)
    return inside.transpose(0, 2).reshape(grid.depth_bins, -1).any(-1)


def voxel_coords(points: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Ego points (..., 3) -> int64 (..., 3) voxel indices in (z, x, y) order by floor.

    Indices outside the grid stay outside (clamped to -1 or n) so bev.ops ignores them;
    NaN/inf points map outside too instead of to an undefined integer. The bounds enter as
    scalars, one axis at a time: a tensor made from them on every call would be a host-to-device
    copy on a GPU, which waits for all queued work and cannot be captured in a CUDA graph.
    """
    axes = ((2, grid.zbound, grid.nz), (0, grid.xbound, grid.nx), (1, grid.ybound, grid.ny))
    cols = []
    for axis, (lo, _, step), n in axes:
        idx = torch.floor((points[..., axis] - lo) / step)
        cols.append(torch.nan_to_num(idx, nan=-1.0, posinf=float(n), neginf=-1.0).clamp(-1.0, float(n)))
    return torch.stack(cols, dim=-1).long()
