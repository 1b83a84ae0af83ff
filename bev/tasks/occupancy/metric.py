"""Occ3D's mIoU, as `Metric_mIoU` of the CVPR 2023 occupancy challenge computes it
(projects/mmdet3d_plugin/datasets/occ_metrics.py in CVPR2023-3D-Occupancy-Prediction):

- an 18 x 18 confusion (rows ground truth, columns prediction) summed over every scored voxel of every
  sample: the voxels with mask_camera (the challenge's setting; mask_lidar or no mask as options); ground
  truth ids outside 0..17 (e.g. 255) are skipped, as their `hist_info` does;
- per-class IoU = diag / (row sum + column sum - diag), NaN for a class that neither occurs nor is predicted;
- mIoU = the NaN-ignoring mean over classes 0..16 (free, 17, is left out), printed x 100 rounded to 2 places.

Optionally the confusion is also kept per band of xy distance from the ego (voxel column centres), e.g.
0-20, 20-40 and 40+ m. The counts are one int64 tensor (`confusion`), so processes can sum them
(`all_reduce`) before scoring once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from bev.tasks.occupancy.grid import FREE, NUM_CLASSES, OCC3D_CLASSES, OCC_SHAPE, column_distances

MASKS = ("camera", "lidar", "none")
DEFAULT_BANDS: tuple[tuple[float, float], ...] = ((0.0, 20.0), (20.0, 40.0), (40.0, math.inf))


def per_class_iou(confusion) -> np.ndarray:
    """(C,) float64 IoU per class of a (C, C) confusion (rows truth, columns prediction); NaN where 0 / 0."""
    h = np.asarray(torch.as_tensor(confusion).cpu(), dtype=np.float64)
    diag = np.diag(h)
    with np.errstate(divide="ignore", invalid="ignore"):
        return diag / (h.sum(1) + h.sum(0) - diag)


def mean_iou(iou: np.ndarray) -> float:
    """The mean over classes 0..16 ignoring NaN (Occ3D's mIoU, a fraction); NaN if none is defined."""
    scored = np.asarray(iou, dtype=np.float64)[:FREE]
    return float(np.nanmean(scored)) if np.isfinite(scored).any() else math.nan


def check_class_ids(pred: torch.Tensor, gt: torch.Tensor) -> None:
    """Refuse a prediction and truth that are not class ids of one shape (..., 200, 200, 16), or predicted ids outside
    0..17, with one ValueError saying what to pass."""
    if pred.shape != gt.shape or tuple(gt.shape[-3:]) != OCC_SHAPE:
        raise ValueError(
            f"prediction {tuple(pred.shape)} and truth {tuple(gt.shape)} must both be (..., {', '.join(map(str, OCC_SHAPE))})"
        )
    if pred.is_floating_point() or gt.is_floating_point():
        raise ValueError("pass class ids (integers), not scores: take the argmax over the class axis first")
    if pred.numel() and (int(pred.min()) < 0 or int(pred.max()) >= NUM_CLASSES):
        raise ValueError(
            f"predicted class ids must be in 0..{NUM_CLASSES - 1}, got {int(pred.min())}..{int(pred.max())}"
        )


@dataclass(frozen=True)
class OccScores:
    """What one confusion scores: per-class IoU (18, fractions), mIoU over 0..16, and mIoU x 100 rounded as Occ3D prints it."""

    iou: np.ndarray
    miou: float
    miou_x100: float
    voxels: int  # scored voxels

    @classmethod
    def of(cls, confusion) -> OccScores:
        iou = per_class_iou(confusion)
        m = mean_iou(iou)
        return cls(iou, m, round(m * 100, 2) if math.isfinite(m) else math.nan, int(torch.as_tensor(confusion).sum()))

    def as_dict(self, prefix: str = "occ") -> dict[str, float]:
        """Slash-named numbers: <prefix>/miou and <prefix>/iou_<class> for classes 0..16."""
        out = {f"{prefix}/miou": self.miou}
        out.update({f"{prefix}/iou_{OCC3D_CLASSES[c]}": float(self.iou[c]) for c in range(FREE)})
        return out


def _band_of_columns(bands: Sequence[tuple[float, float]]) -> torch.Tensor:
    """(200, 200) int64 band index of every voxel column; len(bands) for columns in no band."""
    d = column_distances()
    out = np.full(d.shape, len(bands), np.int64)
    for b, (lo, hi) in reversed(list(enumerate(bands))):  # the first band listed wins an overlap
        out[(d >= lo) & (d < hi)] = b
    return torch.from_numpy(out)


class OccupancyMIoU:
    """Accumulates Occ3D's confusion over batches; `compute()` scores it (see the module docstring).

    update(pred, gt, mask_camera=..., mask_lidar=...) takes arrays or tensors (..., 200, 200, 16) of class ids
    (a leading batch axis is fine); `mask` picks which mask selects the scored voxels ("camera", as Occ3D
    scores; "lidar"; "none"). With `bands`, `confusion` is (len(bands) + 1, 18, 18): one confusion per band,
    the last for voxels in no band; the total is their sum.
    """

    def __init__(self, mask: str = "camera", bands: Sequence[tuple[float, float]] | None = None, device=None):
        if mask not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {mask!r}")
        self.mask = mask
        self.bands = tuple((float(lo), float(hi)) for lo, hi in bands) if bands else ()
        self.confusion = torch.zeros(len(self.bands) + 1, NUM_CLASSES, NUM_CLASSES, dtype=torch.int64, device=device)
        self._band = _band_of_columns(self.bands).to(self.confusion.device)
        self.samples = 0

    def reset(self) -> None:
        self.confusion.zero_()
        self.samples = 0

    def update(self, pred, gt, mask_camera=None, mask_lidar=None) -> None:
        """Add a sample (or a batch of samples) to the confusion."""
        dev = self.confusion.device
        pred, gt = torch.as_tensor(pred, device=dev), torch.as_tensor(gt, device=dev)
        check_class_ids(pred, gt)
        keep = (gt >= 0) & (gt < NUM_CLASSES)  # Occ3D skips ids outside 0..17 (e.g. 255) in the truth
        chosen = {"camera": mask_camera, "lidar": mask_lidar, "none": None}[self.mask]
        if self.mask != "none":
            if chosen is None:
                raise ValueError(f"OccupancyMIoU(mask={self.mask!r}) needs mask_{self.mask} in update()")
            m = torch.as_tensor(chosen, device=dev)
            if m.shape != gt.shape:
                raise ValueError(f"mask_{self.mask} has shape {tuple(m.shape)}, the labels {tuple(gt.shape)}")
            keep &= m.bool()
        band = self._band[:, :, None].expand(OCC_SHAPE).expand_as(gt)
        cell = (band * NUM_CLASSES + gt.long()) * NUM_CLASSES + pred.long()
        n = self.confusion.numel()
        self.confusion += torch.bincount(cell[keep], minlength=n).view_as(self.confusion)
        self.samples += int(math.prod(gt.shape[:-3]))

    def merge(self, other: OccupancyMIoU) -> OccupancyMIoU:
        """Add another accumulator's counts (same mask and bands) to this one."""
        if (other.mask, other.bands) != (self.mask, self.bands):
            raise ValueError("cannot merge accumulators with different masks or distance bands")
        self.confusion += other.confusion.to(self.confusion.device)
        self.samples += other.samples
        return self

    def all_reduce(self, group=None) -> None:
        """Sum the counts over the processes of torch.distributed (a no-op when it is not initialised)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.confusion, group=group)
            n = torch.tensor([self.samples], dtype=torch.int64, device=self.confusion.device)
            dist.all_reduce(n, group=group)
            self.samples = int(n)

    def compute(self) -> OccScores:
        """Scores of everything accumulated (all bands together)."""
        return OccScores.of(self.confusion.sum(0))

    def compute_bands(self) -> dict[str, OccScores]:
        """Scores per distance band, named "0-20m", "20-40m", "40m+" ...; empty without bands."""
        return {_band_name(lo, hi): OccScores.of(self.confusion[b]) for b, (lo, hi) in enumerate(self.bands)}


def _band_name(lo: float, hi: float) -> str:
    return f"{lo:g}m+" if math.isinf(hi) else f"{lo:g}-{hi:g}m"


def format_table(metrics: dict[str, float], prefix: str = "occ_", mask: str = "camera") -> str:
    """Occ3D's report of a flat metrics dict (occ_iou_<class>, occ_miou, occ_miou_<band>; fractions): per-class IoU
    and the mIoU over classes 0-16, x 100 as Occ3D prints them, then the mIoU per distance band."""

    def pct(v) -> str:
        return "   nan" if v is None or not math.isfinite(v) else f"{100 * v:6.2f}"

    lines = [f"Occ3D mIoU (x 100), {'every voxel' if mask == 'none' else f'voxels of mask_{mask}'}:"]
    lines += [
        f"  {c:>2} {OCC3D_CLASSES[c]:<22}{pct(metrics.get(f'{prefix}iou_{OCC3D_CLASSES[c]}'))}" for c in range(FREE)
    ]
    lines.append(f"  mIoU over classes 0-16     {pct(metrics.get(f'{prefix}miou'))}")
    bands = [k[len(f"{prefix}miou_") :] for k in metrics if k.startswith(f"{prefix}miou_")]
    if bands:
        lines.append(
            "  by xy distance from the ego: "
            + ", ".join(f"{b} {pct(metrics[f'{prefix}miou_{b}']).strip()}" for b in bands)
        )
    return "\n".join(lines)
