"""BEV PNG snapshots of the training batch."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only


class BevPngLogger(L.Callback):
    """Every `every_n_steps` optimiser steps, writes <dirpath>/step_NNNNNNN.png: the 6 cameras of the
    first training sample and its BEV prediction next to the target (bev.viz.save_sample_png)."""

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
        from bev.viz import save_sample_png

        self.dirpath.mkdir(parents=True, exist_ok=True)
        pred = outputs["logits"].float().sigmoid().cpu()
        sample = {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in batch.items()}
        save_sample_png(
            self.dirpath / f"step_{step:07d}.png",
            sample,
            pred=pred,
            class_names=getattr(pl_module, "class_names", None),
        )
