"""Atomic checkpoint writes, the sweep summary and the epoch summary line (no training)."""

import csv
import json
from types import SimpleNamespace

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
    cb.on_validation_end(trainer, None)
    line = capsys.readouterr().out
    assert "train/loss 1.0000" in line and "val/loss 0.2500" in line and "val/iou_best -" in line
    assert cb.loss_n == 0 and float(cb.loss_sum) == 0.0
