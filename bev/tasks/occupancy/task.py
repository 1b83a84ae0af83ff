"""The occupancy task in training: cross-entropy (and Lovasz) on the network's "occupancy" logits against Occ3D
labels, scored by Occ3D's mIoU per evaluation stage (the confusion summed over every process first); in tests the
predictions can be written in the challenge's format (prediction_dir, set by bev-eval)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from bev.tasks.occupancy.grid import FREE, OCC3D_CLASSES
from bev.tasks.occupancy.io import write_prediction
from bev.tasks.occupancy.loss import OccupancyLoss, check_loss_options
from bev.tasks.occupancy.metric import DEFAULT_BANDS, MASKS, OccScores, OccupancyMIoU

LABEL_KEY, MASK_KEYS = "occ_semantics", ("occ_mask_camera", "occ_mask_lidar")
OPTIONS = ("loss", "metric_mask")


def score_dict(scores: OccScores, bands: Mapping[str, OccScores]) -> dict[str, float]:
    """occ_miou, occ_iou_<class> (classes 0-16) and occ_miou_<band> of a computed OccupancyMIoU."""
    out = {"occ_miou": scores.miou}
    out.update({f"occ_iou_{OCC3D_CLASSES[c]}": float(scores.iou[c]) for c in range(FREE)})
    out.update({f"occ_miou_{name}": s.miou for name, s in bands.items()})
    return out


class OccupancyTask(nn.Module):
    """model.occupancy: {loss: {class_weight, lovasz_weight, visible_only} (bev.tasks.occupancy.loss.OccupancyLoss),
    metric_mask: camera (Occ3D) | lidar | none, the voxels scored}."""

    name = "occupancy"

    def __init__(self, options: Mapping[str, Any] | None = None):
        super().__init__()
        opts = dict(options or {})
        unknown = sorted(set(opts) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown model.occupancy key(s) {unknown}: {', '.join(OPTIONS)}")
        self.loss_fn = OccupancyLoss(**check_loss_options(opts.get("loss")))
        self.metric_mask = opts.get("metric_mask", "camera")
        if self.metric_mask not in MASKS:
            raise ValueError(f"model.occupancy.metric_mask must be one of {', '.join(MASKS)}, got {self.metric_mask!r}")
        self._scores: dict[str, OccupancyMIoU] = {}
        self.prediction_dir: str | None = None

    def loss(self, out: Mapping, batch: Mapping, terms: Mapping) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if LABEL_KEY not in batch:
            raise ValueError("an occupancy model trains on Occ3D labels: the batches need data.occupancy=true")
        parts = self.loss_fn(out["occupancy"], batch[LABEL_KEY], batch.get(MASK_KEYS[0]))
        return self.loss_fn.total(parts), parts

    def scores(self, stage: str, device: torch.device) -> OccupancyMIoU:
        """The stage's accumulator, on `device` (made on first use)."""
        if stage not in self._scores or self._scores[stage].confusion.device != device:
            self._scores[stage] = OccupancyMIoU(self.metric_mask, DEFAULT_BANDS, device=device)
        return self._scores[stage]

    def update(self, out: Mapping, batch: Mapping, stage: str) -> None:
        logits = out["occupancy"]
        if LABEL_KEY not in batch:
            raise ValueError("an occupancy model is scored on Occ3D labels: the batches need data.occupancy=true")
        pred = logits.argmax(1)
        masks = {k.removeprefix("occ_"): batch.get(k) for k in MASK_KEYS}
        self.scores(stage, logits.device).update(pred, batch[LABEL_KEY], **masks)
        if stage == "test" and self.prediction_dir:
            for token, p in zip(batch["sample_token"], pred.to(torch.uint8).cpu().numpy()):
                write_prediction(self.prediction_dir, token, p)

    def results(self, stage: str, context) -> dict[str, float]:
        """The stage's scores (every process's confusion summed), then the accumulator is reset."""
        acc = self.scores(stage, context.device)
        acc.all_reduce()
        out = score_dict(acc.compute(), acc.compute_bands())
        acc.reset()
        return out

    def predict(self, out: Mapping) -> dict[str, torch.Tensor]:
        """{"occupancy": (B, 200, 200, 16) uint8 class ids (the argmax), indexed [x, y, z]}."""
        return {"occupancy": out["occupancy"].argmax(1).to(torch.uint8)}
