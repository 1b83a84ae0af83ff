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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torchmetrics import Metric

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


def format_value(v) -> str:
    """A table cell: a score to 4 decimals, "nan", or "-" where there is none."""
    return f"{v:.4f}" if isinstance(v, float) and not math.isnan(v) else ("nan" if isinstance(v, float) else "-")


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
    for name in object_classes:
        pre = f"iou_{name}" if f"iou_{name}" in results else "iou"
        row = [results.get(pre, math.nan), results.get(pre + "_vis", math.nan)] + [
            results.get(f"{pre}_{b}", math.nan) for b in bands
        ]
        lines.append(
            f"{name:<16}{format_value(row[0]):>8}{format_value(row[1]):>13}"
            + "".join(f"{format_value(v):>10}" for v in row[2:])
            + f"{'-':>10}"
        )
    for name in map_classes:
        lines.append(
            f"{name:<16}{format_value(results.get(f'iou_{name}', math.nan)):>8}{'-':>13}"
            + "".join(f"{'-':>10}" for _ in bands)
            + f"{format_value(results.get(f'thr_{name}', math.nan))[:4]:>10}"
        )
    if map_classes:
        lines.append(f"{'map mean (mIoU)':<16}{format_value(results.get('miou_map', math.nan)):>8}")
    return "\n".join(lines)
