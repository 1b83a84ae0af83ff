"""BEV segmentation IoU, accumulated over a whole split.

IoU is one global TP / (TP + FP + FN) over every cell of every sample at a threshold (0.5 on
the sigmoid), not a mean of per-sample IoUs. Two variants are always computed:

- "all": every cell counts;
- "vis": the visibility filter of LSS/PointBeV: cells covered by a vehicle whose nuScenes
  visibility level is 1 (0-40% visible) are ignored (neither TP, FP nor FN).

and each is also split by distance band: the Euclidean distance of the cell centre
(Grid.cell_centers) from the ego origin in [0, 20), [20, 35), [35, 50) metres. Cells beyond
50 m (the grid corners) count in the overall IoU only. Every object class is counted on its own
(BevIoU keys iou_<class>...; the unsuffixed iou* keys are the first class's, e.g. vehicle).

Map classes follow BEVFusion's protocol (MapIoU): TP/FP/FN of probability >= t accumulated over
the whole split at each t in MAP_THRESHOLDS (0.35..0.65 step 0.05); a class's IoU is its best
threshold's; miou_map is the mean over map classes (classes with neither targets nor
predictions, NaN, are left out of the mean).

Temporal metrics, FIERY's: FutureIoU is the vehicle IoU pooled over every cell of every frame
(present and future); PanopticQuality is its video panoptic quality (VPQ); crop_to_range cuts
both to its long (100 m x 100 m) and short (30 m x 30 m) ranges around the ego.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torchmetrics import Metric

from bev.data.temporal import IGNORE
from bev.geometry import Grid

BANDS: tuple[tuple[float, float], ...] = ((0.0, 20.0), (20.0, 35.0), (35.0, 50.0))
REGIONS: tuple[str, ...] = ("all",) + tuple(f"{int(lo)}_{int(hi)}m" for lo, hi in BANDS)
FILTERS: tuple[str, ...] = ("all", "vis")
IGNORED_VISIBILITY = 1
MAP_THRESHOLDS: tuple[float, ...] = (0.35, 0.40, 0.45, 0.50, 0.55, 0.60, 0.65)


def band_masks(grid: Grid) -> torch.Tensor:
    """(R, X, Y) bool: region r covers cell (x, y); region 0 is the whole grid."""
    centers = torch.as_tensor(grid.cell_centers(), dtype=torch.float64)
    dist = centers.norm(dim=-1)
    masks = [torch.ones_like(dist, dtype=torch.bool)] + [(dist >= lo) & (dist < hi) for lo, hi in BANDS]
    return torch.stack(masks)


def iou(tp: float, fp: float, fn: float) -> float:
    """TP / (TP + FP + FN); NaN when the region has neither targets nor predictions."""
    union = tp + fp + fn
    return float(tp / union) if union > 0 else math.nan


def _key(prefix: str, fname: str, rname: str) -> str:
    return prefix + ("" if fname == "all" else "_vis") + ("" if rname == "all" else f"_{rname}")


class BevIoU(Metric):
    """Accumulates TP/FP/FN per (class, filter, region); sums across processes under DDP (torchmetrics).

    update(logits (B, K, X, Y), target (B, K, X, Y) in {0, 1}, visibility (B, X, Y) or None); the
    visibility filter applies to every class. compute() -> {"iou_<class>", "iou_<class>_vis",
    "iou_<class>_0_20m", "iou_<class>_vis_0_20m", ...} for every class, and the same keys without
    the class ("iou", "iou_vis", ...) for the first class.
    """

    full_state_update = False

    def __init__(self, grid: Grid, threshold: float = 0.5, class_names: Sequence[str] = ("vehicle",)):
        super().__init__()
        self.threshold = float(threshold)
        self.class_names = tuple(class_names)
        self.register_buffer("masks", band_masks(Grid.from_any(grid)), persistent=False)
        # counts[k, f, r] = (tp, fp, fn), int64 so a trainval split cannot overflow or lose precision.
        self.add_state(
            "counts",
            default=torch.zeros(len(self.class_names), len(FILTERS), len(REGIONS), 3, dtype=torch.int64),
            dist_reduce_fx="sum",
        )

    def update(self, logits: torch.Tensor, target: torch.Tensor, visibility: torch.Tensor | None = None) -> None:
        K, XY = len(self.class_names), tuple(self.masks.shape[-2:])
        if logits.dim() != 4 or logits.shape != target.shape or logits.shape[1] != K or tuple(logits.shape[-2:]) != XY:
            raise ValueError(
                f"prediction {tuple(logits.shape)} and target {tuple(target.shape)} must both be (B, {K}, *{XY}) "
                f"for classes {list(self.class_names)}"
            )
        pred = logits.detach().float().sigmoid() > self.threshold  # (B, K, X, Y)
        tgt = target > 0.5
        keep = torch.ones_like(tgt[:, :1])
        if visibility is not None:
            keep = (visibility != IGNORED_VISIBILITY).reshape(-1, 1, *XY)
        masks = self.masks.to(pred.device).to(torch.int64)  # (R, X, Y)
        for f, use in enumerate((torch.ones_like(keep), keep)):
            per_cell = torch.stack([pred & tgt & use, pred & ~tgt & use, ~pred & tgt & use], dim=2).sum(
                0
            )  # (K, 3, X, Y)
            # (K, 3, 1, X, Y) * (R, X, Y) summed over cells -> (K, 3, R); no integer matmul (none on CUDA)
            counts = (per_cell.to(torch.int64).unsqueeze(2) * masks).sum((-1, -2))
            self.counts[:, f] += counts.transpose(1, 2)

    def compute(self) -> dict[str, float]:
        out = {}
        for k, name in enumerate(self.class_names):
            for f, fname in enumerate(FILTERS):
                for r, rname in enumerate(REGIONS):
                    value = iou(*(int(c) for c in self.counts[k, f, r]))
                    out[_key(f"iou_{name}", fname, rname)] = value
                    if k == 0:
                        out[_key("iou", fname, rname)] = value
        return out


class MapIoU(Metric):
    """BEVFusion's map IoU: TP/FP/FN per (class, threshold) over the split; best threshold per class.

    update(logits (B, C, X, Y), target (B, C, X, Y) in {0, 1}). compute() -> {"iou_<class>": best IoU,
    "thr_<class>": its threshold, "iou_<class>@0.35": ..., "miou_map": mean of the best IoUs}.
    """

    full_state_update = False

    def __init__(self, class_names: Sequence[str], thresholds: Sequence[float] = MAP_THRESHOLDS):
        super().__init__()
        self.class_names = tuple(class_names)
        self.threshold_values = tuple(round(float(t), 4) for t in thresholds)
        self.register_buffer("thresholds", torch.tensor(self.threshold_values), persistent=False)
        self.add_state(
            "counts",
            default=torch.zeros(len(self.class_names), len(self.thresholds), 3, dtype=torch.int64),
            dist_reduce_fx="sum",
        )

    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        C = len(self.class_names)
        if logits.dim() != 4 or logits.shape != target.shape or logits.shape[1] != C:
            raise ValueError(
                f"map prediction {tuple(logits.shape)} and target {tuple(target.shape)} must both be "
                f"(B, {C}, X, Y) for map classes {list(self.class_names)}"
            )
        prob = logits.detach().float().sigmoid().transpose(0, 1).reshape(C, -1)  # (C, N)
        tgt = (target > 0.5).transpose(0, 1).reshape(C, -1)
        for i, t in enumerate(self.thresholds.to(prob.device)):
            pred = prob >= t
            self.counts[:, i, 0] += (pred & tgt).sum(1)
            self.counts[:, i, 1] += (pred & ~tgt).sum(1)
            self.counts[:, i, 2] += (~pred & tgt).sum(1)

    def compute(self) -> dict[str, float]:
        out, best = {}, []
        for k, name in enumerate(self.class_names):
            ious = [iou(*(int(c) for c in self.counts[k, i])) for i in range(len(self.thresholds))]
            for t, v in zip(self.threshold_values, ious):
                out[f"iou_{name}@{t:.2f}"] = v
            valid = [i for i, v in enumerate(ious) if not math.isnan(v)]
            i = max(valid, key=lambda j: ious[j]) if valid else 0
            out[f"iou_{name}"] = ious[i]
            out[f"thr_{name}"] = self.threshold_values[i] if valid else math.nan
            best.append(ious[i])
        finite = [b for b in best if not math.isnan(b)]
        out["miou_map"] = sum(finite) / len(finite) if finite else math.nan
        return out


def format_table(
    results: dict[str, float], object_classes: Sequence[str] = ("vehicle",), map_classes: Sequence[str] = ()
) -> str:
    """One row per class. Object classes: IoU at the threshold, with the visibility filter, and per
    distance band. Map classes: IoU at the best threshold (BEVFusion) and that threshold; then the mean."""
    bands = [r for r in REGIONS if r != "all"]
    head = (
        f"{'class':<16}{'IoU':>8}{'IoU (vis>1)':>13}"
        + "".join(f"{b.replace('_', '-'):>10}" for b in bands)
        + f"{'best thr':>10}"
    )
    lines = [head]

    def fmt(v):
        return f"{v:.4f}" if isinstance(v, float) and not math.isnan(v) else ("nan" if isinstance(v, float) else "-")

    for name in object_classes:
        pre = f"iou_{name}" if f"iou_{name}" in results else "iou"
        row = [results.get(pre, math.nan), results.get(pre + "_vis", math.nan)] + [
            results.get(f"{pre}_{b}", math.nan) for b in bands
        ]
        lines.append(
            f"{name:<16}{fmt(row[0]):>8}{fmt(row[1]):>13}" + "".join(f"{fmt(v):>10}" for v in row[2:]) + f"{'-':>10}"
        )
    for name in map_classes:
        lines.append(
            f"{name:<16}{fmt(results.get(f'iou_{name}', math.nan)):>8}{'-':>13}"
            + "".join(f"{'-':>10}" for _ in bands)
            + f"{fmt(results.get(f'thr_{name}', math.nan))[:4]:>10}"
        )
    if map_classes:
        lines.append(f"{'map mean (mIoU)':<16}{fmt(results.get('miou_map', math.nan)):>8}")
    if "future_iou_long" in results:  # a temporal model: FIERY's scores over the present and future frames
        lines += ["", f"{'present + future':<24}{'IoU':>8}{'VPQ':>8}"]
        for r, extent in FIERY_RANGES.items():
            name = f"{r} ({extent:g} m x {extent:g} m)"
            lines.append(
                f"{name:<24}{fmt(results.get(f'future_iou_{r}', math.nan)):>8}{fmt(results.get(f'vpq_{r}', math.nan)):>8}"
            )
        if "future_iou_long_present_copied" in results:
            lines += ["", f"{'present copied to future':<24}{'IoU':>8}{'VPQ':>8}"]
            for r, extent in FIERY_RANGES.items():
                iou, vpq = (results.get(f"{m}_{r}_present_copied", math.nan) for m in ("future_iou", "vpq"))
                lines.append(f"{f'{r} ({extent:g} m x {extent:g} m)':<24}{fmt(iou):>8}{fmt(vpq):>8}")
    return "\n".join(lines)


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
