"""Detection items: one sample's boxes as fixed-size ground truth and CenterPoint targets."""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import torch

from bev.data.bev_aug import transform_boxes
from bev.geometry import BOX_FIELDS, BOX_VELOCITY, MAX_BOXES, Grid
from bev.tasks.detection.targets import encode_targets


def pad_boxes(
    boxes: np.ndarray, labels: np.ndarray, valid: np.ndarray, max_boxes: int = MAX_BOXES, where: str = "a sample"
) -> dict[str, np.ndarray]:
    """Fixed-size detection targets from one sample's boxes (detection_boxes): only valid boxes are kept.

    det_boxes (max_boxes, 9) float32 (BOX_FIELDS; padding and NaN velocities are 0), det_labels (max_boxes,)
    int64 (-1 for padding), det_velocity_valid (max_boxes,) bool (a real box whose velocity is known).
    More than max_boxes valid boxes: the max_boxes nearest the ego (xy) are kept, in their order, and
    the rest counted in a warning."""
    boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, len(BOX_FIELDS))
    keep = np.flatnonzero(np.asarray(valid, dtype=bool) & (np.asarray(labels) >= 0))
    if len(keep) > max_boxes:
        dist = np.hypot(boxes[keep, 0], boxes[keep, 1])
        warnings.warn(
            f"{where} has {len(keep)} valid detection boxes, more than max_boxes={max_boxes}: the "
            f"{len(keep) - max_boxes} farthest are not trained on",
            stacklevel=2,
        )
        keep = np.sort(keep[np.argsort(dist, kind="stable")[:max_boxes]])
    n = len(keep)
    out_boxes = np.zeros((max_boxes, len(BOX_FIELDS)), np.float32)
    out_boxes[:n] = boxes[keep]
    vel = out_boxes[:, BOX_VELOCITY]
    velocity_valid = np.isfinite(vel).all(1) & (np.arange(max_boxes) < n)
    vel[~np.isfinite(vel)] = 0.0
    out_labels = np.full(max_boxes, -1, np.int64)
    out_labels[:n] = np.asarray(labels, dtype=np.int64)[keep]
    return {"det_boxes": out_boxes, "det_labels": out_labels, "det_velocity_valid": velocity_valid}


def trained_mask(det: dict[str, np.ndarray], det_range: str) -> np.ndarray:
    """Which of a sample's detection boxes (NuScenesBEVDataset.detection_boxes) are trained on: the devkit's
    ground-truth filter (det_range "class": points and the class range) or every box with points ("grid")."""
    return det["valid"] if det_range == "class" else det["points"] > 0


def detection_boxes(index: Mapping[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """Sample i's detection boxes from a split's index (bev.data.index): boxes (M, 9) float32 rows of
    bev.geometry.BOX_FIELDS (ego frame; velocity NaN where the devkit has none), labels (M,) int64 into
    DETECTION_CLASSES, attributes (M,) str ("" for none), points (M,) int64 (lidar + radar), valid (M,) bool (the
    devkit's GT filter), tokens (M,) str (sample_annotation)."""
    a, b = index["det_offsets"][i], index["det_offsets"][i + 1]
    velocity = np.where(index["det_velocity_known"][a:b, None], index["det_velocity"][a:b], np.nan)
    boxes = np.concatenate([index["det_center"][a:b], index["det_size"][a:b], index["det_yaw"][a:b, None], velocity], 1)
    return {
        "boxes": boxes.astype(np.float32).reshape(-1, len(BOX_FIELDS)),
        "labels": index["det_label"][a:b].copy(),
        "attributes": index["det_attribute_names"][index["det_attribute"][a:b]].astype(str),
        "points": index["det_points"][a:b].copy(),
        "valid": index["det_valid"][a:b].copy(),
        "tokens": np.asarray([t.decode() for t in index["det_token"][a:b]], dtype=str),
    }


def detection_item(
    det: Mapping[str, np.ndarray],
    grid: Grid,
    det_range: str = "class",
    bev_aug: np.ndarray | None = None,
    where: str = "a sample",
) -> dict[str, torch.Tensor]:
    """The detection fields of one sample's boxes (detection_boxes) as tensors: pad_boxes of them (det_boxes,
    det_labels, det_velocity_valid: the ground truth for pictures) and their CenterPoint targets on the grid
    (bev.tasks.detection.targets.encode_targets: det_heatmap, det_index, ...). Trained boxes: the devkit's ground-truth
    filter (det_range "class") or every box with points ("grid": the targets drop those outside the grid);
    bev_aug: the item's BEV augmentation matrix (bev.data.bev_aug), applied to them."""
    valid = trained_mask(det, det_range)
    boxes = det["boxes"] if bev_aug is None else transform_boxes(det["boxes"], bev_aug).astype(np.float32)
    padded = pad_boxes(boxes, det["labels"], valid, where=where)
    labels = np.where(valid, det["labels"], -1)
    targets = encode_targets(boxes, labels, grid, max_objects=MAX_BOXES)
    return {k: torch.from_numpy(v) for k, v in {**padded, **targets}.items()}
