"""CenterPoint-style training targets of the detection head, in numpy (they are built in DataLoader workers).

Per sample, from boxes (M, 9) in bev.geometry.BOX_FIELDS order and class ids into DETECTION_CLASSES:
- det_heatmap (C, X, Y) float32: per class a Gaussian peak of value exactly 1 at each box centre's cell,
  radius max(min_radius, CenterNet's radius of the box's (l, w) in cells), sigma = diameter / 6; where
  Gaussians overlap the maximum is kept.
- det_index (N,) int64: flat cell index x_index * Y + y_index of each box centre (N = max_objects).
- det_label (N,) int64: the box's class (its group selects the regression maps); -1 on padding.
- det_mask (N,) bool: which of the N slots hold a box.
- det_target (N, 10) float32 in REGRESSION_FIELDS order.
- det_vel_mask (N,) bool: the box has a velocity (the devkit gives NaN for a lone annotation).
Cells follow bev.geometry.Grid: cell i covers [lo + i * step, lo + (i + 1) * step) (floor).
gather_regression (torch) reads a slot's values from the head's maps: the inverse of this layout.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from bev.classes import DETECTION_CLASSES, DETECTION_GROUPS
from bev.geometry import BOX_FIELDS, BOX_SIZE, BOX_VELOCITY, BOX_YAW, MAX_BOXES, Grid

# The regression channels of every class group, in the order of det_target's last axis and of the
# head's `regression` maps: the centre's offset in its cell (cells), z (m), log size (m), heading, velocity.
REGRESSION_FIELDS = ("dx", "dy", "z", "log_w", "log_l", "log_h", "sin_yaw", "cos_yaw", "vx", "vy")
VELOCITY_SLICE = slice(8, 10)
# Where the head regresses velocity: "ego" (the targets' frame, the peers') or "box" (along and across the
# box's heading): a car's velocity in the ego frame is its speed times its heading, a product that the light
# head's last linear layer cannot form from features that hold the speed; in the box frame it is the speed.
VELOCITY_FRAMES = ("ego", "box")


def check_velocity_frame(frame: str) -> str:
    if frame not in VELOCITY_FRAMES:
        raise ValueError(f"model.detection.velocity_frame must be one of {VELOCITY_FRAMES}, got {frame!r}")
    return frame


def rotate_velocity(v: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """(..., 2) velocities rotated by the yaw of (sin, cos): box frame -> ego frame, or ego -> box with inverse."""
    s = -sin if inverse else sin
    return torch.stack([cos * v[..., 0] - s * v[..., 1], s * v[..., 0] + cos * v[..., 1]], -1)


def class_to_group(groups: tuple[tuple[str, ...], ...] = DETECTION_GROUPS) -> tuple[int, ...]:
    """Group index of each class of DETECTION_CLASSES. The groups must split DETECTION_CLASSES into
    contiguous runs, in order, so that the head's heatmap channel k is class k."""
    flat = tuple(name for group in groups for name in group)
    if flat != DETECTION_CLASSES or any(not group for group in groups):
        raise ValueError(
            f"detection groups {[list(g) for g in groups]} must split DETECTION_CLASSES {list(DETECTION_CLASSES)} "
            "into non-empty contiguous runs in that order, e.g. bev.classes.DETECTION_GROUPS"
        )
    return tuple(g for g, group in enumerate(groups) for _ in group)


def gaussian_radius(length: float, width: float, overlap: float = 0.1) -> float:
    """CenterNet's heatmap radius (cells) for a box of length x width cells, as CenterNet's, CenterPoint's
    and mmdet3d's code compute it: the three CornerNet quadratics, each root taken as (b + sqrt(disc)) / 2.
    That is not the geometric root of two of them (no division by 2a), but it is the radius the published
    CenterPoint / BEVDet / BEVFusion numbers were trained with, so it is kept as is."""
    h, w, o = float(length), float(width), float(overlap)
    b1 = h + w
    c1 = w * h * (1 - o) / (1 + o)
    r1 = (b1 + math.sqrt(b1 * b1 - 4 * c1)) / 2
    b2 = 2 * (h + w)
    c2 = (1 - o) * w * h
    r2 = (b2 + math.sqrt(b2 * b2 - 16 * c2)) / 2
    a3 = 4 * o
    b3 = -2 * o * (h + w)
    c3 = (o - 1) * w * h
    r3 = (b3 + math.sqrt(b3 * b3 - 4 * a3 * c3)) / 2
    return min(r1, r2, r3)


def heatmap_radius(length: float, width: float, min_radius: int = 2, overlap: float = 0.1) -> int:
    """Integer radius in cells of a box's peak: max(min_radius, int(gaussian_radius)), as the peers do."""
    return max(int(min_radius), int(gaussian_radius(length, width, overlap)))


@lru_cache(maxsize=64)
def gaussian_kernel(radius: int) -> np.ndarray:
    """(2r + 1, 2r + 1) float32 Gaussian of sigma = diameter / 6 with 1 at its centre (cached: read only)."""
    sigma = (2 * radius + 1) / 6
    d = np.arange(-radius, radius + 1, dtype=np.float64)
    g = np.exp(-(d[:, None] ** 2 + d[None, :] ** 2) / (2 * sigma * sigma))
    g[g < np.finfo(np.float64).eps * g.max()] = 0  # the peers' cut of negligible tails
    g = g.astype(np.float32)
    g.flags.writeable = False
    return g


def draw_gaussian(heatmap: np.ndarray, ix: int, iy: int, radius: int) -> None:
    """Max a Gaussian peak of `radius` centred on cell (ix, iy) into heatmap (X, Y) in place, clipped at
    the edges."""
    nx, ny = heatmap.shape
    kernel = gaussian_kernel(radius)
    x0, x1 = max(ix - radius, 0), min(ix + radius + 1, nx)
    y0, y1 = max(iy - radius, 0), min(iy + radius + 1, ny)
    patch = kernel[x0 - ix + radius : x1 - ix + radius, y0 - iy + radius : y1 - iy + radius]
    np.maximum(heatmap[x0:x1, y0:y1], patch, out=heatmap[x0:x1, y0:y1])


def _check_inputs(boxes: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    boxes = np.asarray(boxes, dtype=np.float64)
    labels = np.asarray(labels)
    if boxes.ndim != 2 or boxes.shape[1] != len(BOX_FIELDS):
        raise ValueError(f"boxes must be (M, {len(BOX_FIELDS)}) rows of {BOX_FIELDS}, got shape {boxes.shape}")
    if labels.shape != (boxes.shape[0],) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be (M,) integers for {boxes.shape[0]} boxes, got {labels.dtype} {labels.shape}")
    bad_label = (labels < -1) | (labels >= len(DETECTION_CLASSES))
    if bad_label.any():
        raise ValueError(
            f"labels {sorted(set(labels[bad_label].tolist()))} are not class ids: use 0..{len(DETECTION_CLASSES) - 1} "
            f"(DETECTION_CLASSES) or -1 for a box not trained on"
        )
    kept = labels >= 0
    geometry = boxes[kept, :7]  # velocity may be NaN (no neighbouring annotation)
    if not np.isfinite(geometry).all() or not (geometry[:, BOX_SIZE] > 0).all():
        raise ValueError(
            "boxes trained on need finite x, y, z, yaw and sizes w, l, h > 0 (metres); "
            "give such a box the label -1 to leave it out"
        )
    return boxes, labels.astype(np.int64)


def encode_targets(
    boxes: np.ndarray,
    labels: np.ndarray,
    grid: Grid,
    max_objects: int = MAX_BOXES,
    min_radius: int = 2,
    overlap: float = 0.1,
) -> dict[str, np.ndarray]:
    """Targets of one sample (module docstring). Boxes labelled -1 and boxes whose centre lies outside
    the grid are left out; past max_objects boxes still draw their peak but get no regression slot."""
    boxes, labels = _check_inputs(boxes, labels)
    nx, ny = grid.bev_shape
    steps = np.array([grid.xbound[2], grid.ybound[2]])
    lo = np.array([grid.xbound[0], grid.ybound[0]])
    cells = (boxes[:, :2] - lo) / steps  # continuous cell coordinates of the centres
    index = np.floor(cells).astype(np.int64)
    inside = (index[:, 0] >= 0) & (index[:, 0] < nx) & (index[:, 1] >= 0) & (index[:, 1] < ny)
    keep = np.flatnonzero((labels >= 0) & inside)

    heatmap = np.zeros((len(DETECTION_CLASSES), nx, ny), dtype=np.float32)
    for k in keep:
        # CenterNet's radius takes the footprint in cells: length along the heading, width across it.
        radius = heatmap_radius(boxes[k, 4] / steps[0], boxes[k, 3] / steps[1], min_radius, overlap)
        draw_gaussian(heatmap[labels[k]], int(index[k, 0]), int(index[k, 1]), radius)

    slots = keep[:max_objects]
    n = len(slots)
    det_index = np.zeros(max_objects, dtype=np.int64)
    det_label = np.full(max_objects, -1, dtype=np.int64)
    det_mask = np.zeros(max_objects, dtype=bool)
    det_vel_mask = np.zeros(max_objects, dtype=bool)
    target = np.zeros((max_objects, len(REGRESSION_FIELDS)), dtype=np.float32)
    b = boxes[slots]
    det_index[:n] = index[slots, 0] * ny + index[slots, 1]
    det_label[:n] = labels[slots]
    det_mask[:n] = True
    target[:n, 0:2] = cells[slots] - index[slots]
    target[:n, 2] = b[:, 2]
    target[:n, 3:6] = np.log(b[:, BOX_SIZE])
    target[:n, 6] = np.sin(b[:, BOX_YAW])
    target[:n, 7] = np.cos(b[:, BOX_YAW])
    has_velocity = np.isfinite(b[:, BOX_VELOCITY]).all(axis=1)
    det_vel_mask[:n] = has_velocity
    target[:n, 8:10] = np.where(has_velocity[:, None], b[:, BOX_VELOCITY], 0.0)
    return {
        "det_heatmap": heatmap,
        "det_index": det_index,
        "det_label": det_label,
        "det_mask": det_mask,
        "det_target": target,
        "det_vel_mask": det_vel_mask,
    }


def gather_regression(
    regression: torch.Tensor, index: torch.Tensor, label: torch.Tensor, class_group: torch.Tensor
) -> torch.Tensor:
    """(B, G, R, X, Y) maps -> (B, N, R): each slot's R values at its cell (det_index) from the maps of its
    class's group (class_group (C,), class_to_group as a tensor). Padding slots (label -1) read group 0's
    maps; their mask zeroes them."""
    b, g, r, x, y = regression.shape
    group = class_group[label.clamp(min=0)]  # (B, N)
    channels = torch.arange(r, device=index.device)
    # Flat offset of (group, channel, cell) in one sample's G * R * X * Y values: a view, no copy.
    flat = ((group * r)[..., None] + channels) * (x * y) + index[..., None]  # (B, N, R)
    return regression.reshape(b, g * r * x * y).gather(1, flat.reshape(b, -1)).view(b, -1, r)
