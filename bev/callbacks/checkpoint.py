"""Checkpoint writing: atomic saves, and last.ckpt after every epoch."""
from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from bev.utils.io import atomic_open, explain_disk_full


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save through bev.utils.io.atomic_open (same-directory temp file, fsync, os.replace).

    Lightning's own save goes through an fsspec transaction whose temporary file lives in the
    system temp dir; when that is another filesystem the final move is a copy, so a crash can
    leave a truncated checkpoint. A same-directory rename is atomic on POSIX filesystems.
    A full disk ends in one clear DiskFullError, not torch's "unexpected pos".
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        # A full disk gives one DiskFullError naming the path and the free space. Inside atomic_open it is
        # judged while the partial file still takes its space; outside, for the flush, fsync and rename.
        with explain_disk_full(path), atomic_open(path, "wb") as f, explain_disk_full(path):
            torch.save(checkpoint, f)


class ModelCheckpoint(L.pytorch.callbacks.ModelCheckpoint):
    """Lightning's, with `save_last` writing last.ckpt at every epoch end (or validation) it checkpoints at.

    Lightning (2.6) writes last.ckpt only when a top-k checkpoint is saved at the same step: with
    `monitor` set, a run resumed from last.ckpt lost every epoch since its best one. The class keeps
    Lightning's name, so the checkpoints' callback state keys stay the same."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_missed(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_missed(trainer)

    def _save_last_if_missed(self, trainer: L.Trainer) -> None:
        """last.ckpt now, where Lightning checkpointed this step's epoch but wrote no last.ckpt."""
        if (self.save_last and self._last_global_step_saved != trainer.global_step
                and not self._should_skip_saving_checkpoint(trainer)
                and (trainer.current_epoch + 1) % max(self._every_n_epochs, 1) == 0):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
