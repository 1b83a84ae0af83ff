"""Atomic checkpoint writes, the sweep summary and the epoch summary line (no training)."""

import csv
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bev.callbacks import AtomicCheckpointIO, EpochSummary, summarize_sweep


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, path)
    assert torch.load(path, weights_only=True)["state_dict"]["w"].sum() == 3

    def crash(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}}, path)
    # The previous checkpoint is intact and no temporary file is left behind.
    assert torch.load(path, weights_only=True)["state_dict"]["w"].sum() == 3
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]


def write_run(d, num, iou, status="ok"):
    run = d / str(num)
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(f"- model.optimizer.lr={num}\n")
    if iou is not None:
        rec = {
            "status": status,
            "metrics": {"val/iou_best": iou, "val/iou": iou - 0.01},
            "overrides": [f"model.optimizer.lr={num}"],
        }
        (run / "metrics.json").write_text(json.dumps(rec))


def test_sweep_summary_sorts_by_best_iou_and_lists_failures(tmp_path):
    write_run(tmp_path, 0, 0.2)
    write_run(tmp_path, 1, 0.4)
    write_run(tmp_path, 2, None)  # killed before writing metrics
    write_run(tmp_path, 3, 0.3)
    rows = summarize_sweep(tmp_path)
    assert [r["run"] for r in rows] == ["1", "3", "0", "2"]
    assert rows[-1]["status"] == "missing" and rows[-1]["overrides"] == "model.optimizer.lr=2"
    table = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert [float(r["val/iou_best"]) for r in table[:3]] == [0.4, 0.3, 0.2]
    md = (tmp_path / "summary.md").read_text()
    assert md.index("| 1 |") < md.index("| 3 |") < md.index("| 0 |") and "missing" in md


def test_epoch_summary_sums_the_train_loss_without_reading_it_every_step(capsys):
    cb = EpochSummary()
    cb.on_train_start(None, None)
    for loss in (0.5, 1.5):
        cb.on_train_batch_end(None, None, {"loss": torch.tensor(loss)}, None, 0)
    assert torch.is_tensor(cb.loss_sum)  # a float() per step would wait for the GPU after every step
    trainer = SimpleNamespace(
        sanity_checking=False,
        current_epoch=0,
        global_step=2,
        callback_metrics={"val/loss": torch.tensor(0.25), "val/iou": torch.tensor(0.5)},
    )
    cb.on_validation_end(trainer, SimpleNamespace(headline="val/iou"))
    line = capsys.readouterr().out
    assert "train/loss 1.0000" in line and "val/loss 0.2500" in line and "val/iou 0.5000  val/iou_best -" in line
    assert cb.loss_n == 0 and float(cb.loss_sum) == 0.0
    # A run whose headline is another metric (detection, occupancy) shows it and its best, beside val/iou.
    trainer.callback_metrics.update({"val/NDS": torch.tensor(0.3125), "val/NDS_best": torch.tensor(0.375)})
    cb.on_validation_end(trainer, SimpleNamespace(headline="val/NDS"))
    line = capsys.readouterr().out
    assert "val/iou 0.5000  val/NDS 0.3125  val/NDS_best 0.3750" in line and "val/iou_best" not in line


def test_bev_png_logger_writes_the_png_and_logs_it_to_image_loggers(tmp_path):

    from bev.callbacks.png_logger import IMAGE_TAG, BevPngLogger

    calls = []
    tensorboard = SimpleNamespace(experiment=SimpleNamespace(add_image=lambda *a, **k: calls.append(("tb", a, k))))
    wandb = SimpleNamespace(log_image=lambda **k: calls.append(("wandb", (), k)))
    csv_logger = SimpleNamespace(experiment=SimpleNamespace())  # takes no images: skipped
    trainer = SimpleNamespace(global_step=1, loggers=[tensorboard, wandb, csv_logger])
    batch = {"images": torch.zeros(2, 6, 3, 16, 44), "bev": torch.zeros(2, 1, 20, 20), "sample_token": ["a", "b"]}
    outputs = {"logits": torch.zeros(2, 1, 20, 20)}
    BevPngLogger(str(tmp_path), every_n_steps=5).on_train_batch_end(trainer, None, outputs, batch, 0)
    png = tmp_path / "step_0000001.png"
    assert png.is_file()
    (kind, args, kw), (kind2, _, kw2) = calls
    assert kind == "tb" and args[0] == IMAGE_TAG and args[2] == 1 and kw == {"dataformats": "HWC"}
    img = args[1]
    assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3
    assert kind2 == "wandb" and kw2["key"] == IMAGE_TAG and kw2["step"] == 1 and kw2["images"][0] is img
    trainer.global_step = 2  # not a logging step
    BevPngLogger(str(tmp_path), every_n_steps=5).on_train_batch_end(trainer, None, outputs, batch, 0)
    assert len(calls) == 2 and not (tmp_path / "step_0000002.png").exists()
