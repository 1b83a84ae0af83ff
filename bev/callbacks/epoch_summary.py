"""One printed line per validation, for logs without a progress bar."""

from __future__ import annotations

import time

import lightning as L
from lightning.pytorch.utilities import rank_zero_only


class EpochSummary(L.Callback):
    """One line per validation: epoch, step, mean train loss since the last line, val/loss, val/iou where the
    model logs it, the experiment's headline metric and its best (bev.tasks), elapsed time and s/step (for logs
    without a progress bar)."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.loss_sum, self.loss_n = 0.0, 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = time.time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if isinstance(outputs, dict) and "loss" in outputs:
            # Summed where the loss is: float() here would wait for the GPU after every step.
            self.loss_sum = self.loss_sum + outputs["loss"].detach().float()
            self.loss_n += 1

    @rank_zero_only
    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or self.start is None:
            return
        m = trainer.callback_metrics

        def fmt(key: str) -> str:
            return f"{float(m[key]):.4f}" if key in m else "-"

        train_loss = f"{float(self.loss_sum) / self.loss_n:.4f}" if self.loss_n else "-"
        head = getattr(pl_module, "headline", "val/iou")
        scores = f"val/iou {fmt('val/iou')}  " if head != "val/iou" and "val/iou" in m else ""
        scores += f"{head} {fmt(head)}  {head}_best {fmt(head + '_best')}"
        self.loss_sum, self.loss_n = 0.0, 0
        elapsed = time.time() - self.start
        print(
            f"epoch {trainer.current_epoch:3d} step {trainer.global_step:6d}  train/loss {train_loss}  "
            f"val/loss {fmt('val/loss')}  {scores}  "
            f"{elapsed / 60:5.1f} min ({elapsed / max(trainer.global_step, 1):.2f} s/step incl. validation)",
            flush=True,
        )
