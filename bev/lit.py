"""LightningModule: Lift-Splat-Shoot trained with BCE-with-logits (or sigmoid focal loss) on the BEV
target channels: object classes (vehicle, ...) then HD-map classes (drivable_area, ...)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from bev.geometry import CAMERA_GEOMETRY, Grid
from bev.losses import UncertaintyWeights
from bev.schedule import end_schedule_at, run_length, schedule_length, step_schedulers
from bev.tasks import check_tasks
from bev.tasks.detection.decode import check_decoding, decode
from bev.tasks.detection.loss import DetectionLoss
from bev.tasks.detection.scoring import DetectionScore
from bev.tasks.detection.tracking import TrackVelocity, check_past
from bev.tasks.segmentation.loss import SegmentationLoss
from bev.tasks.segmentation.metric import BevIoU, MapIoU
from bev.utils.checkpoint import load_matching, upgrade_checkpoint
from bev.utils.legacy import reorder_optimizer_states
from bev.utils.speed import compile_mode, fused_default

CAMERA_KEYS = ("images",) + CAMERA_GEOMETRY
TASKS = ("segmentation", "detection")  # what this module trains (bev.tasks names every task)
TASK_WEIGHTS = ("fixed", "uncertainty")


def _check_tasks(tasks: Sequence[str], net: nn.Module) -> tuple[str, ...]:
    tasks = check_tasks(tasks, TASKS)
    missing = [t for t in tasks if t not in net.heads]
    if missing:
        raise ValueError(
            f"model.tasks has {missing[0]} but the network has no {missing[0]} head: set model.net.heads.{missing[0]} "
            "(e.g. model.net.heads.detection={head_channels: 0}: see experiment=synthetic_det_cpu)"
        )
    return tasks


def _class_names(net: nn.Module, object_classes, map_classes) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(object, map) channel names; checkpoints from before map classes name their one channel "vehicle"."""
    map_classes = tuple(str(c) for c in (map_classes or ()))
    head = getattr(net, "num_classes", None)
    if object_classes is None:
        n = (head or 1) - len(map_classes)
        object_classes = ("vehicle",) if n == 1 else tuple(f"class{k}" for k in range(n))
    object_classes = tuple(str(c) for c in object_classes)
    if not object_classes:
        raise ValueError("model.object_classes is empty: the first channels must be object classes (data.categories)")
    if head is not None and head != len(object_classes) + len(map_classes):
        raise ValueError(
            f"model.net.heads.segmentation.num_classes={head} but object_classes {list(object_classes)} + map_classes "
            f"{list(map_classes)} name {len(object_classes) + len(map_classes)} channels"
        )
    return object_classes, map_classes


class BEVModule(L.LightningModule):
    """What training a BEV network for any of its tasks needs: the network, optimiser and schedule, compile,
    model.init_from, the depth loss, the loss log, the headline metric and its best, and the stored run config.
    Each task's module adds its losses and metrics (validation_results); model.tasks names them (bev.tasks).

    optimizer/scheduler are partials (Hydra `_partial_: true`). A scheduler whose signature
    takes `total_steps` (bev.schedule.OneCycle) or `T_max` (CosineAnnealingLR) gets the
    trainer's estimated number of optimiser steps when the config leaves it out.
    depth_weight > 0 adds that times the cross-entropy of the camera depth logits against the
    lidar depth bins (data.depth_target=true; cells without a target are ignored), as BEVDepth.
    headline: the experiment's headline metric (a val/ key, maximised), whose best is kept as <headline>_best.
    """

    tasks: tuple[str, ...] = ()

    def __init__(
        self,
        net: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        scheduler_interval: str = "step",
        compile: bool | str | None = False,
        depth_weight: float = 0.0,
        init_from: str | None = None,
        headline: str = "val/iou",
    ):
        super().__init__()
        self.init_from = init_from
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.scheduler_interval = scheduler_interval
        self.compile = compile_mode(compile)  # the mode, or None: checked here, before any data is read
        self.depth_weight = float(depth_weight)
        # The headline's best so far: a buffer, so it survives resume (checkpoints of before the headline hold it
        # as val_iou_best: bev.utils.checkpoint.upgrade_checkpoint).
        self.headline = str(headline)
        if not self.headline.startswith("val/"):
            raise ValueError(f"headline={self.headline!r} must be a validation metric, e.g. val/iou or val/NDS")
        self.register_buffer("val_headline_best", torch.tensor(0.0))
        # The resolved run config (set by bev.train); stored in checkpoints so bev-eval can rebuild the model.
        self.run_config: dict | None = None

    @property
    def grid(self) -> Grid:
        """The BEV grid of the output cells (bev.geometry conventions)."""
        return self.net.grid

    @property
    def image_size(self) -> tuple[int, int]:
        """(H, W) the network takes (after the data transform's resize + crop)."""
        return tuple(self.net.image_size)

    def setup(self, stage: str) -> None:
        if self.compile and stage == "fit":
            # In place: state_dict keys stay those of the plain model. fullgraph: a graph break (a host
            # sync, a Python branch on a tensor's value) is an error here, not a silent eager island.
            self.net.compile(mode=self.compile, fullgraph=True)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        report = self._apply_init_from()
        if report and self.trainer.is_global_zero:
            print(report, flush=True)

    def _apply_init_from(self) -> str | None:
        """model.init_from (a checkpoint, or a run / checkpoints directory: its best one): its `net.*` tensors whose
        names and shapes match are loaded when training starts, not on resume; returns what was done."""
        if self.trainer.ckpt_path:
            return f"model.init_from not applied: resuming from {self.trainer.ckpt_path}" if self.init_from else None
        if not self.init_from:
            return self._init_from_unset()
        from bev.utils.checkpoint import read_checkpoint, resolve_checkpoint

        file = resolve_checkpoint(self.init_from)
        ckpt = read_checkpoint(file)
        loaded, report = load_matching(self, ckpt, file)
        return report + self._init_task_decoder(loaded) + self._after_init_from(ckpt, loaded)

    def _init_task_decoder(self, loaded: set[str]) -> str:
        """With decoder.task_decoders and a checkpoint without a detection up path: start it as the shared one."""
        decoder = self.net.decoder
        if getattr(decoder, "det_up1", None) is None or any(".det_up1." in k for k in loaded):
            return ""
        decoder.copy_shared_to_detection()
        return "\n  detection decoder: a copy of the loaded segmentation decoder"

    def _init_from_unset(self) -> str | None:
        """What to say when training starts without model.init_from (nothing: training from scratch is the plan)."""
        return None

    def _after_init_from(self, ckpt: Mapping[str, Any], loaded: set[str]) -> str:
        """More of the init_from report, after the matching tensors were loaded (subclasses start more from them)."""
        return ""

    def on_train_start(self) -> None:
        # Resumed with more epochs than the run started with: stretch a schedule restored from the
        # checkpoint rather than fail or restart past its end (a time budget's limit counts as the end).
        steps = run_length(self.trainer)
        for sched in step_schedulers(self.trainer):
            length = schedule_length(sched)
            if length is not None and length < steps:
                end_schedule_at(sched, steps, pivot=-1)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The network's outputs on a batch: {task: output, "depth": camera depth logits} (bev.models.BEVNet)."""
        return self.run_net(*(batch[k] for k in CAMERA_KEYS))

    def run_net(self, *args, **kwargs):
        """self.net(...) as a new step for CUDA graphs (model.compile=reduce-overhead): the last call's outputs
        are dead, so that its graph's replay may write over them."""
        if self.compile == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        return self.net(*args, **kwargs)

    def depth_term(self, depth_logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """depth_loss against the batch's lidar depth bins, with one clear error where they are missing or shaped
        for another camera stride."""
        if "depth" not in batch:
            raise ValueError(
                "model.depth_weight > 0 needs lidar depth targets in the batch: set data.depth_target=true"
            )
        target = batch["depth"]
        if target.shape[-2:] != depth_logits.shape[-2:]:
            raise ValueError(
                f"depth targets of {tuple(target.shape[-2:])} cells but depth logits of "
                f"{tuple(depth_logits.shape[-2:])}: the targets follow another camera stride; set "
                "data.depth_stride to model.net.camera.downsample"
            )
        return self.depth_loss(depth_logits, target)

    def depth_loss(self, depth_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the cells with a target: logits (B, N, D, fH, fW), bins (B, N, fH, fW)."""
        ce = F.cross_entropy(depth_logits.float().flatten(0, 1), target.flatten(0, 1), ignore_index=-1, reduction="sum")
        return ce / (target >= 0).sum().clamp(min=1)

    def log_losses(self, stage: str, loss: torch.Tensor, terms: Mapping[str, torch.Tensor], batch_size: int) -> None:
        """<stage>/loss (the weighted total) and <stage>/<term>_loss per unweighted term (docs/configs.md#log-keys):
        per step and epoch in training, per epoch averaged over every process in evaluation."""
        train = stage == "train"
        kw = dict(on_step=train, on_epoch=True, sync_dist=not train, batch_size=batch_size)
        self.log(f"{stage}/loss", loss, prog_bar=train, **kw)
        self.log_dict({f"{stage}/{name}_loss": value for name, value in terms.items()}, **kw)

    def on_validation_epoch_end(self) -> None:
        """Logs validation_results() as val/<key>, the headline and its best so far (<headline>_best) on the
        progress bar."""
        results = {f"val/{k}": v for k, v in self.validation_results().items()}
        if self.headline not in results:
            if self.trainer.sanity_checking or not results:
                self.log_dict(results)
                return
            raise ValueError(
                f"headline={self.headline} is not logged by this model (tasks {list(self.tasks)}); it logs "
                f"{sorted(results)[:12]}: set headline to one of them"
            )
        value = results.pop(self.headline)
        if not self.trainer.sanity_checking and math.isfinite(value):
            self.val_headline_best.fill_(max(float(self.val_headline_best), value))
        self.log(self.headline, value, prog_bar=True)
        self.log(f"{self.headline}_best", float(self.val_headline_best), prog_bar=True)
        self.log_dict(results)

    def make_optimizer(self) -> torch.optim.Optimizer:
        """model.optimizer over the trainable parameters (fused on CUDA unless the config says otherwise)."""
        params = [p for p in self.parameters() if p.requires_grad]
        device_type = params[0].device.type if params else "cpu"
        precision = self._trainer.precision if self._trainer is not None else None
        kwargs = fused_default(self.optimizer_factory, device_type, precision)
        return self.optimizer_factory(params=params, **kwargs)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clips a fused optimiser's gradients under bf16-mixed, which Lightning's mixed-precision plugin
        refuses for any optimiser that unscales inside its step: only fp16's GradScaler leaves them
        scaled at this point, so without one they are the true gradients, clipped as the plugin would."""
        if (
            gradient_clip_val
            and getattr(optimizer, "_step_supports_amp_scaling", False)
            and self.trainer.precision != "16-mixed"
        ):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if gradient_clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        optimizer = self.make_optimizer()
        if self.scheduler_factory is None:
            return optimizer
        kwargs = {}
        params = inspect.signature(getattr(self.scheduler_factory, "func", self.scheduler_factory)).parameters
        given = getattr(self.scheduler_factory, "keywords", {})
        steps = int(self.trainer.estimated_stepping_batches)
        if self.scheduler_interval == "epoch":
            steps = int(self.trainer.max_epochs or 1)
        for name in ("total_steps", "T_max"):
            if name in params and given.get(name) is None:
                kwargs[name] = steps
        scheduler = self.scheduler_factory(optimizer=optimizer, **kwargs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.scheduler_interval}}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if upgrade_checkpoint(checkpoint):  # a run resumed from a checkpoint of an earlier network layout
            reorder_optimizer_states(checkpoint, [n for n, p in self.named_parameters() if p.requires_grad])

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.run_config is not None:
            checkpoint["bev_config"] = self.run_config

    def _eval_step(self, batch: dict, stage: str) -> None:
        """One validation ("val") or test ("test") batch: its losses logged, each task's metric updated."""
        raise NotImplementedError

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def validation_results(self) -> dict[str, float]:
        """The split's scores of this validation, keyed without the val/ prefix (each task's metrics reset)."""
        raise NotImplementedError


class BEVLitModule(BEVModule):
    """Segmentation of object and map classes, and 3D boxes (model.tasks), on BEVModule's training.

    object_classes / map_classes name the output channels (in that order); configs fill them from
    data.categories / data.map_layers through the bev.* resolvers, so the head always matches the
    data. Object classes get the LSS IoU (threshold, visibility filter, distance bands), map classes
    BEVFusion's best-threshold IoU. val/iou is the first object class's IoU (the default headline).
    pos_weight: a number for every channel, a list (one per channel) or a {class name: weight}
    mapping (unlisted classes 1.0). loss: "bce" (BCE with logits) or "focal" (sigmoid focal loss,
    focal_gamma; as BEVFusion's map head; pos_weight multiplies the positive term).
    class_weight: the weight of each channel's mean loss in the total (same forms as pos_weight;
    None = every cell alike): with many map channels, the object channels' share of the gradient
    through the shared encoders is otherwise 1/K.
    task_weights: how segmentation and detection add up: "fixed" (1 and detection.weight) or "uncertainty"
    (Kendall et al.'s learned weights, bev.losses.UncertaintyWeights, each started at its first batch's loss:
    a detection loss of about 20 beside a segmentation loss of 0.2 otherwise takes the shared encoders).
    """

    def __init__(
        self,
        net: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        scheduler_interval: str = "step",
        pos_weight: float | Sequence[float] | Mapping[str, float] = 2.13,
        threshold: float = 0.5,
        compile: bool | str | None = False,
        object_classes: Sequence[str] | None = None,
        map_classes: Sequence[str] = (),
        loss: str = "bce",
        focal_gamma: float = 2.0,
        class_weight: float | Sequence[float] | Mapping[str, float] | None = None,
        depth_weight: float = 0.0,
        tasks: Sequence[str] = ("segmentation",),
        detection: Mapping[str, Any] | None = None,
        init_from: str | None = None,
        task_weights: str = "fixed",
        headline: str = "val/iou",
    ):
        super().__init__(net, optimizer, scheduler, scheduler_interval, compile, depth_weight, init_from, headline)
        self.object_classes, self.map_classes = _class_names(net, object_classes, map_classes)
        self.class_names = self.object_classes + self.map_classes
        self.seg_loss = SegmentationLoss(self.class_names, loss, focal_gamma, pos_weight, class_weight)
        grid = getattr(net, "grid", None) or Grid()
        self.val_iou = BevIoU(grid, threshold, self.object_classes)
        self.test_iou = BevIoU(grid, threshold, self.object_classes)
        self.val_map_iou = MapIoU(self.map_classes)
        self.test_map_iou = MapIoU(self.map_classes)
        self.tasks = _check_tasks(tasks, net)
        if task_weights not in TASK_WEIGHTS:
            raise ValueError(f"model.task_weights must be one of {TASK_WEIGHTS}, got {task_weights!r}")
        terms = tuple(t for t in ("seg", "det") if {"seg": "segmentation", "det": "detection"}[t] in self.tasks)
        self.task_weights = UncertaintyWeights(terms, init="loss") if task_weights == "uncertainty" else None
        if "detection" in self.tasks:
            det = dict(detection or {})
            self.detection_weight = float(det.pop("weight", 1.0))
            # Where the head regresses velocity: one choice for the loss and every decoding of its maps.
            frame = {"velocity_frame": det.pop("velocity_frame", "ego")}
            self.det_loss = DetectionLoss(**dict(det.pop("loss", None) or {}), **frame)
            # bev.tasks.detection.decode's options
            self.det_decoding = {**dict(det.pop("decoding", None) or {}), **frame}
            check_decoding(self.det_decoding)
            track = det.pop("track_velocity", None)  # velocity from the boxes' tracks (bev.tasks.detection.tracking)
            track = None if track is None else TrackVelocity.from_config(track)
            check_past(int(getattr(net, "past_frames", 0) or 0), track)  # the detection task's 0.5 s of past
            self.val_det = DetectionScore(grid, self.det_decoding, track)
            self.test_det = DetectionScore(grid, self.det_decoding, track)
            if det:
                raise ValueError(
                    f"unknown model.detection key(s) {sorted(det)}: weight, loss, decoding, velocity_frame, "
                    "track_velocity"
                )
        # Where bev-eval wants results_nusc.json and the devkit's summary (None: a temporary folder).
        self.detection_output_dir: str | None = None

    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        names = tuple(getattr(dm, "class_names", None) or ())
        if names and names != self.class_names:
            raise ValueError(
                f"the data's target channels {list(names)} differ from the model's {list(self.class_names)}: "
                f"model.object_classes/map_classes and net.heads.segmentation.num_classes must follow data.categories and "
                f"data.map_layers (the configs interpolate them with ${{bev.object_classes:...}} etc.)"
            )
        super().setup(stage)

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The segmentation loss of logits (B, K, X, Y) against the BEV targets (bev.tasks.segmentation.loss)."""
        return self.seg_loss(logits, target)

    def _update_metrics(self, iou: BevIoU, map_iou: MapIoU, logits: torch.Tensor, batch: dict) -> None:
        k = len(self.object_classes)
        iou.update(logits[:, :k], batch["bev"][:, :k], batch.get("visibility"))
        if self.map_classes:
            map_iou.update(logits[:, k:], batch["bev"][:, k:])

    def _compute_metrics(self, iou: BevIoU, map_iou: MapIoU) -> dict[str, float]:
        results = iou.compute()
        iou.reset()
        if self.map_classes:
            results.update(map_iou.compute())
            map_iou.reset()
        return results

    def forward_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(total loss, segmentation logits, the loss terms to log: depth, det_heatmap, ...) of a training batch."""
        out = self(batch)
        loss, terms = self.losses(out, batch, depth=bool(self.depth_weight))
        return loss, out["segmentation"], terms

    def losses(self, out, batch: dict, depth: bool = False) -> tuple[torch.Tensor, dict]:
        """(total loss, its terms) of the network's output `out` on a batch: segmentation, detection and, with
        depth, the camera depth."""
        terms: dict[str, torch.Tensor] = {}
        tasks: dict[str, torch.Tensor] = {}
        loss = out["depth"].new_zeros((), dtype=torch.float32)
        if depth:
            terms["depth"] = self.depth_term(out["depth"], batch)
            loss = loss + self.depth_weight * terms["depth"]
        if "segmentation" in self.tasks:
            tasks["seg"] = terms["seg"] = self.loss(out["segmentation"], batch["bev"])
        if "detection" in self.tasks:
            tasks["det"] = self.detection_weight * self._det_terms(out["detection"], batch, terms)
        if self.task_weights is not None and len(tasks) == len(self.task_weights.log_vars):
            return loss + self.task_weights(tasks), terms
        return loss + sum(tasks.values()), terms

    def _det_terms(self, det_out: dict, batch: dict, terms: dict) -> torch.Tensor:
        """The detection loss (adds its parts to terms); needs the targets of data.detection=true."""
        if "det_heatmap" not in batch:
            raise ValueError("model.tasks has detection: the batches need its targets, set data.detection=true")
        det = self.det_loss(det_out, batch)
        terms.update(det=det["loss"], det_heatmap=det["heatmap"], det_regression=det["regression"])
        return det["loss"]

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        loss, logits, terms = self.forward_loss(batch)
        self.log_losses("train", loss, terms, logits.shape[0])
        return {"loss": loss, "logits": logits.detach()}

    def _eval_step(self, batch: dict, stage: str) -> None:
        out = self(batch)
        logits, det_out = out["segmentation"], out.get("detection")
        # The detection loss where the batch has its targets (bev-predict's data may not).
        has_targets = "detection" not in self.tasks or "det_heatmap" in batch
        if has_targets:
            self.log_losses(stage, *self.losses(out, batch), logits.shape[0])
        if "segmentation" in self.tasks:
            iou, map_iou = (self.val_iou, self.val_map_iou) if stage == "val" else (self.test_iou, self.test_map_iou)
            self._update_metrics(iou, map_iou, logits, batch)
        if det_out is not None and "detection" in self.tasks:
            (self.val_det if stage == "val" else self.test_det).update(det_out, batch["sample_token"])

    def _det_metrics(self, stage: str) -> dict[str, float]:
        """DetectionEval's mAP, NDS, ... of the boxes of this epoch's evaluation ({} without a detection head)."""
        if "detection" not in self.tasks:
            return {}
        score = self.val_det if stage == "val" else self.test_det
        dm = getattr(self.trainer, "datamodule", None)
        if self.trainer.sanity_checking or dm is None or getattr(dm, "val_set", None) is None:
            score.reset()
            return {}
        out_dir = self.detection_output_dir if stage == "test" else None
        metrics = score.compute(dm.val_set, out_dir)
        score.reset()
        return metrics

    def validation_results(self) -> dict[str, float]:
        """The split's scores of this validation, keyed without the val/ prefix (each task's metrics reset)."""
        results = {k: v for k, v in self._det_metrics("val").items() if "/" not in k}
        if "segmentation" in self.tasks:
            # Per-threshold map IoUs go to test (bev-eval's metrics.json) only, to keep the training log readable.
            seg = self._compute_metrics(self.val_iou, self.val_map_iou)
            results.update({k: v for k, v in seg.items() if "@" not in k})
        return results

    def predict_step(self, batch: dict, batch_idx: int = 0, dataloader_idx: int = 0):
        """Per-class probabilities (B, K, X, Y) float32 (the sigmoid of the logits); a model that detects gives
        {"bev": those, "detections": per sample {"boxes" (K, 9) BOX_FIELDS, "scores", "labels"}}."""
        out = self(batch)
        probs = out["segmentation"].float().sigmoid()
        if "detection" not in self.tasks:
            return probs
        return {"bev": probs, "detections": self.decode_boxes(out["detection"])}

    @torch.no_grad()
    def decode_boxes(self, det_out: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """The detection head's maps -> per sample {"boxes", "scores", "labels"} (bev.tasks.detection.decode with
        model.detection.decoding)."""
        return decode(det_out["heatmap"], det_out["regression"], self.grid, **self.det_decoding)

    def on_test_epoch_end(self) -> None:
        results = self._compute_metrics(self.test_iou, self.test_map_iou) if "segmentation" in self.tasks else {}
        results.update(self._det_metrics("test"))
        self.log_dict({f"test/{k}": v for k, v in results.items()})
