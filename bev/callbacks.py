"""Training callbacks and plugins: atomic checkpoint writes, BEV PNG snapshots, sweep summaries."""
from __future__ import annotations

import csv
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_only

from bev.utils.io import atomic_open

log = logging.getLogger(__name__)

RUN_METRICS_FILE = "metrics.json"  # written by bev.train in every run directory


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save through bev.utils.io.atomic_open (same-directory temp file, fsync, os.replace).

    Lightning's own save goes through an fsspec transaction whose temporary file lives in the
    system temp dir; when that is another filesystem the final move is a copy, so a crash can
    leave a truncated checkpoint. A same-directory rename is atomic on POSIX filesystems.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        with atomic_open(path, "wb") as f:
            torch.save(checkpoint, f)


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
        save_sample_png(self.dirpath / f"step_{step:07d}.png", sample, pred=pred,
                        class_names=getattr(pl_module, "class_names", None))


class EpochSummary(L.Callback):
    """One line per validation: epoch, step, mean train loss since the last line, val/loss, val/iou,
    best, elapsed time and s/step (for logs without a progress bar)."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.loss_sum, self.loss_n = 0.0, 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = time.time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if isinstance(outputs, dict) and "loss" in outputs:
            self.loss_sum += float(outputs["loss"])
            self.loss_n += 1

    @rank_zero_only
    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or self.start is None:
            return
        m = trainer.callback_metrics

        def fmt(key: str) -> str:
            return f"{float(m[key]):.4f}" if key in m else "-"

        train_loss = f"{self.loss_sum / self.loss_n:.4f}" if self.loss_n else "-"
        self.loss_sum, self.loss_n = 0.0, 0
        elapsed = time.time() - self.start
        print(f"epoch {trainer.current_epoch:3d} step {trainer.global_step:6d}  train/loss {train_loss}  "
              f"val/loss {fmt('val/loss')}  val/iou {fmt('val/iou')}  val/iou_best {fmt('val/iou_best')}  "
              f"{elapsed / 60:5.1f} min ({elapsed / max(trainer.global_step, 1):.2f} s/step incl. validation)", flush=True)


# ----------------------------------------------------------------------------- sweep summary
def _scalar(v: Any) -> Any:
    return None if v is None or (isinstance(v, float) and v != v) else v


def summarize_sweep(sweep_dir: str | os.PathLike, sort_key: str = "val/iou_best") -> list[dict[str, Any]]:
    """Collect <sweep_dir>/*/metrics.json into summary.csv and summary.md, best `sort_key` first.

    Runs without a metrics file (crashed, killed) are listed with status "missing".
    Returns the rows.
    """
    sweep_dir = Path(sweep_dir)
    rows = []
    for run in sorted((p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.name):
        f = run / RUN_METRICS_FILE
        if not f.is_file():
            if (run / ".hydra").is_dir():
                rows.append({"run": run.name, "status": "missing", "overrides": _overrides(run)})
            continue
        rec = json.loads(f.read_text())
        row = {"run": run.name, "status": rec.get("status", "ok"), "overrides": " ".join(rec.get("overrides", []))}
        row.update({k: _scalar(v) for k, v in rec.get("metrics", {}).items()})
        row["best_ckpt"] = rec.get("best_ckpt")
        rows.append(row)
    rows.sort(key=lambda r: (r.get(sort_key) is None, -(r.get(sort_key) or 0.0)))
    metric_cols = sorted({k for r in rows for k in r if "/" in k}, key=lambda k: (k != sort_key, k != "val/iou", k))
    cols = ["run", "overrides", *metric_cols, "status", "best_ckpt"]
    with open(sweep_dir / "summary.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    short = ["run", "overrides", *[c for c in metric_cols if c.startswith("val/")], "status"]

    def cell(v: Any) -> str:
        return f"{v:.4f}" if isinstance(v, float) else ("" if v is None else str(v).replace("|", "\\|"))

    md = [f"# Sweep summary: {sweep_dir}", "", f"{len(rows)} runs, sorted by {sort_key} (best first).", ""]
    md += ["| " + " | ".join(short) + " |", "|" + "---|" * len(short)]
    md += ["| " + " | ".join(cell(r.get(c)) for c in short) + " |" for r in rows]
    (sweep_dir / "summary.md").write_text("\n".join(md) + "\n")
    return rows


def _overrides(run: Path) -> str:
    f = run / ".hydra" / "overrides.yaml"
    if not f.is_file():
        return ""
    from omegaconf import OmegaConf

    return " ".join(OmegaConf.load(f))


try:  # Hydra is a dependency; the guard only keeps this module importable in odd environments
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover
    _HydraCallback = object


class SweepSummary(_HydraCallback):
    """Hydra callback: at the end of `bev-train -m ...`, writes summary.csv / summary.md in the sweep dir."""

    def __init__(self, sort_key: str = "val/iou_best"):
        self.sort_key = sort_key

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        rows = summarize_sweep(sweep_dir, self.sort_key)
        print(f"Sweep summary ({len(rows)} runs): {sweep_dir / 'summary.md'} and {sweep_dir / 'summary.csv'}")
        print((sweep_dir / "summary.md").read_text())
