"""Occupancy targets of a dataset item (data.occupancy=true): Occ3D-nuScenes's labels of the sample, read from
`<dataroot>/gts/<scene name>/<sample token>/labels.npz` (the layout of the Occ3D-nuScenes download, so that
extracting it next to nuScenes is all a user does), and moved with the item's BEV augmentation.

Item keys: occ_semantics (200, 200, 16) uint8 class ids (IGNORE where a BEV augmentation brought in voxels from
outside the grid), occ_mask_camera and occ_mask_lidar (200, 200, 16) bool; all indexed [x, y, z] (grid.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from bev.tasks.occupancy.grid import OCC_RANGE, OCC_SHAPE, VOXEL_SIZE, voxel_centres
from bev.tasks.occupancy.io import labels_path, read_labels
from bev.utils.io import safe_name

IGNORE = 255  # a voxel without a label: skipped by the loss and by the metric (Occ3D skips ids >= 18)
ITEM_KEYS = ("occ_semantics", "occ_mask_camera", "occ_mask_lidar")
DOWNLOAD = (
    "download Occ3D-nuScenes's ground truth (gts.tar.gz: the 'Download' section of "
    "github.com/CVPR2023-3D-Occupancy-Prediction/CVPR2023-3D-Occupancy-Prediction) and extract it into the "
    "nuScenes folder, next to samples/ and the table folder; a synthetic set written without them (make train's) gets them with "
    "bev-make-synthetic --out <dataroot> <its options> --occupancy-only"
)


def check_gts(dataroot: str | os.PathLike, scene_names: Iterable[str], split: str) -> Path:
    """<dataroot>/gts, once it holds a folder for every scene of the split; else one FileNotFoundError saying
    where it looked and how to get the labels."""
    gts = Path(dataroot) / "gts"
    if not gts.is_dir():
        raise FileNotFoundError(
            f"data.occupancy=true reads Occ3D labels from <dataroot>/gts/<scene name>/<sample token>/labels.npz, "
            f"but there is no folder {gts}: {DOWNLOAD}"
        )
    names = sorted(set(scene_names))
    missing = [n for n in names if not (gts / safe_name(n)).is_dir()]
    if missing:
        raise FileNotFoundError(
            f"data.occupancy=true: {gts} has no folder for {len(missing)} of the {len(names)} scenes of split "
            f"{split!r} (e.g. {', '.join(missing[:3])}): {DOWNLOAD}"
        )
    return gts


def occupancy_item(dataroot: str | os.PathLike, scene_name: str, sample_token: str, A=None) -> dict[str, torch.Tensor]:
    """The three occupancy arrays of one sample as item tensors, in the frame the BEV augmentation A maps to."""
    labels = read_labels(labels_path(dataroot, scene_name, sample_token))
    sem, cam, lidar = labels.semantics, labels.mask_camera, labels.mask_lidar
    if A is not None:
        sem, cam, lidar = warp_voxels(np.asarray(A, dtype=np.float64), sem, cam, lidar)
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in zip(ITEM_KEYS, (sem, cam, lidar))}


def source_voxels(A: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each voxel of the augmented grid, the flat index of the voxel under A^-1 of its centre (nearest) and
    whether that lies inside the grid. A scales z with x and y (bev.data.bev_aug), so z is resampled too."""
    src = voxel_centres() @ np.linalg.inv(A).T
    idx = np.floor((src - np.asarray(OCC_RANGE[:3])) / VOXEL_SIZE).astype(np.int64)
    inside = np.all((idx >= 0) & (idx < np.asarray(OCC_SHAPE)), axis=-1)
    idx = np.clip(idx, 0, np.asarray(OCC_SHAPE) - 1)
    flat = np.ravel_multi_index(tuple(np.moveaxis(idx, -1, 0)), OCC_SHAPE)
    return flat, inside


def warp_voxels(A: np.ndarray, semantics: np.ndarray, *masks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Semantics and masks (200, 200, 16) in the frame A maps to; voxels from outside the grid get IGNORE and
    False (unobserved: neither trained on under the camera mask nor scored)."""
    flat, inside = source_voxels(A)
    sem = np.where(inside, semantics.reshape(-1)[flat], IGNORE).astype(np.uint8)
    return (sem, *(np.where(inside, m.reshape(-1)[flat], False) for m in masks))
