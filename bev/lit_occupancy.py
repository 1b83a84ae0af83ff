"""LightningModule for 3D semantic occupancy (Occ3D-nuScenes): a BEVNet with an occupancy head trained on
the items of data.occupancy=true with bev.tasks.occupancy.loss, scored by Occ3D's mIoU (bev.tasks.occupancy.metric).

Logged (docs/configs.md#log-keys): <stage>/loss the weighted total, <stage>/occ_loss (cross-entropy),
<stage>/lovasz_loss and <stage>/depth_loss when on; val/occ_miou (Occ3D's mIoU over classes 0-16, a fraction),
val/occ_miou_best, val/occ_iou_<class>, val/occ_miou_<band> (xy distance bands 0-20, 20-40, 40+ m); the same
under test/. The confusion is summed over every process before it is scored (OccupancyMIoU.all_reduce), so
the numbers are the split's whatever the number of processes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from bev.lit import BEVModule
from bev.tasks.occupancy.grid import FREE, OCC3D_CLASSES
from bev.tasks.occupancy.io import write_prediction
from bev.tasks.occupancy.loss import OccupancyLoss, check_loss_options
from bev.tasks.occupancy.metric import DEFAULT_BANDS, MASKS, OccScores, OccupancyMIoU

LABEL_KEY, MASK_KEYS = "occ_semantics", ("occ_mask_camera", "occ_mask_lidar")


def score_dict(scores: OccScores, bands: Mapping[str, OccScores]) -> dict[str, float]:
    """occ_miou, occ_iou_<class> (classes 0-16) and occ_miou_<band> of a computed OccupancyMIoU."""
    out = {"occ_miou": scores.miou}
    out.update({f"occ_iou_{OCC3D_CLASSES[c]}": float(scores.iou[c]) for c in range(FREE)})
    out.update({f"occ_miou_{name}": s.miou for name, s in bands.items()})
    return out


class OccupancyLitModule(BEVModule):
    """Occupancy's loss and metric on BEVModule's training (optimiser, schedule, compile, init_from, depth loss).

    loss: {class_weight: null | log_frequency | inverse_sqrt_frequency | [18] | {class: w}, lovasz_weight: 0,
    visible_only: true}
    (bev.tasks.occupancy.loss.OccupancyLoss). metric_mask: the voxels scored, "camera" as Occ3D (or "lidar", "none").
    depth_weight > 0: the camera depth supervised by lidar depth bins as in BEVModule (data.depth_target=true).
    prediction_dir: where test batches write their predictions in the challenge's format (bev-eval sets it).
    """

    def __init__(
        self,
        net: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        scheduler_interval: str = "step",
        compile: bool | str | None = False,
        loss: Mapping[str, Any] | None = None,
        metric_mask: str = "camera",
        depth_weight: float = 0.0,
        init_from: str | None = None,
        headline: str = "val/occ_miou",
    ):
        super().__init__(net, optimizer, scheduler, scheduler_interval, compile, depth_weight, init_from, headline)
        self.tasks = ("occupancy",)
        # What the entry points name the output channels by (bev-predict's summary, pictures).
        self.object_classes, self.map_classes = tuple(OCC3D_CLASSES), ()
        self.class_names = self.object_classes
        self.occ_loss = OccupancyLoss(**check_loss_options(loss))
        if metric_mask not in MASKS:
            raise ValueError(f"model.metric_mask must be one of {', '.join(MASKS)}, got {metric_mask!r}")
        self.metric_mask = metric_mask
        self._scores: dict[str, OccupancyMIoU] = {}
        self.prediction_dir: str | None = None

    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        config = getattr(dm, "config", None)
        if config is not None and not getattr(config, "occupancy", False):
            raise ValueError("an occupancy model trains and scores on Occ3D labels: set data.occupancy=true")
        super().setup(stage)

    # ------------------------------------------------------------------ loss

    def forward_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(total loss, logits (B, 18, X, Y, Z), the unweighted terms: occ, lovasz, depth)."""
        out = self(batch)
        loss, terms = self.losses(out, batch, depth=bool(self.depth_weight))
        return loss, out["occupancy"], terms

    def losses(self, out: dict, batch: dict, depth: bool = False) -> tuple[torch.Tensor, dict]:
        if LABEL_KEY not in batch:
            raise ValueError("an occupancy model trains on Occ3D labels: the batches need data.occupancy=true")
        terms = self.occ_loss(out["occupancy"], batch[LABEL_KEY], batch.get(MASK_KEYS[0]))
        loss = self.occ_loss.total(terms)
        if depth:
            terms["depth"] = self.depth_term(out["depth"], batch)
            loss = loss + self.depth_weight * terms["depth"]
        return loss, terms

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        loss, logits, terms = self.forward_loss(batch)
        self.log_losses("train", loss, terms, logits.shape[0])
        return {"loss": loss}  # no BEV "logits": the BEV picture callback has nothing to draw

    # ------------------------------------------------------------------ evaluation

    def scores(self, stage: str) -> OccupancyMIoU:
        """The stage's accumulator, on this module's device (made on first use)."""
        if stage not in self._scores or self._scores[stage].confusion.device != self.device:
            self._scores[stage] = OccupancyMIoU(self.metric_mask, DEFAULT_BANDS, device=self.device)
        return self._scores[stage]

    def _eval_step(self, batch: dict, stage: str) -> None:
        out = self(batch)
        logits = out["occupancy"]
        if LABEL_KEY not in batch:
            raise ValueError("an occupancy model is scored on Occ3D labels: the batches need data.occupancy=true")
        self.log_losses(stage, *self.losses(out, batch), logits.shape[0])
        pred = logits.argmax(1)
        masks = {k.removeprefix("occ_"): batch.get(k) for k in MASK_KEYS}
        self.scores(stage).update(pred, batch[LABEL_KEY], **masks)
        if stage == "test" and self.prediction_dir:
            for token, p in zip(batch["sample_token"], pred.to(torch.uint8).cpu().numpy()):
                write_prediction(self.prediction_dir, token, p)

    def _epoch_scores(self, stage: str) -> dict[str, float]:
        """The split's scores (every process's confusion summed), then the accumulator is reset."""
        acc = self.scores(stage)
        acc.all_reduce()
        out = score_dict(acc.compute(), acc.compute_bands())
        acc.reset()
        return out

    def validation_results(self) -> dict[str, float]:
        return self._epoch_scores("val")

    def on_test_epoch_end(self) -> None:
        self.log_dict({f"test/{k}": v for k, v in self._epoch_scores("test").items()})

    def predict_step(self, batch: dict, batch_idx: int = 0, dataloader_idx: int = 0) -> dict[str, torch.Tensor]:
        """{"occupancy": (B, 200, 200, 16) uint8 class ids (the argmax), indexed [x, y, z]}."""
        return {"occupancy": self(batch)["occupancy"].argmax(1).to(torch.uint8)}
