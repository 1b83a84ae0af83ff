"""BEV data augmentation (BEVDet's BDA): a random rotation about z, a scale and x / y flips of the ego frame,
drawn per training item as one 3x3 matrix A and applied to everything that lives in that frame alike.

    point   p' = A p                          (A = flip @ scale * rot_z(angle); z is scaled too)
    camera  rots' = A rots, trans' = A trans   (folded into the lift geometry: the frustum lands at A p)
    box     centre' = A centre, size' = scale * size, yaw' = heading of A (cos yaw, sin yaw, 0),
            velocity' = A[:2, :2] velocity
    boxes'  footprints A p, rasterised anew (object targets and visibility)
    raster  map target'[cell] = target[cell of A^-1 (centre of cell)]  (nearest; 0 outside the grid)

Depth targets are per camera pixel and do not change. The matrix travels with the item as `bev_aug`, so
that anything in the augmented frame maps back with its inverse.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bev.geometry import BOX_CENTER, BOX_FIELDS, BOX_SIZE, BOX_VELOCITY, BOX_YAW, Grid

# BEVDet-R50's ranges (GlobalRotScaleTrans and RandomFlip3D of its config), the `bevdet` preset.
BEVDET = {"rot_lim": (-22.5, 22.5), "scale_lim": (0.95, 1.05), "flip_x": 0.5, "flip_y": 0.5}
PRESETS = {"bevdet": BEVDET}


@dataclass(frozen=True)
class BevAugRanges:
    """rot_lim degrees [lo, hi], scale_lim [lo, hi] (> 0), flip_x / flip_y probabilities of x -> -x / y -> -y."""

    rot_lim: tuple[float, float] = (0.0, 0.0)
    scale_lim: tuple[float, float] = (1.0, 1.0)
    flip_x: float = 0.0
    flip_y: float = 0.0

    @classmethod
    def from_any(cls, value: Any) -> BevAugRanges | None:
        """None (off), a preset name ("bevdet") or a mapping of the fields; anything else is a clear error."""
        if value is None or isinstance(value, cls):
            return value
        fix = f"data.bev_aug must be null, one of {sorted(PRESETS)} or {{rot_lim: [lo, hi], scale_lim: [lo, hi], flip_x: p, flip_y: p}}"
        if isinstance(value, str):
            if value not in PRESETS:
                raise ValueError(f"{fix}, got {value!r}")
            value = PRESETS[value]
        if not isinstance(value, Mapping) or set(value) - set(BEVDET):
            raise ValueError(f"{fix}, got {value!r}")
        return cls(**{k: _checked(k, v) for k, v in value.items()})

    def draw(self) -> np.ndarray:
        """One random (3, 3) float64 matrix A, from torch's generator (seeded per loader worker)."""
        u = torch.rand(4, dtype=torch.float64).tolist()
        angle = math.radians(self.rot_lim[0] + u[0] * (self.rot_lim[1] - self.rot_lim[0]))
        scale = self.scale_lim[0] + u[1] * (self.scale_lim[1] - self.scale_lim[0])
        return bev_matrix(angle, scale, -1.0 if u[2] < self.flip_x else 1.0, -1.0 if u[3] < self.flip_y else 1.0)


# Sane ranges: a rotation is within +-180 degrees; a scale s moves what lies at r to s r, so at 2 the outer half
# of the grid (3/4 of its cells) leaves it and at 0.5 the outer half is left empty. BEVDet draws 0.95-1.05.
LIMITS = {"rot_lim": (-180.0, 180.0), "scale_lim": (0.5, 2.0)}


def _checked(name: str, v: Any) -> Any:
    """A field's value, checked and normalised; an error names data.bev_aug.<name> and its range."""
    if name in ("flip_x", "flip_y"):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise ValueError(f"data.bev_aug.{name} must be a probability in [0, 1], got {v!r}")
        return float(v)
    lo, hi = LIMITS[name]
    pair = None if isinstance(v, (str, bytes)) or not isinstance(v, Sequence) or len(v) != 2 else tuple(v)
    if pair is None or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in pair):
        raise ValueError(f"data.bev_aug.{name} must be [lo, hi], two numbers within [{lo:g}, {hi:g}], got {v!r}")
    a, b = (float(x) for x in pair)
    if not (lo <= a <= b <= hi):  # NaN fails too
        unit = "degrees" if name == "rot_lim" else "the factor that moves what lies at r to s r"
        raise ValueError(
            f"data.bev_aug.{name} must be [lo, hi] with {lo:g} <= lo <= hi <= {hi:g} ({unit}; BEVDet's: "
            f"{list(BEVDET[name])}), got {v!r}"
        )
    return (a, b)


def bev_matrix(angle: float, scale: float = 1.0, flip_x: float = 1.0, flip_y: float = 1.0) -> np.ndarray:
    """flip @ (scale * rot_z(angle)), (3, 3) float64, BEVDet's order (rotate and scale, then flip)."""
    c, s = math.cos(angle), math.sin(angle)
    rot = np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])
    return np.diag([flip_x, flip_y, 1.0]) @ (scale * rot)


def transform_boxes(boxes: np.ndarray, A: np.ndarray) -> np.ndarray:
    """(N, 9) BOX_FIELDS rows in the frame A maps to (module doc); NaN velocities stay NaN."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, len(BOX_FIELDS))
    out = boxes.copy()
    out[:, BOX_CENTER] = boxes[:, BOX_CENTER] @ A.T
    out[:, BOX_SIZE] = boxes[:, BOX_SIZE] * _scale(A)
    heading = np.stack([np.cos(boxes[:, BOX_YAW]), np.sin(boxes[:, BOX_YAW])], 1) @ A[:2, :2].T
    yaw = np.arctan2(heading[:, 1], heading[:, 0])
    out[:, BOX_YAW] = np.where(yaw >= math.pi, -math.pi, yaw)
    out[:, BOX_VELOCITY] = boxes[:, BOX_VELOCITY] @ A[:2, :2].T
    return out


def _scale(A: np.ndarray) -> float:
    return float(math.sqrt(abs(np.linalg.det(A[:2, :2]))))


def warp_raster(raster: torch.Tensor, A: np.ndarray, grid: Grid, fill: float = 0) -> torch.Tensor:
    """(..., X, Y) BEV raster in the frame A maps to: each cell takes the value of the source cell under
    A^-1 of its centre (nearest; `fill` where that falls outside the grid). Same dtype as the input."""
    if raster.numel() == 0:
        return raster.clone()
    inv = np.linalg.inv(A[:2, :2])
    (xlo, _, xs), (ylo, _, ys) = grid.xbound, grid.ybound
    x = xlo + (np.arange(grid.nx) + 0.5) * xs
    y = ylo + (np.arange(grid.ny) + 0.5) * ys
    pts = np.stack(np.meshgrid(x, y, indexing="ij"), -1) @ inv.T  # (X, Y, 2) source coordinates
    ix, iy = np.floor((pts[..., 0] - xlo) / xs).astype(np.int64), np.floor((pts[..., 1] - ylo) / ys).astype(np.int64)
    inside = torch.from_numpy((ix >= 0) & (ix < grid.nx) & (iy >= 0) & (iy < grid.ny))
    flat = torch.from_numpy(np.clip(ix, 0, grid.nx - 1) * grid.ny + np.clip(iy, 0, grid.ny - 1))
    src = raster.reshape(*raster.shape[:-2], -1)
    out = src[..., flat.reshape(-1)].reshape(raster.shape)
    return torch.where(inside, out, torch.full((), fill, dtype=raster.dtype))


def apply_to_geometry(item: dict[str, Any], A: np.ndarray) -> None:
    """rots, trans (camera -> ego) of an item as camera -> augmented ego, in place."""
    At = torch.from_numpy(A).to(item["rots"].dtype)
    item["rots"] = At @ item["rots"]
    item["trans"] = item["trans"] @ At.T


__all__ = ["BEVDET", "BevAugRanges", "apply_to_geometry", "bev_matrix", "transform_boxes", "warp_raster"]
