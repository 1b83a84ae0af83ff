"""Boxes from the detection head's maps (bev.models.centerpoint.CenterHead's outputs), per sample:
sigmoid, 3x3 max-pool peaks, the candidates (top-K over all classes, or CenterPoint's nuScenes setting: top-K
per class group), score threshold, cell + offset -> metres, exp sizes, atan2 yaw, velocity, then NMS within
each class group: circle NMS (centre distance, CenterPoint / BEVDet) or rotated NMS (IoU of the boxes'
footprints seen from above, BEVFusion), then a cap per group. At most top_k boxes per sample (500: the
devkit's limit). Boxes are rows of bev.geometry.BOX_FIELDS in the ego frame; attributes are not decided here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from bev.classes import DETECTION_CLASSES, DETECTION_GROUPS
from bev.detection.targets import (
    REGRESSION_FIELDS,
    check_velocity_frame,
    class_to_group,
    gather_regression,
    rotate_velocity,
)
from bev.geometry import MAX_BOXES, Grid, box_corners

# Circle NMS thresholds per group of DETECTION_GROUPS, as the peers give them: squared centre distances
# in m^2 (CenterPoint / BEVDet `min_radius`, compared with dx^2 + dy^2). In metres: 2, 3.46, 3.16, 1, 0.92, 0.42.
CIRCLE_NMS_SQUARED = (4.0, 12.0, 10.0, 1.0, 0.85, 0.175)
NMS_RADII = tuple(math.sqrt(d) for d in CIRCLE_NMS_SQUARED)
ROTATED_NMS_IOU = 0.2  # BEVFusion's: a box overlapping a better one of its group by more is dropped
NMS_KINDS = ("circle", "rotated", None)


def _check_maps(heatmap: torch.Tensor, regression: torch.Tensor, grid: Grid, groups) -> None:
    b, c, x, y = heatmap.shape
    expected = (b, len(groups), len(REGRESSION_FIELDS), x, y)
    if c != len(DETECTION_CLASSES) or tuple(regression.shape) != expected or (x, y) != grid.bev_shape:
        raise ValueError(
            f"decode needs heatmap (B, {len(DETECTION_CLASSES)}, X, Y) and regression {expected} on the grid's "
            f"(X, Y) = {grid.bev_shape}; got {tuple(heatmap.shape)} and {tuple(regression.shape)}"
        )


def circle_nms(xy: torch.Tensor, group: torch.Tensor, radii: torch.Tensor) -> torch.Tensor:
    """Greedy NMS of boxes sorted by decreasing score: a box is dropped when a kept box of the same group
    has its centre within the group's radius (metres). Returns the kept indices, in order."""
    close = (torch.cdist(xy, xy) <= radii[group][:, None]) & (group[:, None] == group[None, :])
    return _greedy(close.cpu().numpy(), xy.device)


def rotated_nms(boxes: torch.Tensor, group: torch.Tensor, iou_threshold: float = ROTATED_NMS_IOU) -> torch.Tensor:
    """Greedy NMS of boxes (BOX_FIELDS rows) sorted by decreasing score: a box is dropped when a kept box of
    the same group overlaps its footprint (the rotated base rectangle) with IoU > iou_threshold. Returns
    the kept indices, in order."""
    import shapely

    polygons = shapely.polygons(box_corners(boxes)[:, :4, :2])
    i, j = shapely.STRtree(polygons).query(polygons, predicate="intersects")
    g = group.cpu().numpy()
    pair = (i < j) & (g[i] == g[j])
    i, j = i[pair], j[pair]
    inter = shapely.area(shapely.intersection(polygons[i], polygons[j]))
    area = shapely.area(polygons)
    overlapping = inter > iou_threshold * (area[i] + area[j] - inter)
    suppresses = np.zeros((len(polygons), len(polygons)), dtype=bool)
    suppresses[i[overlapping], j[overlapping]] = True
    return _greedy(suppresses, boxes.device)


def _greedy(suppresses: np.ndarray, device) -> torch.Tensor:
    """Greedy NMS over boxes in decreasing score order: (K, K) suppresses[a, b] = a, once kept, drops b.
    Returns the kept indices, in order."""
    removed = np.zeros(len(suppresses), dtype=bool)
    keep = []
    for k in range(len(suppresses)):
        if not removed[k]:
            keep.append(k)
            removed |= suppresses[k]
    return torch.as_tensor(keep, dtype=torch.long, device=device)


@torch.no_grad()
def decode(
    heatmap: torch.Tensor,
    regression: torch.Tensor,
    grid: Grid,
    score_threshold: float = 0.1,
    top_k: int = MAX_BOXES,
    nms: str | None = "circle",
    nms_radii: Sequence[float] = NMS_RADII,
    groups: tuple[tuple[str, ...], ...] = DETECTION_GROUPS,
    nms_iou: float = ROTATED_NMS_IOU,
    pre_nms_top_k: int | None = None,
    post_nms_max: int | None = None,
    velocity_frame: str = "ego",
) -> list[dict[str, torch.Tensor]]:
    """heatmap (B, C, X, Y) logits and regression (B, G, 10, X, Y) -> per sample {"boxes": (K, 9) float32
    per BOX_FIELDS, "scores": (K,) in decreasing order, "labels": (K,) int64 into DETECTION_CLASSES}.
    nms: "circle" (per group, centre distance <= nms_radii[g] metres), "rotated" (per group, footprint IoU >
    nms_iou) or None. Candidates: the top_k peaks over all classes (pre_nms_top_k None), or the
    pre_nms_top_k peaks of each group (BEVDet / CenterPoint: 1000); post_nms_max: at most that many boxes
    per group after NMS (theirs: 83); then the top_k best of all. velocity_frame: where the head regresses
    velocity (bev.detection.targets.VELOCITY_FRAMES); boxes carry it in the ego frame."""
    check_velocity_frame(velocity_frame)
    if nms not in NMS_KINDS:
        raise ValueError(f"nms must be one of {NMS_KINDS}, got {nms!r}")
    if not 0 < top_k <= MAX_BOXES:
        raise ValueError(f"top_k must be in 1..{MAX_BOXES} (the devkit's limit of boxes per sample), got {top_k}")
    if len(nms_radii) != len(groups):
        raise ValueError(f"nms_radii needs one radius (metres) per class group ({len(groups)}), got {list(nms_radii)}")
    for name, value in (("pre_nms_top_k", pre_nms_top_k), ("post_nms_max", post_nms_max)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a whole number >= 1 or null, got {value!r}")
    _check_maps(heatmap, regression, grid, groups)
    b, c, nx, ny = heatmap.shape
    scores = torch.sigmoid(heatmap.float())
    peaks = scores * (F.max_pool2d(scores, 3, stride=1, padding=1) == scores)
    top_scores, top = _candidates(peaks, top_k, pre_nms_top_k, groups)  # (B, K)
    label = top // (nx * ny)
    cell = top % (nx * ny)
    of_class = torch.tensor(class_to_group(groups), device=heatmap.device)
    radii = torch.tensor(nms_radii, dtype=torch.float32, device=heatmap.device)
    values = gather_regression(regression.float(), cell, label, of_class)  # (B, K, R)
    boxes = _to_boxes(values, cell, grid, velocity_frame)
    results = []
    for i in range(b):
        keep = top_scores[i] > score_threshold
        bx, sc, lb = boxes[i][keep], top_scores[i][keep], label[i][keep]
        if nms is not None and len(sc):
            if nms == "circle":
                kept = circle_nms(bx[:, :2], of_class[lb], radii)
            else:
                kept = rotated_nms(bx, of_class[lb], nms_iou)
            bx, sc, lb = bx[kept], sc[kept], lb[kept]
        if pre_nms_top_k is not None or post_nms_max is not None:
            kept = _best_per_group(sc, of_class[lb], post_nms_max, top_k)
            bx, sc, lb = bx[kept], sc[kept], lb[kept]
        results.append({"boxes": bx, "scores": sc, "labels": lb})
    return results


def _candidates(
    peaks: torch.Tensor, top_k: int, per_group: int | None, groups: tuple[tuple[str, ...], ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, flat class * X * Y + cell indices) of the candidate peaks, (B, K): the top_k over all classes
    (sorted), or the `per_group` best of each group's channels (each group's sorted, groups one after another)."""
    b, c, nx, ny = peaks.shape
    if per_group is None:
        return peaks.flatten(1).topk(min(top_k, c * nx * ny), dim=1)
    scores, index, start = [], [], 0
    for group in groups:  # contiguous channel runs (class_to_group)
        part = peaks[:, start : start + len(group)].flatten(1)
        s, i = part.topk(min(per_group, part.shape[1]), dim=1)
        scores.append(s)
        index.append(i + start * nx * ny)
        start += len(group)
    return torch.cat(scores, 1), torch.cat(index, 1)


def _best_per_group(scores: torch.Tensor, group: torch.Tensor, per_group: int | None, total: int) -> torch.Tensor:
    """Indices of the boxes kept: at most per_group of each group (the first, which are its best), then the
    `total` best of all, in decreasing score."""
    keep = torch.ones_like(scores, dtype=torch.bool)
    if per_group is not None:
        for g in group.unique():
            members = torch.nonzero(group == g).flatten()
            keep[members[per_group:]] = False
    kept = torch.nonzero(keep).flatten()
    order = torch.argsort(scores[kept], descending=True, stable=True)
    return kept[order][:total]


def _to_boxes(values: torch.Tensor, cell: torch.Tensor, grid: Grid, velocity_frame: str = "ego") -> torch.Tensor:
    """(B, K, R) regression at cells (B, K) flat x * Y + y -> (B, K, 9) BOX_FIELDS rows."""
    ny = grid.ny
    ix, iy = (cell // ny).float(), (cell % ny).float()
    x = grid.xbound[0] + (ix + values[..., 0]) * grid.xbound[2]
    y = grid.ybound[0] + (iy + values[..., 1]) * grid.ybound[2]
    size = values[..., 3:6].exp()
    yaw = torch.atan2(values[..., 6], values[..., 7])
    yaw = torch.where(yaw >= math.pi, yaw - 2 * math.pi, yaw)  # BOX_FIELDS: yaw in [-pi, pi)
    velocity = values[..., 8:10]
    if velocity_frame == "box":
        velocity = rotate_velocity(velocity, torch.sin(yaw), torch.cos(yaw))
    return torch.cat([x[..., None], y[..., None], values[..., 2:3], size, yaw[..., None], velocity], -1)
