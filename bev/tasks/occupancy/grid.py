"""Occ3D-nuScenes's voxel grid and classes: the one home of these facts in the project.

Frame and axis order (read from the public code of the CVPR 2023 occupancy challenge,
github.com/CVPR2023-3D-Occupancy-Prediction/CVPR2023-3D-Occupancy-Prediction):

- The grid lives in the EGO frame of the sample's LIDAR_TOP sample_data (its ego pose), not in the
  lidar frame: the baseline's encoder (projects/mmdet3d_plugin/bevformer/modules/encoder.py,
  `point_sampling`) spreads its reference points over the range below and maps them through `ego2lidar`
  (built in projects/mmdet3d_plugin/datasets/nuscenes_occ.py from LIDAR_TOP's calibrated_sensor) before
  `lidar2img`, i.e. the voxel coordinates are ego coordinates. Its visualiser (utils/vis.py) draws the ego
  car's box at the grid's origin. This is the project's ego frame (bev.geometry): x forward, y left, z up.
- A (200, 200, 16) array is indexed [x, y, z]: `voxel2points` in
  projects/mmdet3d_plugin/datasets/occ_metrics.py (Metric_FScore) and in utils/vis.py turns index
  (i, j, k) into (range[0] + (i + 0.5) * 0.4, range[1] + (j + 0.5) * 0.4, range[2] + (k + 0.5) * 0.4).
  So axis 0 is ego x (forward), as the project's BEV arrays ([x_index, y_index]); the voxel grids handed to
  bev.ops are (Z, X, Y): use to_zxy / from_zxy.
- Voxel (i, j, k) covers [lo + i * 0.4, lo + (i + 1) * 0.4) per axis (floor binning, bev.geometry's rule).

Classes 0-16 are nuScenes-lidarseg's 16 classes plus 0 "others" (the README of the challenge repository),
17 is free space. Note: that repository's Metric_mIoU lists its class names in another order (car first)
when it prints; the ids in the files follow the README order below.
"""

from __future__ import annotations

import math

import numpy as np

from bev.classes import DETECTION_CLASSES
from bev.geometry import Grid

# [x_min, y_min, z_min, x_max, y_max, z_max], metres, ego frame.
OCC_RANGE: tuple[float, ...] = (-40.0, -40.0, -1.0, 40.0, 40.0, 5.4)
VOXEL_SIZE = 0.4
OCC_SHAPE: tuple[int, int, int] = (200, 200, 16)  # [x, y, z]

OCC3D_CLASSES: tuple[str, ...] = (
    "others",
    "barrier",
    "bicycle",
    "bus",
    "car",
    "construction_vehicle",
    "motorcycle",
    "pedestrian",
    "traffic_cone",
    "trailer",
    "truck",
    "driveable_surface",
    "other_flat",
    "sidewalk",
    "terrain",
    "manmade",
    "vegetation",
    "free",
)
NUM_CLASSES = len(OCC3D_CLASSES)  # 18
CLASS_ID = {name: i for i, name in enumerate(OCC3D_CLASSES)}
FREE = CLASS_ID["free"]  # 17: not occupied; excluded from the mean IoU
SCORED_CLASSES = tuple(range(FREE))  # 0..16: the classes the mIoU averages over

# The project's detection classes (bev.classes) -> Occ3D ids: the names coincide.
DETECTION_TO_OCC3D: dict[str, int] = {name: CLASS_ID[name] for name in DETECTION_CLASSES}


def occ3d_grid(dbound: tuple[float, float, float] = Grid.dbound) -> Grid:
    """The Occ3D grid as a bev.geometry.Grid (x, y [-40, 40, 0.4], z [-1, 5.4, 0.4]) with the given depth bins."""
    lo, hi = OCC_RANGE[:3], OCC_RANGE[3:]
    x, y, z = ((lo[a], hi[a], VOXEL_SIZE) for a in range(3))
    return Grid(xbound=x, ybound=y, zbound=z, dbound=tuple(dbound))


def voxel_centres() -> np.ndarray:
    """(200, 200, 16, 3) float64 ego coordinates of every voxel centre, indexed [x, y, z]."""
    axes = [OCC_RANGE[a] + (np.arange(OCC_SHAPE[a]) + 0.5) * VOXEL_SIZE for a in range(3)]
    return np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1)


def points_to_voxels(points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, 3) ego points -> (N, 3) int64 voxel indices [i, j, k] by floor, and (N,) whether each is inside the grid."""
    p = np.asarray(points, dtype=np.float64).reshape(-1, 3)
    idx = np.floor((p - np.asarray(OCC_RANGE[:3])) / VOXEL_SIZE).astype(np.int64)
    inside = np.all((idx >= 0) & (idx < np.asarray(OCC_SHAPE)), axis=1)
    return idx, inside


def column_distances() -> np.ndarray:
    """(200, 200) xy distance (m) from the ego origin to the centre of every voxel column [x, y]."""
    c = voxel_centres()[:, :, 0, :2]
    return np.hypot(c[..., 0], c[..., 1])


def to_zxy(volume):
    """An Occ3D-ordered array or tensor (..., X, Y, Z) -> (..., Z, X, Y), bev.ops's order (a view)."""
    return _move(volume, -1, -3)


def from_zxy(volume):
    """bev.ops's (..., Z, X, Y) -> Occ3D's (..., X, Y, Z) (a view)."""
    return _move(volume, -3, -1)


def _move(a, src: int, dst: int):
    if isinstance(a, np.ndarray):
        return np.moveaxis(a, src, dst)
    return a.movedim(src, dst)  # torch


# The farthest point of the grid from the ego in xy (its corners), metres.
GRID_REACH = math.hypot(OCC_RANGE[3], OCC_RANGE[4])
