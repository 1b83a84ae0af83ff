"""BEV segmentation IoU, accumulated over a whole split.

IoU is one global TP / (TP + FP + FN) over every cell of every sample at a threshold (0.5 on
the sigmoid), not a mean of per-sample IoUs. Two variants are always computed:

- "all": every cell counts;
- "vis": the visibility filter of LSS/PointBeV: cells covered by a vehicle whose nuScenes
  visibility level is 1 (0-40% visible) are ignored (neither TP, FP nor FN).

and each is also split by distance band: the Euclidean distance of the cell centre
(Grid.cell_centers) from the ego origin in [0, 20), [20, 35), [35, 50) metres. Cells beyond
50 m (the grid corners) count in the overall IoU only.
"""
from __future__ import annotations

import math

import torch
from torchmetrics import Metric

from bev.geometry import Grid

BANDS: tuple[tuple[float, float], ...] = ((0.0, 20.0), (20.0, 35.0), (35.0, 50.0))
REGIONS: tuple[str, ...] = ("all",) + tuple(f"{int(lo)}_{int(hi)}m" for lo, hi in BANDS)
FILTERS: tuple[str, ...] = ("all", "vis")
IGNORED_VISIBILITY = 1


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


class BevIoU(Metric):
    """Accumulates TP/FP/FN per (filter, region); sums across processes under DDP (torchmetrics).

    update(logits (B, 1 or X.., X, Y), target (B, 1, X, Y) in {0, 1}, visibility (B, X, Y) or None).
    compute() -> {"iou": ..., "iou_vis": ..., "iou_0_20m": ..., "iou_vis_0_20m": ..., ...}.
    """

    full_state_update = False

    def __init__(self, grid: Grid, threshold: float = 0.5):
        super().__init__()
        self.threshold = float(threshold)
        self.register_buffer("masks", band_masks(Grid.from_any(grid)), persistent=False)
        # counts[f, r] = (tp, fp, fn), int64 so a trainval split cannot overflow or lose precision.
        self.add_state("counts", default=torch.zeros(len(FILTERS), len(REGIONS), 3, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, target: torch.Tensor, visibility: torch.Tensor | None = None) -> None:
        pred = (logits.detach().float().sigmoid() > self.threshold).flatten(0, -3)  # (B*K, X, Y)
        tgt = (target > 0.5).flatten(0, -3)
        if pred.shape != tgt.shape or pred.shape[-2:] != self.masks.shape[-2:]:
            raise ValueError(f"prediction {tuple(pred.shape)} and target {tuple(tgt.shape)} must both be (..., {tuple(self.masks.shape[-2:])})")
        keep = torch.ones_like(tgt)
        if visibility is not None:
            keep = (visibility != IGNORED_VISIBILITY).reshape(-1, *tgt.shape[-2:])
            keep = keep.repeat_interleave(tgt.shape[0] // keep.shape[0], dim=0)  # same filter for every class
        masks = self.masks.to(pred.device)
        for f, use in enumerate((torch.ones_like(keep), keep)):
            tp = (pred & tgt & use).sum(0)
            fp = (pred & ~tgt & use).sum(0)
            fn = (~pred & tgt & use).sum(0)
            per_cell = torch.stack([tp, fp, fn])  # (3, X, Y)
            self.counts[f] += (per_cell.unsqueeze(1) * masks.unsqueeze(0)).sum((-1, -2)).T.to(self.counts.dtype)

    def compute(self) -> dict[str, float]:
        out = {}
        for f, fname in enumerate(FILTERS):
            for r, rname in enumerate(REGIONS):
                key = "iou" + ("" if fname == "all" else "_vis") + ("" if rname == "all" else f"_{rname}")
                out[key] = iou(*(int(c) for c in self.counts[f, r]))
        return out


def format_table(results: dict[str, float]) -> str:
    """A plain-text table: rows overall + distance bands, columns without/with the visibility filter."""
    lines = [f"{'region':<12}{'IoU':>10}{'IoU (vis>1)':>14}"]
    for rname in REGIONS:
        suffix = "" if rname == "all" else f"_{rname}"
        label = "overall" if rname == "all" else rname.replace("_", "-")
        a, v = results.get("iou" + suffix, math.nan), results.get("iou_vis" + suffix, math.nan)
        lines.append(f"{label:<12}{a:>10.4f}{v:>14.4f}")
    return "\n".join(lines)
