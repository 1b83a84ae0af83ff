"""The motion task in training (FIERY's present and future): TemporalLoss on the network's "motion" outputs, which
weighs the present frame's segmentation loss among its own terms (FIERY's learned uncertainty over all of them),
and FIERY's metrics at its two ranges: IoU over the present and future frames and video panoptic quality."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from bev.geometry import Grid
from bev.tasks.motion import IGNORE
from bev.tasks.motion.instances import DECODINGS, decode_sequence
from bev.tasks.motion.loss import TemporalLoss
from bev.tasks.motion.metric import FIERY_RANGES, FutureIoU, PanopticQuality, crop_to_range, format_table
from bev.tasks.task import Task, quantised

OPTIONS = ("loss", "instance_decoding")
# "copied": in tests (bev-eval), also the present frame's outputs copied to every future frame with zero flow, the
# baseline a learned future has to beat
STAGES = ("val", "test", "copied")


class MotionTask(Task):
    """model.motion: {loss: TemporalLoss options (weights, uncertainty, uncertainty_init, future_discount,
    seg_pos_weight, seg_top_k), instance_decoding: propagate (PowerBEV) | fiery}."""

    name = "motion"
    absorbs = ("segmentation",)  # the present frame's segmentation loss is one of its weighted terms ("bev")

    def __init__(self, grid: Grid, options: Mapping[str, Any] | None = None):
        super().__init__()
        opts = dict(options or {})
        unknown = sorted(set(opts) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown model.motion key(s) {unknown}: {', '.join(OPTIONS)}")
        self.temporal_loss = TemporalLoss(**dict(opts.get("loss") or {}))
        self.instance_decoding = opts.get("instance_decoding", "propagate")
        if self.instance_decoding not in DECODINGS:
            raise ValueError(
                f"model.motion.instance_decoding must be one of {DECODINGS}, got {self.instance_decoding!r}"
            )
        self.grid = grid
        self.future_iou = nn.ModuleDict({f"{s}_{r}": FutureIoU() for s in STAGES for r in FIERY_RANGES})
        self.vpq = nn.ModuleDict(
            {f"{s}_{r}": PanopticQuality(temporally_consistent=True) for s in STAGES for r in FIERY_RANGES}
        )

    def loss(self, out: Mapping, batch: Mapping, terms: Mapping) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        extra = {"bev": terms["seg"]} if "seg" in terms else {}
        return self.temporal_loss(out["motion"], batch, extra=extra)

    def update(self, out: Mapping, batch: Mapping, stage: str) -> None:
        self._update(out["motion"], batch, stage)
        if stage == "test":
            self._update(present_copied(out["motion"]), batch, "copied")

    def _update(self, motion: Mapping[str, torch.Tensor], batch: Mapping, stage: str) -> None:
        """Future IoU and VPQ of the present and future frames at each of FIERY's ranges (instances decoded on the
        whole grid, then cropped, as FIERY does)."""
        seg = motion["segmentation"][:, :, 0].float().sigmoid() > 0.5
        target = batch["segmentation"]
        pred_instance = decode_sequence(
            seg, motion["centerness"], motion["offset"], motion["flow"], self.instance_decoding
        )
        for r, extent in FIERY_RANGES.items():
            p, t, inst, gt_inst = crop_to_range(self.grid, extent, seg, target, pred_instance, batch["instance"])
            self.future_iou[f"{stage}_{r}"].update(p, t == 1, t == IGNORE)
            self.vpq[f"{stage}_{r}"].update(inst, gt_inst)

    def results(self, stage: str, context) -> dict[str, float]:
        """{future_iou_long, future_iou_short, vpq_long, vpq_short} of the stage (then reset); tests add the
        copied-present baseline's as <key>_present_copied."""
        results = self._results(stage)
        if stage == "test":
            results.update({f"{k}_present_copied": v for k, v in self._results("copied").items()})
        return results

    def _results(self, stage: str) -> dict[str, float]:
        results = {}
        for r in FIERY_RANGES:
            iou, vpq = self.future_iou[f"{stage}_{r}"], self.vpq[f"{stage}_{r}"]
            results[f"future_iou_{r}"], results[f"vpq_{r}"] = iou.compute()["iou"], vpq.compute()["pq"]
            iou.reset()
            vpq.reset()
        return results

    def predict(self, out: Mapping) -> dict[str, torch.Tensor]:
        """The future segmentation's probabilities; centerness, offset and flow as the heads give them (float32)."""
        motion = out["motion"]
        return {"segmentation": motion["segmentation"].float().sigmoid()} | {
            k: motion[k].float() for k in ("centerness", "offset", "flow")
        }

    # --- bev.predict, bev-predict, and the pictures of bev-predict and bev-eval

    def decoded(self, pred: Mapping, threshold: float = 0.5) -> dict[str, torch.Tensor]:
        """{"instances": (B, T, X, Y) int64 vehicle ids (0 background)}, consistent over the present and future
        frames, decoded from the probabilities by model.motion.instance_decoding."""
        seg = pred["segmentation"][:, :, 0] >= threshold
        return {
            "instances": decode_sequence(seg, pred["centerness"], pred["offset"], pred["flow"], self.instance_decoding)
        }

    def npz_arrays(self, item: Mapping) -> dict[str, Any]:
        """future_segmentation (T, X, Y) uint8 probabilities and future_instances (T, X, Y) int32 ids."""
        seg = item["segmentation"]
        return {
            "future_segmentation": quantised(seg.reshape((-1,) + tuple(seg.shape[-2:]))),
            "future_instances": item["instances"].cpu().numpy().astype(np.int32),
        }

    def picture_layers(self, item: Mapping, options: Mapping[str, Any]) -> dict[str, Any]:
        """The window's predictions: its vehicles in their instance colours with their predicted paths."""
        return {"window": item}

    def report(self, record: Mapping[str, Any], out) -> str:
        """FIERY's scores over the present and future frames, beside the copied present's."""
        return format_table(record["metrics"])


def present_copied(motion: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The present frame's segmentation, centerness and offset copied to every future frame, with zero flow:
    the future of a model that predicts none, decoded and scored like the learned one."""
    frames = motion["segmentation"].shape[1]
    copy = {
        k: motion[k][:, :1].expand(-1, frames, *motion[k].shape[2:]) for k in ("segmentation", "centerness", "offset")
    }
    return {**copy, "flow": torch.zeros_like(motion["flow"])}
