"""Boxes from the detection head's maps (bev.tasks.detection.head.CenterHead's outputs), per sample:
sigmoid, 3x3 max-pool peaks (or none: BEVDet's `max_pool_nms=False`), the candidates (top-K over all classes,
or CenterPoint's nuScenes setting: top-K per class group), score threshold, cell + offset -> metres, exp sizes,
atan2 yaw, velocity, then NMS within each class group: circle NMS (centre distance, CenterPoint), rotated NMS
(IoU of the boxes' footprints seen from above, BEVFusion) or BEVDet's Scale-NMS (rotated NMS of footprints scaled
per class, circle NMS for barriers), then a cap per group. At most top_k boxes per sample (500: the devkit's
limit). Boxes are rows of bev.geometry.BOX_FIELDS in the ego frame; attributes are not decided here.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from bev.classes import DETECTION_CLASSES, DETECTION_GROUPS
from bev.geometry import MAX_BOXES, Grid, box_corners
from bev.tasks.detection.targets import (
    REGRESSION_FIELDS,
    check_velocity_frame,
    class_to_group,
    gather_regression,
    rotate_velocity,
)

# Circle NMS thresholds per group of DETECTION_GROUPS, as the peers give them: squared centre distances
# in m^2 (CenterPoint / BEVDet `min_radius`, compared with dx^2 + dy^2). In metres: 2, 3.46, 3.16, 1, 0.92, 0.42.
CIRCLE_NMS_SQUARED = (4.0, 12.0, 10.0, 1.0, 0.85, 0.175)
NMS_RADII = tuple(math.sqrt(d) for d in CIRCLE_NMS_SQUARED)
ROTATED_NMS_IOU = 0.2  # BEVFusion's: a box overlapping a better one of its group by more is dropped
NMS_KINDS = ("circle", "rotated", "scale_nms", None)
# BEVDet's Scale-NMS (configs/bevdet/bevdet-r50.py test_cfg), per group of DETECTION_GROUPS: the NMS of each group,
# its IoU threshold, and per class the factor on w and l before the IoU (small objects grown so that their
# footprints overlap at all; large ones shrunk). Barriers take circle NMS at NMS_RADII's 1 m, unscaled.
SCALE_NMS_KINDS = ("rotated", "rotated", "rotated", "circle", "rotated", "rotated")
SCALE_NMS_IOU = (0.2, 0.2, 0.2, 0.2, 0.2, 0.5)
SCALE_NMS_FACTORS = {
    "car": 1.0,
    "truck": 0.7,
    "construction_vehicle": 0.7,
    "bus": 0.4,
    "trailer": 0.55,
    "barrier": 1.1,
    "motorcycle": 1.0,
    "bicycle": 1.0,
    "pedestrian": 4.5,
    "traffic_cone": 9.0,
}


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


def rotated_nms(
    boxes: torch.Tensor,
    group: torch.Tensor,
    iou_threshold: float | Sequence[float] = ROTATED_NMS_IOU,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedy NMS of boxes (BOX_FIELDS rows) sorted by decreasing score: a box is dropped when a kept box of
    the same group overlaps its footprint (the rotated base rectangle, w and l times `scale` per box when given)
    with IoU > iou_threshold (one number, or one per group). Returns the kept indices, in order."""
    b = boxes.detach().cpu().double().numpy().reshape(-1, 9).copy()
    g = group.cpu().numpy()
    if scale is not None:
        b[:, 3:5] *= scale.detach().cpu().double().numpy()[:, None]
    i, j = _near_pairs(b, g)
    iou = footprint_iou(box_corners(b[i])[:, :4, :2], box_corners(b[j])[:, :4, :2])
    threshold = np.asarray(iou_threshold, dtype=np.float64)
    suppresses = np.zeros((len(b), len(b)), dtype=bool)
    over = iou > (threshold[g[i]] if threshold.ndim else threshold)
    suppresses[i[over], j[over]] = True
    return _greedy(suppresses, boxes.device)


def _near_pairs(boxes: np.ndarray, group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(i, j), i < j, of boxes of one group whose footprints' circumcircles meet (the only ones that can overlap)."""
    half_diagonal = np.hypot(boxes[:, 3], boxes[:, 4]) / 2
    reach = half_diagonal[:, None] + half_diagonal[None, :]
    dist = np.hypot(*(boxes[:, None, :2] - boxes[None, :, :2]).transpose(2, 0, 1))
    i, j = np.nonzero(np.triu((dist <= reach) & (group[:, None] == group[None, :]), k=1))
    return i, j


def footprint_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of pairs of convex quadrilaterals a[p], b[p] ((P, 4, 2) corners in order around each): the area of
    their intersection polygon (its corners: each one's corners inside the other and the edges' crossings, in
    angle order about their mean) over the area of their union."""
    a, b = np.asarray(a, dtype=np.float64).reshape(-1, 4, 2), np.asarray(b, dtype=np.float64).reshape(-1, 4, 2)
    points = np.concatenate([a, b, _crossings(a, b)], axis=1)  # (P, 24, 2)
    valid = np.concatenate([_inside(a, b), _inside(b, a), np.isfinite(points[:, 8:, 0])], axis=1)
    inter = _convex_area(np.where(valid[..., None], points, 0.0), valid)
    union = np.abs(_shoelace(a)) + np.abs(_shoelace(b)) - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def _cross(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    return u[..., 0] * v[..., 1] - u[..., 1] * v[..., 0]


def _shoelace(poly: np.ndarray) -> np.ndarray:
    """Signed area of polygons (P, N, 2) (> 0 counter-clockwise)."""
    return 0.5 * _cross(poly, np.roll(poly, -1, axis=1)).sum(1)


def _inside(points: np.ndarray, poly: np.ndarray, eps: float = 1e-9) -> np.ndarray:
    """(P, N) whether points (P, N, 2) lie in the convex polygons poly (P, 4, 2) of either orientation (edges
    included)."""
    edges = np.roll(poly, -1, axis=1) - poly  # (P, 4, 2)
    side = _cross(edges[:, None], points[:, :, None] - poly[:, None])  # (P, N, 4)
    sign = np.sign(_shoelace(poly))[:, None, None]
    return (side * sign >= -eps).all(-1)


def _crossings(a: np.ndarray, b: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """(P, 16, 2) where each edge of a crosses each edge of b; NaN for the pairs that do not cross."""
    r = (np.roll(a, -1, axis=1) - a)[:, :, None]  # (P, 4, 1, 2): a's edges
    s = (np.roll(b, -1, axis=1) - b)[:, None]  # (P, 1, 4, 2): b's edges
    qp = b[:, None] - a[:, :, None]  # (P, 4, 4, 2)
    denom = _cross(r, s)
    parallel = np.abs(denom) <= eps
    safe = np.where(parallel, 1.0, denom)
    t, u = _cross(qp, s) / safe, _cross(qp, r) / safe
    ok = ~parallel & (t >= 0) & (t <= 1) & (u >= 0) & (u <= 1)
    points = a[:, :, None] + t[..., None] * r
    return np.where(ok[..., None], points, np.nan).reshape(len(a), 16, 2)


def _convex_area(points: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Area of the convex hull-ordered polygon of the valid points of each row (P, M, 2): sorted by angle about
    their mean; fewer than 3 points give 0."""
    count = valid.sum(1)
    centre = points.sum(1) / np.maximum(count, 1)[:, None]
    angle = np.where(valid, np.arctan2(*(points - centre[:, None]).transpose(2, 0, 1)[::-1]), np.inf)
    order = np.argsort(angle, axis=1, kind="stable")
    ordered = np.take_along_axis(points, order[..., None], axis=1)
    kept = np.take_along_axis(valid, order, axis=1)
    ordered = np.where(kept[..., None], ordered, ordered[:, :1])  # the unused slots repeat the first corner
    return np.where(count >= 3, np.abs(_shoelace(ordered)), 0.0)


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
    nms_iou: float | Sequence[float] | None = None,
    pre_nms_top_k: int | None = None,
    post_nms_max: int | None = None,
    velocity_frame: str = "ego",
    max_pool: bool = True,
    nms_scale: Mapping[str, float] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """heatmap (B, C, X, Y) logits and regression (B, G, 10, X, Y) -> per sample {"boxes": (K, 9) float32
    per BOX_FIELDS, "scores": (K,) in decreasing order, "labels": (K,) int64 into DETECTION_CLASSES}.
    max_pool: keep only the 3x3 max-pool peaks before the candidates (False: every cell, BEVDet's).
    nms: "circle" (per group, centre distance <= nms_radii[g] metres), "rotated" (per group, footprint IoU >
    nms_iou: one number, 0.2 when None, or one per group), "scale_nms" (BEVDet's: per group SCALE_NMS_KINDS,
    nms_iou SCALE_NMS_IOU when None, footprints scaled per class by nms_scale, SCALE_NMS_FACTORS when None) or
    None. Candidates: the top_k peaks over all classes (pre_nms_top_k None), or the pre_nms_top_k peaks of each
    group (CenterPoint: 1000; BEVDet's top 500 per task); post_nms_max: at most that many boxes per group after NMS
    (theirs: 83); then the top_k best of all. velocity_frame: where the head regresses velocity
    (bev.tasks.detection.targets.VELOCITY_FRAMES); boxes carry it in the ego frame."""
    check_velocity_frame(velocity_frame)
    kinds, ious, factors = _nms_setting(nms, groups, nms_radii, nms_iou, nms_scale)
    if not 0 < top_k <= MAX_BOXES:
        raise ValueError(f"top_k must be in 1..{MAX_BOXES} (the devkit's limit of boxes per sample), got {top_k}")
    for name, value in (("pre_nms_top_k", pre_nms_top_k), ("post_nms_max", post_nms_max)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a whole number >= 1 or null, got {value!r}")
    if not isinstance(max_pool, bool):
        raise ValueError(f"max_pool must be true (3x3 max-pool peaks) or false (every cell), got {max_pool!r}")
    _check_maps(heatmap, regression, grid, groups)
    b, c, nx, ny = heatmap.shape
    scores = torch.sigmoid(heatmap.float())
    peaks = scores * (F.max_pool2d(scores, 3, stride=1, padding=1) == scores) if max_pool else scores
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
        if kinds is not None and len(sc):
            kept = _group_nms(bx, of_class[lb], kinds, radii, ious, factors[lb.cpu()])
            bx, sc, lb = bx[kept], sc[kept], lb[kept]
        if pre_nms_top_k is not None or post_nms_max is not None:
            kept = _best_per_group(sc, of_class[lb], post_nms_max, top_k)
            bx, sc, lb = bx[kept], sc[kept], lb[kept]
        results.append({"boxes": bx, "scores": sc, "labels": lb})
    return results


def check_decoding(options: Mapping[str, Any]) -> None:
    """One clear error for model.detection.decoding options decode() would refuse, before any data is read."""
    known = [p for p in inspect.signature(decode).parameters if p not in ("heatmap", "regression", "grid")]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"unknown model.detection.decoding key(s) {unknown}: choose from {', '.join(known)}")
    grid = Grid(xbound=(0.0, 1.0, 1.0), ybound=(0.0, 1.0, 1.0))
    groups = options.get("groups", DETECTION_GROUPS)
    empty = torch.zeros(1, sum(len(g) for g in groups), 1, 1), torch.zeros(1, len(groups), len(REGRESSION_FIELDS), 1, 1)
    try:
        decode(*empty, grid, **options)
    except ValueError as e:
        raise ValueError(f"model.detection.decoding: {e}") from None


def _nms_setting(nms, groups, radii, iou, scale) -> tuple[tuple[str, ...] | None, np.ndarray, torch.Tensor]:
    """(NMS kind per group or None, IoU threshold per group, footprint factor per class) of decode's options."""
    if nms not in NMS_KINDS:
        raise ValueError(f"nms must be one of {NMS_KINDS}, got {nms!r}")
    if len(radii) != len(groups):
        raise ValueError(f"nms_radii needs one radius (metres) per class group ({len(groups)}), got {list(radii)}")
    if nms == "scale_nms" and tuple(groups) != DETECTION_GROUPS:
        raise ValueError("nms=scale_nms is BEVDet's setting for its six class groups (DETECTION_GROUPS)")
    if scale is not None and nms != "scale_nms":
        raise ValueError(f"nms_scale scales footprints for nms=scale_nms only, got nms={nms!r}")
    if iou is None:
        iou = SCALE_NMS_IOU if nms == "scale_nms" else ROTATED_NMS_IOU
    ious = np.asarray(iou, dtype=np.float64) if _numbers(iou) else np.zeros(0)
    if ious.ndim == 0:
        ious = np.full(len(groups), float(ious))
    if ious.shape != (len(groups),) or not ((ious >= 0) & (ious <= 1)).all():
        raise ValueError(f"nms_iou must be an IoU in [0, 1] or one per class group ({len(groups)}), got {iou!r}")
    names = [c for g in groups for c in g]
    factors = dict(SCALE_NMS_FACTORS) if nms == "scale_nms" else {c: 1.0 for c in names}
    if scale is not None:
        unknown = sorted(set(scale) - set(names))
        bad = {k: v for k, v in scale.items() if not (_numbers(v) and np.ndim(v) == 0 and v > 0)}
        if unknown or bad:
            raise ValueError(f"nms_scale maps class names ({', '.join(names)}) to factors > 0, got {dict(scale)!r}")
        factors.update({k: float(v) for k, v in scale.items()})
    kinds = {"circle": ("circle",) * len(groups), "rotated": ("rotated",) * len(groups)}.get(nms, SCALE_NMS_KINDS)
    return (None if nms is None else kinds), ious, torch.tensor([factors[c] for c in names], dtype=torch.float64)


def _numbers(x: Any) -> bool:
    """A real number or a list of them (no bools, strings or nested lists)."""
    items = list(x) if isinstance(x, (list, tuple)) or hasattr(x, "__iter__") and not isinstance(x, str) else [x]
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) for v in items)


def _group_nms(boxes, group, kinds, radii, ious, scale) -> torch.Tensor:
    """NMS within each group by its kind (circle or rotated); the kept indices in their given order."""
    kept = []
    for g in group.unique().tolist():
        members = torch.nonzero(group == g).flatten()
        sub, sub_group = boxes[members], group[members]
        if kinds[g] == "circle":
            keep = circle_nms(sub[:, :2], sub_group, radii)
        else:
            keep = rotated_nms(sub, sub_group, ious, scale[members.cpu()])
        kept.append(members[keep])
    return torch.sort(torch.cat(kept)).values


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
