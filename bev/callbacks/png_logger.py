"""BEV PNG snapshots of the training batch, written as files and logged to the run's image loggers."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_only

IMAGE_TAG = "train/bev"


class BevPngLogger(L.Callback):
    """Every `every_n_steps` optimiser steps (and at the first), writes <dirpath>/step_NNNNNNN.png: the
    cameras of the first training sample and its BEV prediction next to the target (bev.viz.render_sample),
    and logs the same picture to every configured logger that takes images (TensorBoard's add_image,
    W&B's log_image) under IMAGE_TAG."""

    def __init__(self, dirpath: str, every_n_steps: int = 500):
        self.dirpath = Path(dirpath)
        self.every_n_steps = int(every_n_steps)

    @rank_zero_only
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.every_n_steps <= 0 or (step % self.every_n_steps and step != 1):  # the first step, then every N
            return
        if not isinstance(outputs, dict) or "logits" not in outputs:
            return
        from bev.viz import batch_sample, render_sample, save_png

        pred = outputs["logits"][:1].float().sigmoid().cpu()
        sample = {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in batch_sample(batch, 0).items()}
        img = render_sample(sample, pred=pred, class_names=getattr(pl_module, "class_names", None))
        self.dirpath.mkdir(parents=True, exist_ok=True)
        save_png(self.dirpath / f"step_{step:07d}.png", img)
        log_image(trainer.loggers, IMAGE_TAG, img, step)


def log_image(loggers, tag: str, img: np.ndarray, step: int) -> None:
    """An (H, W, 3) uint8 picture to each logger that takes images; the others (CSV) are skipped."""
    for logger in loggers:
        experiment = getattr(logger, "experiment", None)
        if hasattr(logger, "log_image"):  # W&B (and loggers with the same method)
            logger.log_image(key=tag, images=[img], step=step)
        elif hasattr(experiment, "add_image"):  # TensorBoard's SummaryWriter
            experiment.add_image(tag, img, step, dataformats="HWC")
