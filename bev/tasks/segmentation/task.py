"""The segmentation task in training: its loss on the network's "segmentation" logits and its metrics (the LSS IoU
of the object classes, BEVFusion's best-threshold IoU of the map classes), per evaluation stage."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bev.geometry import Grid
from bev.tasks.segmentation.loss import SegmentationLoss
from bev.tasks.segmentation.metric import BevIoU, MapIoU, format_table
from bev.tasks.task import Task, quantised

STAGES = ("val", "test")


class SegmentationTask(Task):
    """Object then map channels (names from the data config); loss "bce" or "focal", pos_weight and class_weight
    per channel (bev.tasks.segmentation.loss); threshold: the object classes' IoU threshold."""

    name = "segmentation"

    def __init__(
        self,
        grid: Grid,
        object_classes: Sequence[str],
        map_classes: Sequence[str] = (),
        loss: str = "bce",
        focal_gamma: float = 2.0,
        pos_weight: float | Sequence[float] | Mapping[str, float] = 2.13,
        class_weight: float | Sequence[float] | Mapping[str, float] | None = None,
        threshold: float = 0.5,
    ):
        super().__init__()
        self.object_classes, self.map_classes = tuple(object_classes), tuple(map_classes)
        self.class_names = self.object_classes + self.map_classes
        self.loss_fn = SegmentationLoss(self.class_names, loss, focal_gamma, pos_weight, class_weight)
        self.iou = nn.ModuleDict({s: BevIoU(grid, threshold, self.object_classes) for s in STAGES})
        self.map_iou = nn.ModuleDict({s: MapIoU(self.map_classes) for s in STAGES})

    def loss(self, out: Mapping, batch: Mapping, terms: Mapping) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        seg = self.loss_fn(out["segmentation"], batch["bev"])
        return seg, {"seg": seg}

    def update(self, out: Mapping, batch: Mapping, stage: str) -> None:
        logits, k = out["segmentation"], len(self.object_classes)
        self.iou[stage].update(logits[:, :k], batch["bev"][:, :k], batch.get("visibility"))
        if self.map_classes:
            self.map_iou[stage].update(logits[:, k:], batch["bev"][:, k:])

    def results(self, stage: str, context) -> dict[str, float]:
        """The stage's IoUs (then reset); the per-threshold map IoUs only in tests (bev-eval's metrics.json)."""
        results = self.iou[stage].compute()
        self.iou[stage].reset()
        if self.map_classes:
            results.update(self.map_iou[stage].compute())
            self.map_iou[stage].reset()
        return results if stage == "test" else {k: v for k, v in results.items() if "@" not in k}

    def predict(self, out: Mapping) -> dict[str, torch.Tensor]:
        return self.head_predictions(out)

    @staticmethod
    def head_predictions(out: Mapping) -> dict[str, torch.Tensor]:
        """{"bev": (B, K, X, Y) probabilities}: the head's logits need no options."""
        return {"bev": out["segmentation"].float().sigmoid()}

    # --- bev-predict: one uint8 (X, Y) array per class in the npz, the maps in the picture

    def npz_arrays(self, item: Mapping) -> dict[str, Any]:
        probs = item["bev"]
        if probs.dim() != 3 or probs.shape[0] != len(self.class_names):
            raise ValueError(f"probs must be (K={len(self.class_names)}, X, Y), got {tuple(probs.shape)}")
        q = quantised(probs)
        return {name: q[k] for k, name in enumerate(self.class_names)}

    def picture_layers(self, item: Mapping, options: Mapping[str, Any]) -> dict[str, Any]:
        return {"pred": item["bev"][None]}

    # --- bev-export: the logits, applying no sigmoid

    exported = ("logits",)

    @staticmethod
    def exported_maps(out: Mapping) -> dict[str, torch.Tensor]:
        return {"logits": out["segmentation"]}

    # --- bev-eval

    def record(self) -> dict[str, Any]:
        """What metrics.json says of how this task's metrics are defined."""
        return {
            "threshold": float(self.iou["test"].threshold),
            "visibility_filter": "iou_vis*: cells of vehicles with nuScenes visibility level 1 (0-40%) ignored",
            "distance_bands_m": "cell-centre distance from the ego origin: [0,20), [20,35), [35,50)",
            "object_classes": list(self.object_classes),
            "map_classes": list(self.map_classes),
            "map_protocol": "BEVFusion: IoU of p >= t over the split for t in 0.35..0.65 step 0.05; iou_<class> at "
            "the best t (thr_<class>); miou_map their mean",
        }

    def report(self, record: Mapping[str, Any], out: Path) -> str:
        """The IoU table, and the run's own val/iou of this checkpoint beside this evaluation's."""
        metrics, logged = record["metrics"], record.get("logged_val_iou")
        text = format_table(metrics, self.object_classes, self.map_classes)
        if logged is not None:
            text += (
                f"\nval/iou logged by the run for this checkpoint: {logged:.4f} (this evaluation: {metrics['iou']:.4f})"
            )
        return text
