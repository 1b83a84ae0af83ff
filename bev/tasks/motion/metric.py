"""FIERY's metrics of the motion task, over the present and the future frames.

FutureIoU is the vehicle IoU pooled over every cell of every frame (present and future); PanopticQuality is
FIERY's video panoptic quality (VPQ); crop_to_range cuts both to its long (100 m x 100 m) and short
(30 m x 30 m) ranges around the ego (FIERY_RANGES).
"""

from __future__ import annotations

import math

import torch
from torchmetrics import Metric

from bev.geometry import Grid
from bev.tasks.motion import IGNORE
from bev.tasks.segmentation.metric import format_value, iou

# FIERY's two evaluation ranges: the side of a square around the ego, metres (the whole 100 m
# grid, and the central 30 m x 30 m, [70:130, 70:130] of a 0.5 m grid).
FIERY_RANGES: dict[str, float] = {"long": 100.0, "short": 30.0}


def range_slices(grid: Grid, extent: float | tuple[float, float]) -> tuple[slice, slice]:
    """Index slices (x, y) of the cells lying wholly inside a square (or extent = (x, y) rectangle)
    of that side in metres centred on the ego origin, clipped to the grid."""
    grid = Grid.from_any(grid)
    sides = (extent, extent) if isinstance(extent, (int, float)) else tuple(extent)
    out = []
    for axis, (lo, _, step), n, side in (("x", grid.xbound, grid.nx, sides[0]), ("y", grid.ybound, grid.ny, sides[1])):
        if not side > 0:
            raise ValueError(f"range extent must be > 0 metres, got {side} along {axis}")
        first = max(0, math.ceil((-side / 2 - lo) / step - 1e-6))
        last = min(n, math.floor((side / 2 - lo) / step + 1e-6))
        if last <= first:
            raise ValueError(
                f"a {side} m range around the ego holds no whole {step} m cell of the grid along {axis} "
                f"({grid.xbound if axis == 'x' else grid.ybound}): use a larger range"
            )
        out.append(slice(first, last))
    return out[0], out[1]


def crop_to_range(grid: Grid, extent: float | tuple[float, float], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors (..., X, Y) on the grid, cut to range_slices(grid, extent) (views, not copies)."""
    sx, sy = range_slices(grid, extent)
    shape = Grid.from_any(grid).bev_shape
    for t in tensors:
        if tuple(t.shape[-2:]) != shape:
            raise ValueError(f"a tensor of shape {tuple(t.shape)} does not end in the grid's (X, Y) = {shape}")
    return tuple(t[..., sx, sy] for t in tensors)


def _binary(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.bool:
        if t.is_floating_point() or t.is_complex() or not bool(((t == 0) | (t == 1)).all()):
            raise ValueError(
                f"{name} must be bool or 0/1 integers; threshold probabilities first, and pass cells "
                f"labelled {IGNORE} (ignore) as the ignore mask"
            )
        t = t.bool()
    return t


class FutureIoU(Metric):
    """Vehicle IoU pooled over every cell of every frame (present and future) of the split, as FIERY:
    one TP / (TP + FP + FN); NaN when there are neither targets nor predictions.

    update(pred (B, T, X, Y) bool, target (B, T, X, Y) bool, ignore (B, T, X, Y) bool or None: True
    cells count as nothing). compute() -> {"iou", "tp", "fp", "fn"}.
    """

    full_state_update = False

    def __init__(self):
        super().__init__()
        self.add_state("counts", default=torch.zeros(3, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, pred: torch.Tensor, target: torch.Tensor, ignore: torch.Tensor | None = None) -> None:
        if pred.dim() != 4 or pred.shape != target.shape or (ignore is not None and ignore.shape != pred.shape):
            raise ValueError(
                f"prediction {tuple(pred.shape)}, target {tuple(target.shape)} and ignore "
                f"{None if ignore is None else tuple(ignore.shape)} must all be (B, T, X, Y)"
            )
        pred, target = _binary("prediction", pred.detach()), _binary("target", target)
        keep = torch.ones_like(pred) if ignore is None else ~ignore.bool()
        self.counts += torch.stack(
            [(pred & target & keep).sum(), (pred & ~target & keep).sum(), (~pred & target & keep).sum()]
        ).to(self.counts.device)

    def compute(self) -> dict[str, float]:
        tp, fp, fn = (int(c) for c in self.counts)
        return {"iou": iou(tp, fp, fn), "tp": float(tp), "fp": float(fp), "fn": float(fn)}


def _pair_counts(pred: torch.Tensor, gt: torch.Tensor, frame: torch.Tensor):
    """Over the cells given (flat), per (frame, gt id, pred id) present: the intersection, and the
    gt and pred areas of the pair's two segments. Ids are compacted to keep the keys small."""
    gt_ids, g = torch.unique(gt, return_inverse=True)
    pred_ids, p = torch.unique(pred, return_inverse=True)
    ng, np_ = len(gt_ids), len(pred_ids)
    keys, inter = torch.unique((frame * ng + g) * np_ + p, return_counts=True)
    kf, kg, kp = keys // (ng * np_), keys // np_ % ng, keys % np_
    g_keys, g_area = torch.unique(frame * ng + g, return_counts=True)
    p_keys, p_area = torch.unique(frame * np_ + p, return_counts=True)
    return {
        "frame": kf,
        "gt": gt_ids[kg],
        "pred": pred_ids[kp],
        "inter": inter,
        "gt_area": g_area[torch.searchsorted(g_keys, kf * ng + kg)],
        "pred_area": p_area[torch.searchsorted(p_keys, kf * np_ + kp)],
        "n_gt": int((gt_ids[g_keys % ng] > 0).sum()),
        "n_pred": int((pred_ids[p_keys % np_] > 0).sum()),
    }


def _id_switches(seq: torch.Tensor, t: torch.Tensor, gt: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """(M,) bool over matches: the true instance's previous match in its sequence had another pred id."""
    order = torch.argsort(t, stable=True)
    order = order[torch.argsort(gt[order], stable=True)]
    order = order[torch.argsort(seq[order], stable=True)]  # by (sequence, gt id, time)
    s, g, p = seq[order], gt[order], pred[order]
    switched = torch.zeros_like(s, dtype=torch.bool)
    switched[1:] = (s[1:] == s[:-1]) & (g[1:] == g[:-1]) & (p[1:] != p[:-1])
    out = torch.empty_like(switched)
    out[order] = switched
    return out


def panoptic_counts(
    pred_instance: torch.Tensor,
    gt_instance: torch.Tensor,
    temporally_consistent: bool = True,
    ignore_index: int | None = None,
) -> tuple[int, int, int, float]:
    """(tp, fp, fn, iou_sum) of (B, T, X, Y) instance maps; each b is one sequence. See PanopticQuality."""
    B, T = gt_instance.shape[:2]
    pred, gt = pred_instance.reshape(B * T, -1), gt_instance.reshape(B * T, -1).to(pred_instance.device)
    frame = torch.arange(B * T, device=pred.device)[:, None].expand_as(pred)
    cells = (gt > 0) | (pred > 0)  # background-only cells are in no instance's IoU
    if ignore_index is not None:
        cells &= gt != ignore_index
    if not cells.any():
        return 0, 0, 0, 0.0
    c = _pair_counts(pred[cells], gt[cells], frame[cells])
    union = c["gt_area"] + c["pred_area"] - c["inter"]
    match = (c["gt"] > 0) & (c["pred"] > 0) & (2 * c["inter"] > union)  # IoU > 0.5, exactly
    iou_m = c["inter"][match].double() / union[match].double()
    if temporally_consistent:
        f = c["frame"][match]
        ok = ~_id_switches(f // T, f % T, c["gt"][match], c["pred"][match])
    else:
        ok = torch.ones_like(iou_m, dtype=torch.bool)
    tp = int(ok.sum())
    return tp, c["n_pred"] - tp, c["n_gt"] - tp, float(iou_m[ok].sum())


class PanopticQuality(Metric):
    """FIERY's video panoptic quality (VPQ, its "pq") of one thing class (vehicles).

    update(pred_instance, gt_instance): (B, T, X, Y) integer instance maps, 0 = background, each b
    one sequence of T frames. Per frame, a true and a predicted instance match when their IoU is
    > 0.5 (exactly 0.5 is no match). With temporally_consistent, a match whose predicted id differs
    from the one the true instance was matched to at its previous match in the sequence counts as
    one FN and one FP (its IoU is not added), and that new id becomes the one to keep; otherwise a
    match is a TP and adds its IoU. Unmatched true instances are FNs, unmatched predicted ones FPs.
    Counts are summed over frames, sequences, update calls and processes. ignore_index: true cells
    of that value are void: left out of every IoU, and a predicted instance lying wholly in void is
    no FP (FIERY's void rule; its own evaluation never has void cells).

    compute() -> {"pq": iou_sum / (tp + fp/2 + fn/2), "sq": iou_sum / tp, "rq": tp / (tp + fp/2 +
    fn/2), "tp", "fp", "fn", "iou_sum"}. Undefined ratios are NaN (pq and rq with no true and no
    predicted instance, sq with no TP), where FIERY's code gives 0. The background, which FIERY
    also scores as a "stuff" class but never reports, is not scored.
    """

    full_state_update = False

    def __init__(self, temporally_consistent: bool = True, ignore_index: int | None = None):
        super().__init__()
        self.temporally_consistent = bool(temporally_consistent)
        self.ignore_index = ignore_index
        self.add_state("counts", default=torch.zeros(3, dtype=torch.int64), dist_reduce_fx="sum")  # tp, fp, fn
        self.add_state("iou_sum", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, pred_instance: torch.Tensor, gt_instance: torch.Tensor) -> None:
        for name, t in (("pred_instance", pred_instance), ("gt_instance", gt_instance)):
            if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
                raise ValueError(f"{name} must hold integer instance ids (0 = background), got {t.dtype}")
        if pred_instance.dim() != 4 or pred_instance.shape != gt_instance.shape:
            raise ValueError(
                f"pred_instance {tuple(pred_instance.shape)} and gt_instance {tuple(gt_instance.shape)} "
                f"must both be (B, T, X, Y)"
            )
        if pred_instance.numel() and (pred_instance.min() < 0 or gt_instance.min() < 0):
            raise ValueError("instance ids must be >= 0 (0 = background)")
        tp, fp, fn, iou_sum = panoptic_counts(
            pred_instance.detach().long(), gt_instance.long(), self.temporally_consistent, self.ignore_index
        )
        self.counts += torch.tensor([tp, fp, fn], dtype=torch.int64, device=self.counts.device)
        self.iou_sum += iou_sum

    def compute(self) -> dict[str, float]:
        tp, fp, fn = (int(c) for c in self.counts)
        iou_sum, denom = float(self.iou_sum), tp + fp / 2 + fn / 2
        return {
            "pq": iou_sum / denom if denom > 0 else math.nan,
            "sq": iou_sum / tp if tp > 0 else math.nan,
            "rq": tp / denom if denom > 0 else math.nan,
            "tp": float(tp),
            "fp": float(fp),
            "fn": float(fn),
            "iou_sum": iou_sum,
        }


def format_table(results: dict[str, float]) -> str:
    """FIERY's scores over the present and future frames, per range: IoU and VPQ (then the same with the present
    copied to the future frames, when scored). Printed by bev-eval below the segmentation table."""
    lines = [f"{'present + future':<24}{'IoU':>8}{'VPQ':>8}"]
    for r, extent in FIERY_RANGES.items():
        name = f"{r} ({extent:g} m x {extent:g} m)"
        future_iou, vpq = (results.get(f"{m}_{r}", math.nan) for m in ("future_iou", "vpq"))
        lines.append(f"{name:<24}{format_value(future_iou):>8}{format_value(vpq):>8}")
    if "future_iou_long_present_copied" in results:
        lines += ["", f"{'present copied to future':<24}{'IoU':>8}{'VPQ':>8}"]
        for r, extent in FIERY_RANGES.items():
            future_iou, vpq = (results.get(f"{m}_{r}_present_copied", math.nan) for m in ("future_iou", "vpq"))
            lines.append(
                f"{f'{r} ({extent:g} m x {extent:g} m)':<24}{format_value(future_iou):>8}{format_value(vpq):>8}"
            )
    return "\n".join(lines)
