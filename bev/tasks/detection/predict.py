"""What bev-predict writes of the detection task's boxes: the npz arrays, the predictions.json fields and records,
and the velocities of the boxes' tracks over the key frames before (as bev-eval scores them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from bev.classes import DETECTION_CLASSES
from bev.geometry import BOX_FIELDS


def boxes_format(threshold: float) -> dict[str, Any]:
    """What predictions.json says of the boxes of its records and npz files."""
    return {
        "box_fields": list(BOX_FIELDS),
        "box_frame": "ego frame of the sample's LIDAR_TOP: x forward, y left, z up (m); yaw counter-clockwise "
        "from x (rad); velocity (vx, vy) m/s (bev.geometry)",
        "detection_classes": list(DETECTION_CLASSES),
        "box_threshold": threshold,
        "boxes_format": "each sample's 'boxes' lists the boxes at score >= box_threshold; its npz holds every "
        "decoded box: det_boxes (M, 9) box_fields, det_scores (M,), det_labels (M,) into detection_classes",
    }


def box_arrays(det: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The npz arrays of one sample's decoded boxes."""
    return {
        "det_boxes": det["boxes"].detach().float().cpu().numpy().reshape(-1, len(BOX_FIELDS)),
        "det_scores": det["scores"].detach().float().cpu().numpy(),
        "det_labels": det["labels"].cpu().numpy().astype(np.int64),
        "_box_fields": np.asarray(BOX_FIELDS),
        "_detection_classes": np.asarray(DETECTION_CLASSES),
    }


def box_records(det: Mapping[str, Any], threshold: float) -> dict[str, Any]:
    """A sample's boxes for predictions.json: how many were decoded, and those at score >= threshold."""
    keep = det["scores"] >= threshold
    boxes = [
        {"label": DETECTION_CLASSES[int(label)], "score": round(float(score), 4)}
        | {k: round(float(v), 4) for k, v in zip(BOX_FIELDS, box)}
        for box, score, label in zip(det["boxes"][keep].tolist(), det["scores"][keep], det["labels"][keep])
    ]
    return {"num_boxes": int(len(det["scores"])), "boxes": boxes}


def tracked(tracker, det: Mapping[str, Any], index, k: int, consecutive: bool) -> dict[str, Any]:
    """The sample's boxes (row k of the dataset index) with the velocities of their tracks over the key frames
    before; `consecutive`: the sample predicted before this one is its previous key frame."""
    from bev.tasks.detection.tracking import track_ego_boxes

    token = str(index["sample_token"][k])
    prev = str(index["sample_token"][k - 1]) if consecutive else ""
    boxes = track_ego_boxes(
        tracker,
        token,
        prev,
        int(index["timestamp"][k]) / 1e6,
        det["boxes"],  # on the CPU (bev.inference.per_sample): numpy reads them as they are
        det["scores"],
        det["labels"],
        index["ego_rotation"][k],
        index["ego_translation"][k],
    )
    return {**det, "boxes": torch.as_tensor(boxes, dtype=torch.as_tensor(det["boxes"]).dtype)}
