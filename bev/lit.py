"""The LightningModule: a BEVNet (bev.models) trained for its tasks (model.tasks), each task's loss, metric and
predictions from its package (bev.tasks.<task>.task), summed with fixed or learned weights; the optimiser, the
schedule, compile, model.init_from, the camera depth loss, the loss log and the headline metric are shared."""

from __future__ import annotations

import inspect
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from bev.geometry import CAMERA_GEOMETRY, Grid
from bev.losses import UncertaintyWeights, check_finite
from bev.models.past_cache import PastFeatureCache, frame_keys
from bev.schedule import end_schedule_at, run_length, schedule_length, step_schedulers
from bev.tasks import check_tasks
from bev.tasks.detection.task import DetectionTask
from bev.tasks.motion.task import MotionTask
from bev.tasks.occupancy.grid import OCC3D_CLASSES
from bev.tasks.occupancy.io import PREDICTIONS_DIR
from bev.tasks.occupancy.task import OccupancyTask
from bev.tasks.segmentation.task import SegmentationTask
from bev.utils.checkpoint import load_matching, upgrade_checkpoint
from bev.utils.config import plain
from bev.utils.legacy import reorder_optimizer_states
from bev.utils.speed import compile_mode, fused_default

CAMERA_KEYS = ("images",) + CAMERA_GEOMETRY
TASKS = ("segmentation", "detection", "motion", "occupancy")  # what this module trains (in this order)
TASK_WEIGHTS = ("fixed", "uncertainty")
TERM_NAMES = {"segmentation": "seg", "detection": "det"}  # the learned task weights' names (checkpoint keys)


@dataclass(frozen=True)
class EvalContext:
    """What a task's results need of the run: the sanity check, the split's dataset, the test's output folder."""

    sanity_checking: bool
    dataset: Any
    output_dir: str | None
    device: torch.device


def _check_tasks(tasks: Sequence[str], net: nn.Module) -> tuple[str, ...]:
    tasks = check_tasks(tasks, TASKS)
    missing = [t for t in tasks if t not in net.heads]
    if missing:
        raise ValueError(
            f"model.tasks has {missing[0]} but the network has no {missing[0]} head: set model.net.heads.{missing[0]} "
            "(e.g. model.net.heads.detection={head_channels: 0}: see experiment=synthetic_det_cpu)"
        )
    if ("occupancy" in tasks) != (tasks == ("occupancy",)):
        raise ValueError(f"model.tasks={list(tasks)}: occupancy trains alone (its decoder is its own)")
    return tuple(t for t in TASKS if t in tasks)


def _task_modules(tasks, net, segmentation, detection, motion, occupancy) -> nn.ModuleDict:
    """The tasks' loss, metric and prediction modules, in TASKS order."""
    grid = net.grid
    made: dict[str, nn.Module] = {}
    if "segmentation" in tasks:
        seg = dict(segmentation or {})
        objects, maps = _class_names(net, seg.pop("object_classes", None), seg.pop("map_classes", ()))
        made["segmentation"] = SegmentationTask(grid, objects, maps, **seg)
    if "detection" in tasks:
        made["detection"] = DetectionTask(grid, detection, int(net.past_frames or 0))
    if "motion" in tasks:
        made["motion"] = MotionTask(grid, motion)
    if "occupancy" in tasks:
        made["occupancy"] = OccupancyTask(occupancy)
    return nn.ModuleDict(made)


def _task_weights(mode: str, tasks: tuple[str, ...]) -> UncertaintyWeights | None:
    """Learned weights of segmentation and detection (Kendall et al., each started at its first batch's loss: a
    detection loss of about 20 beside a segmentation loss of 0.2 otherwise takes the shared encoders), or None."""
    if mode not in TASK_WEIGHTS:
        raise ValueError(f"model.task_weights must be one of {TASK_WEIGHTS}, got {mode!r}")
    if mode == "fixed":
        return None
    return UncertaintyWeights(tuple(TERM_NAMES[t] for t in tasks if t in TERM_NAMES), init="loss")


def _class_names(net: nn.Module, object_classes, map_classes) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(object, map) channel names; checkpoints from before map classes name their one channel "vehicle"."""
    map_classes = tuple(str(c) for c in (map_classes or ()))
    head = net.num_classes
    if object_classes is None:
        n = (head or 1) - len(map_classes)
        object_classes = ("vehicle",) if n == 1 else tuple(f"class{k}" for k in range(n))
    object_classes = tuple(str(c) for c in object_classes)
    if not object_classes:
        raise ValueError(
            "model.segmentation.object_classes is empty: the first channels must be object classes (data.categories)"
        )
    if head is not None and head != len(object_classes) + len(map_classes):
        raise ValueError(
            f"model.net.heads.segmentation.num_classes={head} but model.segmentation's object_classes "
            f"{list(object_classes)} + map_classes "
            f"{list(map_classes)} name {len(object_classes) + len(map_classes)} channels"
        )
    return object_classes, map_classes


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
    want = net.heads["motion"].future_frames + 1 if "motion" in net.heads else None
    if seg is not None and want is not None and seg.shape[1] != want:
        raise ValueError(
            f"the batch has labels for {seg.shape[1]} frames, the model predicts {want}: "
            f"data.future_frames must equal model.net.heads.motion.future_frames"
        )


class BEVLitModule(L.LightningModule):
    """What training a BEV network for any of its tasks needs: the network, optimiser and schedule, compile,
    model.init_from, the depth loss, the loss log, the headline metric and its best, and the stored run config.
    Each task's module adds its losses and metrics (validation_results); model.tasks names them (bev.tasks).

    optimizer/scheduler are partials (Hydra `_partial_: true`). A scheduler whose signature
    takes `total_steps` (bev.schedule.OneCycle) or `T_max` (CosineAnnealingLR) gets the
    trainer's estimated number of optimiser steps when the config leaves it out.
    depth_weight > 0 adds that times the cross-entropy of the camera depth logits against the
    lidar depth bins (data.depth_target=true; cells without a target are ignored), as BEVDepth.
    headline: the experiment's headline metric (a val/ key, maximised), whose best is kept as <headline>_best.
    segmentation, detection, motion, occupancy: each task's settings (model.<task>), read by its module
    (bev.tasks.<task>.task) when model.tasks has it.
    """

    def __init__(
        self,
        net: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        scheduler_interval: str = "step",
        compile: bool | str | None = False,
        depth_weight: float = 0.0,
        init_from: str | Sequence[str] | None = None,
        headline: str = "val/iou",
        tasks: Sequence[str] = ("segmentation",),
        task_weights: str = "fixed",
        segmentation: Mapping[str, Any] | None = None,
        detection: Mapping[str, Any] | None = None,
        motion: Mapping[str, Any] | None = None,
        occupancy: Mapping[str, Any] | None = None,
        past_no_grad: bool = False,
        past_cache_mb: float = 0,
        past_cache_max_age: int | None = None,
    ):
        super().__init__()
        # Plain containers only: checkpoints are read with torch.load(weights_only=True).
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler"])
        self.hparams.update(plain(dict(self.hparams)))
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
        self.tasks = _check_tasks(tasks, net)
        self.task_modules = _task_modules(self.tasks, net, segmentation, detection, motion, occupancy)
        self.class_names = self.task_modules.segmentation.class_names if "segmentation" in self.tasks else OCC3D_CLASSES
        self.object_classes = (
            self.task_modules.segmentation.object_classes if "segmentation" in self.tasks else self.class_names
        )
        self.map_classes = self.task_modules.segmentation.map_classes if "segmentation" in self.tasks else ()
        self.task_weights = _task_weights(task_weights, self.tasks)
        self._check_temporal(past_no_grad, past_cache_mb)
        self.past_no_grad = bool(past_no_grad)
        self.past_cache = PastFeatureCache(past_cache_mb, past_cache_max_age) if past_cache_mb else None
        self.past_cache_hits: float | None = None  # the last training batch's share of past frames from the cache
        # The resolved run config (set by bev.train); stored in checkpoints so bev-eval can rebuild the model.
        self.run_config: dict | None = None
        self._output_dir: str | None = None

    def _check_temporal(self, past_no_grad: bool, past_cache_mb: float) -> None:
        temporal = self.net.past_frames is not None
        if temporal and self.depth_weight:
            raise ValueError("model.depth_weight > 0 is not supported by the temporal model: set model.depth_weight=0")
        if temporal and self.task_weights is not None:
            raise ValueError(
                "model.task_weights=uncertainty is the static model's: the temporal model weights its terms with "
                "model.motion.loss.uncertainty and model.detection.weight"
            )
        if past_cache_mb and not past_no_grad:
            raise ValueError(
                "model.past_cache_mb > 0 reuses past frames' features without gradient: it needs model.past_no_grad=true"
            )

    @property
    def grid(self) -> Grid:
        """The BEV grid of the output cells (bev.geometry conventions)."""
        return self.net.grid

    @property
    def image_size(self) -> tuple[int, int]:
        """(H, W) the network takes (after the data transform's resize + crop)."""
        return tuple(self.net.image_size)

    def setup(self, stage: str) -> None:
        self._check_data()
        if self.compile and stage == "fit":
            # In place: state_dict keys stay those of the plain model. fullgraph: a graph break (a host
            # sync, a Python branch on a tensor's value) is an error here, not a silent eager island.
            self.net.compile(mode=self.compile, fullgraph=True)

    def _check_data(self) -> None:
        """The data's target channels are the model's, and occupancy has its labels."""
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        names = tuple(getattr(dm, "class_names", None) or ())
        if "segmentation" in self.tasks and names and names != self.class_names:
            raise ValueError(
                f"the data's target channels {list(names)} differ from the model's {list(self.class_names)}: "
                f"model.segmentation.object_classes/map_classes and net.heads.segmentation.num_classes must follow data.categories "
                f"and data.map_layers (the configs interpolate them with ${{bev.object_classes:...}} etc.)"
            )
        config = getattr(dm, "config", None)
        if "occupancy" in self.tasks and config is not None and not getattr(config, "occupancy", False):
            raise ValueError("an occupancy model trains and scores on Occ3D labels: set data.occupancy=true")

    def on_fit_start(self) -> None:
        super().on_fit_start()
        report = self._apply_init_from()
        if report and self.trainer.is_global_zero:
            print(report, flush=True)

    def _apply_init_from(self) -> str | None:
        """model.init_from (a checkpoint, or a run / checkpoints directory: its best one; or a list of them, a later
        one's tensors over an earlier one's, as BEVFusion starts from a camera and a LiDAR checkpoint): its `net.*`
        tensors whose names and shapes match are loaded when training starts, not on resume; returns what was done."""
        if self.trainer.ckpt_path:
            return f"model.init_from not applied: resuming from {self.trainer.ckpt_path}" if self.init_from else None
        if not self.init_from:
            return self._init_from_unset()
        from bev.utils.checkpoint import read_checkpoint, resolve_checkpoint

        sources = [self.init_from] if isinstance(self.init_from, (str, Path)) else list(self.init_from)
        loaded, reports = set(), []
        for source in sources:
            file = resolve_checkpoint(source)
            ckpt = read_checkpoint(file)
            took, report = load_matching(self, ckpt, file)
            loaded |= took
            reports.append(report)
        if len(sources) > 1:
            own = self.state_dict().items()  # counters (BN's batches tracked) left out: nothing to learn
            new = Counter(
                k.split(".")[1] for k, v in own if k.startswith("net.") and k not in loaded and v.is_floating_point()
            )
            reports.append(
                "  from scratch after all of them: " + (", ".join(f"{p} ({n})" for p, n in new.items()) or "none")
            )
        return "\n".join(reports) + self._after_init_from(ckpt, loaded)

    def _after_init_from(self, ckpt: Mapping[str, Any], loaded: set[str]) -> str:
        """More of the init_from report, after the matching tensors were loaded: the parts started from them."""
        report = self._init_task_decoder(loaded)
        if self.net.temporal is not None and self.net.temporal.concat:
            report += self._init_concat_stem(ckpt["state_dict"], loaded)
        if "motion" in self.tasks:
            report += "\n  " + self._init_future(ckpt["state_dict"], loaded)
        return report

    def _init_task_decoder(self, loaded: set[str]) -> str:
        """With decoder.task_decoders and a checkpoint without a detection up path: start it as the shared one."""
        decoder = self.net.decoder
        if getattr(decoder, "det_up1", None) is None or any(".det_up1." in k for k in loaded):
            return ""
        decoder.copy_shared_to_detection()
        return "\n  detection decoder: a copy of the loaded segmentation decoder"

    def _init_concat_stem(self, state: Mapping[str, Any], loaded: set[str]) -> str:
        """BEVDet4D's concat fusion from a single-frame checkpoint: its stem on the present frame's channels."""
        stem = "net.decoder.stem.0.weight"
        if (
            stem in loaded
            or stem not in state
            or not self.net.decoder.load_last_copy(state[stem], self.net.temporal.copies)
        ):
            return ""
        return "\n  BEV decoder stem: the static one on the present frame's channels, zero on the past's"

    def _init_future(self, state: Mapping[str, Any], loaded: set[str]) -> str:
        """From a checkpoint without motion heads whose segmentation head was loaded, start the future segmentation
        as that head's vehicle logits (MotionHead.start_from); says what was done."""
        if any(k.startswith("net.heads.motion.") for k in state):
            return "future heads: the temporal checkpoint's where they fit"
        if "net.heads.segmentation.conv.weight" not in loaded:
            return "future heads: from scratch (the static head did not fit: other classes or widths)"
        if not self.net.heads["motion"].start_from(self.net.heads["segmentation"].conv):
            return "future heads: from scratch (model.net.heads.motion.head_channels > 0 puts a 3x3 conv before the segmentation head)"
        return "future segmentation head: every frame starts as the static head's vehicle logits"

    def _init_from_unset(self) -> str | None:
        """What to say when training starts without model.init_from (the temporal recipe has two stages)."""
        if "motion" not in self.tasks:
            return None
        return (
            "model.init_from is not set: the temporal model starts from scratch (its two-stage recipe starts "
            "from a static checkpoint: model.init_from=<static run>/checkpoints)"
        )

    def on_train_start(self) -> None:
        # Resumed with more epochs than the run started with: stretch a schedule restored from the
        # checkpoint rather than fail or restart past its end (a time budget's limit counts as the end).
        steps = run_length(self.trainer)
        for sched in step_schedulers(self.trainer):
            length = schedule_length(sched)
            if length is not None and length < steps:
                end_schedule_at(sched, steps, pivot=-1)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The network's outputs on a batch: {task: output, "depth": camera depth logits} (bev.models.BEVNet)."""
        cams = tuple(batch.get(k) for k in CAMERA_KEYS)  # none with data.cameras=false (a LiDAR-only network)
        if self.net.lidar is not None:  # the LiDAR branch's input (bev.data.lidar.collate_points)
            if "points" not in batch:
                raise ValueError("the network has a LiDAR branch: the batches need points, set data.lidar.enabled=true")
            lidar = {"points": batch["points"], "batch_size": len(batch["num_points"])}
            if self.net.past_frames is None:
                return self.run_net(*cams, **lidar)
        else:
            lidar = {}
        if self.net.past_frames is None:
            return self.run_net(*cams)
        check_sequence_batch(batch, self.net)
        motion = self.net.heads["motion"] if "motion" in self.net.heads else None
        labels = batch if self.training and motion is not None and motion.probabilistic else None
        ego = batch["future_egomotion"]
        if self.past_cache is None or not self.training or not self.net.past_frames:
            return self.run_net(*cams, ego, past_no_grad=self.past_no_grad, future_labels=labels, **lidar)
        keys = frame_keys(batch, self.net.past_frames)
        past = self._cached_past(cams, keys)
        out = self.run_net(*cams, ego, future_labels=labels, past_features=past, return_features=True, **lidar)
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

    # --- losses, metrics, predictions: each task's (bev.tasks.<task>.task)

    def losses(self, out: Mapping[str, Any], batch: Mapping, depth: bool = False) -> tuple[torch.Tensor, dict]:
        """(weighted total, {term: unweighted value}) of the network's output on a batch: each task's loss (a task
        may weigh another's among its own terms: motion the present segmentation), summed with their fixed weights
        or learned ones (model.task_weights), and with depth the camera depth term."""
        terms: dict[str, torch.Tensor] = {}
        totals: dict[str, torch.Tensor] = {}
        for name, task in self.task_modules.items():
            totals[name], parts = task.loss(out, batch, terms)
            terms.update(parts)
        absorbed = {a for task in self.task_modules.values() for a in getattr(task, "absorbs", ()) if a in totals}
        totals = {k: v for k, v in totals.items() if k not in absorbed}
        if self.task_weights is not None:
            loss = self.task_weights({TERM_NAMES[k]: v for k, v in totals.items()})
        else:
            loss = sum(totals.values())
        if depth:
            terms["depth"] = self.depth_term(out["depth"], batch)
            loss = loss + self.depth_weight * terms["depth"]
        return loss, terms

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        out = self(batch)
        loss, terms = self.losses(out, batch, depth=bool(self.depth_weight))
        # Reading the loss waits for the device: on a GPU only at the logging interval (NaN weights stay NaN).
        if loss.device.type == "cpu" or self.global_step % max(1, self.trainer.log_every_n_steps) == 0:
            check_finite(loss, terms, self.global_step, self.current_epoch, batch_idx)
        B = len(batch["bev"])
        self.log_losses("train", loss, terms, B)
        if self.past_cache_hits is not None:
            self.log("train/past_cache_hits", self.past_cache_hits, on_step=False, on_epoch=True, batch_size=B)
        step = {"loss": loss}
        if "segmentation" in out and self.net.past_frames is None:
            step["logits"] = out["segmentation"].detach()  # what the BEV picture callback draws
        return step

    def _eval_step(self, batch: dict, stage: str) -> None:
        """One validation ("val") or test ("test") batch: its losses logged where it has every task's targets, each
        task's metric updated."""
        out = self(batch)
        if all(getattr(t, "has_targets", lambda b: True)(batch) for t in self.task_modules.values()):
            self.log_losses(stage, *self.losses(out, batch), len(batch["bev"]))
        for task in self.task_modules.values():
            task.update(out, batch, stage)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def _results(self, stage: str) -> dict[str, float]:
        """Every task's scores of the stage, keyed without the stage prefix (each task's metrics reset)."""
        dm = getattr(self.trainer, "datamodule", None)
        context = EvalContext(
            sanity_checking=bool(self.trainer.sanity_checking),
            dataset=getattr(dm, "val_set", None),
            output_dir=self.output_dir,
            device=self.device,
        )
        results: dict[str, float] = {}
        for task in self.task_modules.values():
            results.update(task.results(stage, context))
        return results

    def validation_results(self) -> dict[str, float]:
        """The split's scores of this validation, keyed without the val/ prefix (each task's metrics reset)."""
        return self._results("val")

    def on_test_epoch_end(self) -> None:
        self.log_dict({f"test/{k}": v for k, v in self._results("test").items()})

    def predict_step(self, batch: dict, batch_idx: int = 0, dataloader_idx: int = 0) -> dict[str, Any]:
        """Each task's predictions merged: "bev" (B, K, X, Y) probabilities (segmentation), "detections" (per
        sample {"boxes" (M, 9) BOX_FIELDS, "scores", "labels"}), the motion heads' "segmentation" probabilities,
        "centerness", "offset", "flow", "occupancy" (B, 200, 200, 16) uint8 class ids."""
        out = self(batch)
        pred: dict[str, Any] = {}
        for task in self.task_modules.values():
            pred.update(task.predict(out))
        return pred

    @property
    def output_dir(self) -> str | None:
        """Where bev-eval wants each task's files of the test (results_nusc.json, Occ3D predictions); None: none."""
        return self._output_dir

    @output_dir.setter
    def output_dir(self, path: str | None) -> None:
        self._output_dir = path
        if "occupancy" in self.tasks:  # the challenge's layout: <out>/predictions/<sample token>.npz
            self.task_modules.occupancy.prediction_dir = None if path is None else str(Path(path) / PREDICTIONS_DIR)
