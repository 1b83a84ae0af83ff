"""LightningModule: Lift-Splat-Shoot trained with BCE-with-logits on the BEV vehicle mask."""
from __future__ import annotations

import inspect
from typing import Any, Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from bev.geometry import Grid
from bev.metrics import BevIoU

CAMERA_KEYS = ("images", "intrinsics", "rots", "trans", "post_rots", "post_trans")


def schedule_length(sched: Any) -> int | None:
    """The number of steps a fixed-length LR schedule (OneCycleLR, CosineAnnealingLR) runs for, else None."""
    if isinstance(sched, torch.optim.lr_scheduler.OneCycleLR):
        return int(sched.total_steps)
    if isinstance(sched, torch.optim.lr_scheduler.CosineAnnealingLR):
        return int(sched.T_max)
    return None


def rescale_schedule(sched: Any, total_steps: int, pivot: int) -> bool:
    """Stretch or compress a fixed-length LR schedule to end at `total_steps`; False if it is not one.

    OneCycleLR: its phase ends (fixed at construction) move linearly about step `pivot`, so the
    schedule from `pivot` on is the old one resampled to the new length (pivot=-1 rescales the
    whole schedule; the current step as pivot leaves the steps already taken alone).
    CosineAnnealingLR: its recursive form continues from the current LR to eta_min at T_max.
    """
    if isinstance(sched, torch.optim.lr_scheduler.OneCycleLR):
        if total_steps - 1 <= pivot:
            raise ValueError(f"cannot end a schedule at step {total_steps} from step {pivot}: it needs at least one more step")
        scale = (total_steps - 1 - pivot) / (sched.total_steps - 1 - pivot)
        for phase in sched._schedule_phases:
            phase["end_step"] = pivot + (phase["end_step"] - pivot) * scale
        sched.total_steps = int(total_steps)
        return True
    if isinstance(sched, torch.optim.lr_scheduler.CosineAnnealingLR):
        sched.T_max = int(total_steps)
        return True
    return False


class BEVLitModule(L.LightningModule):
    """Wraps a BEV network with loss, optimiser, schedule and split-level IoU metrics.

    optimizer/scheduler are partials (Hydra `_partial_: true`). A scheduler whose signature
    takes `total_steps` (OneCycleLR) or `T_max` (CosineAnnealingLR) gets the trainer's
    estimated number of optimiser steps when the config leaves it out.
    """

    def __init__(
        self,
        net: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        scheduler_interval: str = "step",
        pos_weight: float = 2.13,
        threshold: float = 0.5,
        compile: bool = False,
    ):
        super().__init__()
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.scheduler_interval = scheduler_interval
        self.compile = compile
        self.register_buffer("pos_weight", torch.tensor([float(pos_weight)]), persistent=False)
        grid = getattr(net, "grid", None) or Grid()
        self.val_iou = BevIoU(grid, threshold)
        self.test_iou = BevIoU(grid, threshold)
        # Best val/iou so far; a buffer so it survives resume from a checkpoint.
        self.register_buffer("val_iou_best", torch.tensor(0.0))
        # The resolved run config (set by bev.train); stored in checkpoints so bev-eval can rebuild the model.
        self.run_config: dict | None = None
        # Names of the K output channels (set by bev.inference.load_model from the run config).
        self.class_names: list[str] | None = None

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
            self.net.compile()  # in place: state_dict keys stay those of the plain model

    def on_train_start(self) -> None:
        # Resuming with more epochs than the run started with: stretch a fixed-length schedule
        # restored from the checkpoint instead of failing (OneCycleLR) or restarting (cosine) past its end.
        steps = int(self.trainer.estimated_stepping_batches)
        for config in self.trainer.lr_scheduler_configs:
            length = schedule_length(config.scheduler)
            if config.interval == "step" and length is not None and length < steps:
                rescale_schedule(config.scheduler, steps, pivot=-1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.net(*(batch[k] for k in CAMERA_KEYS))

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits.float(), target.float(), pos_weight=self.pos_weight)

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        logits = self(batch)
        loss = self.loss(logits, batch["bev"])
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=logits.shape[0])
        return {"loss": loss, "logits": logits.detach()}

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        logits = self(batch)
        self.log("val/loss", self.loss(logits, batch["bev"]), on_epoch=True, sync_dist=True, batch_size=logits.shape[0])
        self.val_iou.update(logits, batch["bev"], batch.get("visibility"))

    def on_validation_epoch_end(self) -> None:
        results = self.val_iou.compute()
        self.val_iou.reset()
        if not self.trainer.sanity_checking:
            self.val_iou_best.fill_(max(float(self.val_iou_best), results["iou"]))
        self.log("val/iou", results.pop("iou"), prog_bar=True)
        self.log_dict({f"val/{k}": v for k, v in results.items()})
        self.log("val/iou_best", float(self.val_iou_best), prog_bar=True)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        logits = self(batch)
        self.log("test/loss", self.loss(logits, batch["bev"]), on_epoch=True, sync_dist=True, batch_size=logits.shape[0])
        self.test_iou.update(logits, batch["bev"], batch.get("visibility"))

    def predict_step(self, batch: dict, batch_idx: int = 0, dataloader_idx: int = 0) -> torch.Tensor:
        """Per-class probabilities (B, K, X, Y) float32 (the sigmoid of the logits)."""
        return self(batch).float().sigmoid()

    def on_test_epoch_end(self) -> None:
        results = self.test_iou.compute()
        self.test_iou.reset()
        self.log_dict({f"test/{k}": v for k, v in results.items()})

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(params=[p for p in self.parameters() if p.requires_grad])
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

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.run_config is not None:
            checkpoint["bev_config"] = self.run_config
