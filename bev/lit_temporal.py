"""LightningModule of the temporal model (bev.models.temporal): present-frame static head + future heads.

The static head's loss, optimiser, schedule, gradient clipping and present-frame IoUs (vehicle,
map) are BEVLitModule's, so its numbers compare with the static model's; the future heads add
bev.tasks.motion.loss.TemporalLoss. Two-stage recipe (FIERY's from-scratch runs diverged for its users):
model.init_from=<static checkpoint or run dir> loads the static model's matching weights before
the first step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from bev.lit import CAMERA_KEYS, BEVLitModule
from bev.losses import check_finite
from bev.models.past_cache import PastFeatureCache, frame_keys
from bev.tasks.motion import IGNORE
from bev.tasks.motion.instances import DECODINGS, decode_sequence
from bev.tasks.motion.loss import TemporalLoss
from bev.tasks.motion.metric import FIERY_RANGES, FutureIoU, PanopticQuality, crop_to_range
from bev.utils.config import plain


class TemporalLitModule(BEVLitModule):
    """BEVLitModule for a BEVNet with a temporal part and motion heads: batches of P+1 input frames, labels for the present and F future frames.

    temporal_loss: keyword arguments of bev.tasks.motion.loss.TemporalLoss (weights, uncertainty, uncertainty_init,
    future_discount, seg_pos_weight, seg_top_k); its "bev" term is the static head's loss (BEVLitModule.loss).
    past_no_grad: the past frames' camera encoder and splat run without gradient (BEVDet4D).
    past_cache_mb > 0 (with past_no_grad): in training, the past frames' BEV features are taken from
    what earlier steps computed for the same frames when there is one (PastFeatureCache), at most
    past_cache_max_age optimiser steps old (null: any age).
    init_from (BEVLitModule's): when the checkpoint has no motion heads but its segmentation head loads
    (network_kind), the future segmentation head also starts as its vehicle head
    (MotionHead.start_from).
    instance_decoding: how instances are decoded over the frames for the metrics and bev.predict
    (bev.tasks.motion.instances.decode_sequence): "propagate" (the present's instances carried by the flow) or "fiery".
    Other arguments: BEVLitModule's.
    """

    def __init__(
        self,
        net: nn.Module,
        optimizer,
        temporal_loss: Mapping[str, Any] | None = None,
        past_no_grad: bool = False,
        past_cache_mb: float = 0,
        past_cache_max_age: int | None = None,
        instance_decoding: str = "propagate",
        **static: Any,
    ):
        if static.get("depth_weight"):
            raise ValueError("model.depth_weight > 0 is not supported by the temporal model: set model.depth_weight=0")
        if static.get("task_weights", "fixed") != "fixed":
            raise ValueError(
                "model.task_weights is the static model's: the temporal model weights its terms with "
                "model.temporal_loss.uncertainty and model.detection.weight"
            )
        super().__init__(net, optimizer, **static)
        self.tasks = (*self.tasks, "motion")  # FIERY's present and future: this module's own task
        # Plain containers only: checkpoints are read with torch.load(weights_only=True).
        self.save_hyperparameters(
            plain(
                {
                    "temporal_loss": temporal_loss,
                    "past_no_grad": past_no_grad,
                    "past_cache_mb": past_cache_mb,
                    "past_cache_max_age": past_cache_max_age,
                    "instance_decoding": instance_decoding,
                    **static,
                }
            )
        )
        if past_cache_mb and not past_no_grad:
            raise ValueError(
                "model.past_cache_mb > 0 reuses past frames' features without gradient: it needs "
                "model.past_no_grad=true"
            )
        self.past_cache = PastFeatureCache(past_cache_mb, past_cache_max_age) if past_cache_mb else None
        self.past_cache_hits: float | None = None  # the last training batch's share of past frames from the cache
        self.temporal_loss = TemporalLoss(**dict(temporal_loss or {}))
        self.past_no_grad = bool(past_no_grad)
        if instance_decoding not in DECODINGS:
            raise ValueError(f"model.instance_decoding must be one of {DECODINGS}, got {instance_decoding!r}")
        self.instance_decoding = instance_decoding
        # FIERY's metrics at its two ranges: IoU pooled over the present and future frames, and VPQ.
        # "copied": in tests (bev-eval), also the present frame's heads copied to every future frame with zero
        # flow, the baseline a learned future has to beat
        stages = ("val", "test", "copied")
        self.future_iou = nn.ModuleDict({f"{s}_{r}": FutureIoU() for s in stages for r in FIERY_RANGES})
        self.vpq = nn.ModuleDict(
            {f"{s}_{r}": PanopticQuality(temporally_consistent=True) for s in stages for r in FIERY_RANGES}
        )

    # --- inputs and losses

    def forward(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        check_sequence_batch(batch, self.net)
        labels = batch if self.training and self.net.heads["motion"].probabilistic else None
        cams = tuple(batch[k] for k in CAMERA_KEYS)
        if self.past_cache is None or not self.training or not self.net.past_frames:
            return self.run_net(*cams, batch["future_egomotion"], past_no_grad=self.past_no_grad, future_labels=labels)
        keys = frame_keys(batch, self.net.past_frames)
        past = self._cached_past(cams, keys)
        out = self.run_net(
            *cams, batch["future_egomotion"], future_labels=labels, past_features=past, return_features=True
        )
        for b, feats in enumerate(out.pop("present_features").detach()):
            self.past_cache.put(keys[b][-1], feats.clone(), self.global_step)  # a copy: a view would keep the batch
        return out

    def _cached_past(self, cams: tuple[torch.Tensor, ...], keys: list[list]) -> torch.Tensor:
        """(B, P, C * Z, X, Y) past-frame BEV features: from the cache where it has them, the rest computed
        (in inference mode) and added to it."""
        B, P, step = len(keys), self.net.past_frames, self.global_step
        found = {(b, t): self.past_cache.get(keys[b][t], step) for b in range(B) for t in range(P)}
        missing = [bt for bt, f in found.items() if f is None]
        if missing:
            bs, ts = (torch.tensor(i, device=cams[0].device) for i in zip(*missing))
            with torch.inference_mode():
                feats = self.net.camera(*(c[bs, ts] for c in cams))[0]
                for (b, t), f in zip(missing, feats):
                    found[(b, t)] = f.clone()
                    self.past_cache.put(keys[b][t], found[(b, t)], step)
        self.past_cache_hits = 1 - len(missing) / (B * P)  # logged by training_step
        return torch.stack([torch.stack([found[(b, t)] for t in range(P)]) for b in range(B)])

    def total_loss(
        self, out: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict]:
        """(weighted total, {term: unweighted value}) over the static head ("bev"), the future heads and, with
        a detection head, the present frame's boxes (BEVDet4D: velocity from the fused past)."""
        seg = self.loss(out["segmentation"], batch["bev"])
        loss, terms = self.temporal_loss(out["motion"], batch, extra={"bev": seg})
        if "detection" in self.tasks:
            loss = loss + self.detection_weight * self._det_terms(out["detection"], batch, terms)
        return loss, terms

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        out = self(batch)
        loss, terms = self.total_loss(out, batch)
        # Reading the loss waits for the device: on a GPU only at the logging interval (NaN weights stay NaN).
        if loss.device.type == "cpu" or self.global_step % max(1, self.trainer.log_every_n_steps) == 0:
            check_finite(loss, terms, self.global_step, self.current_epoch, batch_idx)
        B = out["segmentation"].shape[0]
        self.log_losses("train", loss, terms, B)
        if self.past_cache_hits is not None:
            self.log("train/past_cache_hits", self.past_cache_hits, on_step=False, on_epoch=True, batch_size=B)
        return {"loss": loss}

    def _eval_step(self, batch: dict, stage: str) -> dict[str, torch.Tensor]:
        out = self(batch)
        self.log_losses(stage, *self.total_loss(out, batch), out["segmentation"].shape[0])
        iou, map_iou = (self.val_iou, self.val_map_iou) if stage == "val" else (self.test_iou, self.test_map_iou)
        self._update_metrics(iou, map_iou, out["segmentation"], batch)
        self._update_future_metrics(out["motion"], batch, stage)
        if "detection" in self.tasks:
            (self.val_det if stage == "val" else self.test_det).update(out["detection"], batch["sample_token"])
        if stage == "test":
            self._update_future_metrics(present_copied(out["motion"]), batch, "copied")
        return out

    def _update_future_metrics(
        self, out: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor], stage: str
    ) -> None:
        """Future IoU and VPQ of the present and future frames, at each of FIERY's ranges (instances are
        decoded on the whole grid, then cropped, as FIERY does)."""
        seg = out["segmentation"][:, :, 0].float().sigmoid() > 0.5
        target = batch["segmentation"]
        pred_instance = decode_sequence(seg, out["centerness"], out["offset"], out["flow"], self.instance_decoding)
        for r, extent in FIERY_RANGES.items():
            p, t, inst, gt_inst = crop_to_range(self.grid, extent, seg, target, pred_instance, batch["instance"])
            self.future_iou[f"{stage}_{r}"].update(p, t == 1, t == IGNORE)
            self.vpq[f"{stage}_{r}"].update(inst, gt_inst)

    def _future_results(self, stage: str) -> dict[str, float]:
        """{future_iou_long, future_iou_short, vpq_long, vpq_short} of the split; resets the metrics."""
        results = {}
        for r in FIERY_RANGES:
            iou, vpq = self.future_iou[f"{stage}_{r}"], self.vpq[f"{stage}_{r}"]
            results[f"future_iou_{r}"], results[f"vpq_{r}"] = iou.compute()["iou"], vpq.compute()["pq"]
            iou.reset()
            vpq.reset()
        return results

    def validation_results(self) -> dict[str, float]:
        return {**super().validation_results(), **self._future_results("val")}

    def on_test_epoch_end(self) -> None:
        super().on_test_epoch_end()
        self.log_dict({f"test/{k}": v for k, v in self._future_results("test").items()})
        self.log_dict({f"test/{k}_present_copied": v for k, v in self._future_results("copied").items()})

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def predict_step(self, batch: dict, batch_idx: int = 0, dataloader_idx: int = 0) -> dict[str, torch.Tensor]:
        """Probabilities of the static head ("bev", (B, K, X, Y)) and the future segmentation; centerness,
        offset and flow as the heads give them (float32)."""
        out = self(batch)
        motion = out["motion"]
        probs = {"bev": out["segmentation"].float().sigmoid(), "segmentation": motion["segmentation"].float().sigmoid()}
        return {**probs, **{k: motion[k].float() for k in ("centerness", "offset", "flow")}}

    # --- two-stage training

    def _init_from_unset(self) -> str | None:
        return (
            "model.init_from is not set: the temporal model starts from scratch (its two-stage recipe starts "
            "from a static checkpoint: model.init_from=<static run>/checkpoints)"
        )

    def _after_init_from(self, ckpt: Mapping[str, Any], loaded: set[str]) -> str:
        report = "\n  " + self._init_future(ckpt["state_dict"], loaded)
        stem = "net.decoder.stem.0.weight"
        if self.net.temporal.concat and stem not in loaded and stem in ckpt["state_dict"]:
            if self.net.decoder.load_last_copy(ckpt["state_dict"][stem], self.net.temporal.copies):
                report += "\n  BEV decoder stem: the static one on the present frame's channels, zero on the past's"
        return report

    def _init_future(self, state: Mapping[str, Any], loaded: set[str]) -> str:
        """After init_from: from a checkpoint without motion heads whose segmentation head was loaded, start the
        future segmentation as that head's vehicle logits (MotionHead.start_from); says what was done."""
        if any(k.startswith("net.heads.motion.") for k in state):
            return "future heads: the temporal checkpoint's where they fit"
        if "net.heads.segmentation.conv.weight" not in loaded:
            return "future heads: from scratch (the static head did not fit: other classes or widths)"
        if not self.net.heads["motion"].start_from(self.net.heads["segmentation"].conv):
            return "future heads: from scratch (model.net.heads.motion.head_channels > 0 puts a 3x3 conv before the segmentation head)"
        return "future segmentation head: every frame starts as the static head's vehicle logits"


def check_sequence_batch(batch: Mapping[str, torch.Tensor], net: nn.Module) -> None:
    """One clear error when a batch is not what the temporal model takes (e.g. static data)."""
    images = batch.get("images")
    frames = net.past_frames + 1
    if images is None or images.dim() != 6 or "future_egomotion" not in batch:
        shape = None if images is None else tuple(images.shape)
        raise ValueError(
            f"the temporal model takes windows of {frames} input frames (images (B, {frames}, N, 3, H, W) and "
            f"future_egomotion), got images {shape}: set data.past_frames and data.future_frames "
            f"(e.g. experiment=synthetic_temporal_cpu)"
        )
    if images.shape[1] != frames:
        raise ValueError(
            f"the batch has {images.shape[1]} input frames, the model takes {frames}: "
            f"data.past_frames must equal model.net.temporal.past_frames"
        )
    seg = batch.get("segmentation")
    want = net.heads["motion"].future_frames + 1
    if seg is not None and seg.shape[1] != want:
        raise ValueError(
            f"the batch has labels for {seg.shape[1]} frames, the model predicts {want}: "
            f"data.future_frames must equal model.net.heads.motion.future_frames"
        )


def present_copied(out: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The present frame's segmentation, centerness and offset copied to every future frame, with zero flow:
    the future of a model that predicts none, decoded and scored like the learned one."""
    frames = out["segmentation"].shape[1]
    copy = {k: out[k][:, :1].expand(-1, frames, *out[k].shape[2:]) for k in ("segmentation", "centerness", "offset")}
    return {**copy, "flow": torch.zeros_like(out["flow"])}
