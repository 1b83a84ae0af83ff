"""The occupancy task in training: cross-entropy (and Lovasz) on the network's "occupancy" logits against Occ3D
labels, scored by Occ3D's mIoU per evaluation stage (the confusion summed over every process first); in tests the
predictions can be written in the challenge's format (prediction_dir, set by bev-eval)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from bev.tasks.occupancy.grid import FREE, OCC3D_CLASSES
from bev.tasks.occupancy.io import PREDICTIONS_DIR, prediction_path, write_prediction
from bev.tasks.occupancy.loss import OccupancyLoss, check_loss_options
from bev.tasks.occupancy.metric import DEFAULT_BANDS, MASKS, OccScores, OccupancyMIoU, format_table
from bev.tasks.task import Task
from bev.utils.io import check_output_folder, inside

LABEL_KEY, MASK_KEYS = "occ_semantics", ("occ_mask_camera", "occ_mask_lidar")
OPTIONS = ("loss", "metric_mask")
PREDICTION_FORMAT = (
    "Occ3D challenge format: predictions/<sample token>.npz holds one (200, 200, 16) uint8 array (key arr_0) of "
    "Occ3D class ids (class_names; 17 free), indexed [x, y, z] over [-40, 40] x [-40, 40] x [-1, 5.4] m at 0.4 m "
    "in the ego frame of the sample's LIDAR_TOP (bev.tasks.occupancy.grid)"
)


def score_dict(scores: OccScores, bands: Mapping[str, OccScores]) -> dict[str, float]:
    """occ_miou, occ_iou_<class> (classes 0-16) and occ_miou_<band> of a computed OccupancyMIoU."""
    out = {"occ_miou": scores.miou}
    out.update({f"occ_iou_{OCC3D_CLASSES[c]}": float(scores.iou[c]) for c in range(FREE)})
    out.update({f"occ_miou_{name}": s.miou for name, s in bands.items()})
    return out


class OccupancyTask(Task):
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
        self.rays = None  # the last bev-eval's RayIoU scores (after_test)

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

    # --- bev-eval: the predictions in the challenge's format in <out>/predictions, scored by RayIoU too

    def check_eval_folders(self, out: Path, overwrite: bool) -> None:
        """The predictions folder stays inside the output folder; an earlier evaluation's predictions there are
        replaced only with overwrite=true (a submission folder holds one evaluation's samples)."""
        pred_dir = check_output_folder(out, out / PREDICTIONS_DIR, "challenge-format predictions")
        earlier = earlier_predictions(pred_dir)
        if earlier and not overwrite:
            raise FileExistsError(
                f"{str(pred_dir)!r} already holds {len(earlier)} predictions of an earlier evaluation: pass "
                "overwrite=true to replace them, or another folder (hydra.run.dir=...)"
            )

    def before_test(self, out: Path) -> None:
        for path in earlier_predictions(out / PREDICTIONS_DIR):
            path.unlink()

    def record(self) -> dict[str, Any]:
        return {
            "distance_bands_m": "voxel-column centre distance from the ego origin: [0,20), [20,40), [40,inf)",
            "metric": "Occ3D's Metric_mIoU: 18x18 confusion over the voxels of mask_camera, per-class IoU, mIoU = mean "
            "over classes 0-16 (fractions here; x 100 printed)",
        }

    def after_test(self, record: dict[str, Any], out: Path, index, dataroot: str, options: Mapping[str, Any]) -> None:
        """SparseOcc's RayIoU of the predictions just written against the split's labels (unless rayiou=false)."""
        from bev.tasks.occupancy import rayiou

        pred_dir = out / PREDICTIONS_DIR
        record["predictions"], self.rays = str(pred_dir), None
        if not options.get("rayiou", True):
            return
        start = time.perf_counter()
        rays = rayiou.score_predictions(index, dataroot, pred_dir, rayiou.device_for(str(options["accelerator"])))
        seconds = time.perf_counter() - start
        print(f"RayIoU: {len(index['sample_token'])} samples, {rays.rays} scored rays, {seconds:.1f} s", flush=True)
        record["metrics"].update(rays.as_dict())
        record["rayiou_per_class"] = rays.per_class()
        record["rayiou_metric"] = rayiou.DEFINITION
        self.rays = rays

    def report(self, record: Mapping[str, Any], out: Path) -> str:
        from bev.tasks.occupancy import rayiou

        text = format_table(record["metrics"], mask=self.metric_mask)
        if self.rays is not None:
            text += "\n" + rayiou.format_table(self.rays)
        return text + f"\nPredictions (challenge format): {record['predictions']}"

    # --- bev-predict: each sample's class ids in the challenge's format, <out>/predictions/<sample token>.npz

    def prediction_format(self, options: Mapping[str, Any]) -> dict[str, Any]:
        return {"npz_format": PREDICTION_FORMAT}

    def sample_file(self, out: Path, token: str) -> Path:
        return inside(out, prediction_path(out / PREDICTIONS_DIR, token))

    def write_sample(self, out: Path, token: str, item: Mapping) -> Path:
        return write_prediction(out / PREDICTIONS_DIR, token, item["occupancy"].numpy())

    def picture_layers(self, item: Mapping, options: Mapping[str, Any]) -> dict[str, Any]:
        """The class ids' top-down and side views, beside the camera-visible ground truth where the batch has it."""
        return {"volume": item["occupancy"]}


def earlier_predictions(pred_dir: Path) -> list[Path]:
    return sorted(p for p in pred_dir.glob("*.npz") if not p.is_dir()) if pred_dir.is_dir() else []
