"""A training callback for resume tests: keeps what a run killed at each epoch boundary would leave."""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
import torch


class SnapshotLast(L.Callback):
    """Copies <dirpath>/last.ckpt to last_after_epoch_NNN.ckpt when the next epoch starts (the file a kill
    at that moment would leave), and saves the final weights to final_weights.pt when training ends
    (read from the module itself, not from any checkpoint)."""

    def __init__(self, dirpath: str):
        self.dirpath = Path(dirpath)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        last = self.dirpath / "last.ckpt"
        if trainer.current_epoch > 0 and last.is_file():
            shutil.copyfile(last, self.dirpath / f"last_after_epoch_{trainer.current_epoch - 1:03d}.ckpt")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"global_step": trainer.global_step, "state_dict": pl_module.state_dict()},
            self.dirpath / "final_weights.pt",
        )


class StopMidEpoch(L.Callback):
    """Stops training at `step` with a validation, as bev.callbacks.TimeBudget ends a shortened run."""

    def __init__(self, step: int):
        self.step = int(step)

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True
            trainer.check_val_every_n_epoch = 1
