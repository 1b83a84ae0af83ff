"""End to end through the real entry points (hydra.main), on the tiny synthetic fixture:
fast_dev_run, train -> eval agreement, resume, sweep summary, DDP on CPU, bad-input messages."""

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.cli import TINY, assert_one_paragraph, eval_cli, read_csv_metric, train_cli

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])  # 16-mixed is GPU-only (bf16 on CPU)
def test_fast_dev_run(precision, synthetic_root, tmp_path, monkeypatch):
    args = [
        *TINY,
        "debug=fdr",
        f"trainer.precision={precision}",
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={tmp_path}",
    ]
    assert train_cli(args, monkeypatch) == 0
    rec = json.loads((tmp_path / "metrics.json").read_text())
    assert rec["status"] == "ok" and rec["global_step"] == 1
    assert torch.isfinite(torch.tensor(rec["metrics"]["train/loss_step"]))


def test_a_fused_optimizer_is_clipped_under_bf16_mixed(synthetic_root, tmp_path, monkeypatch):
    # Lightning's mixed-precision plugin refuses to clip for fused optimisers (GPUs get fused Adam by default).
    clipped, clip = [], torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm, *args, **kwargs):
        clipped.append(max_norm)
        return clip(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    args = [
        *TINY,
        "debug=fdr",
        "trainer.precision=bf16-mixed",
        "+model.optimizer.fused=true",
        "trainer.gradient_clip_val=0.5",
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={tmp_path}",
    ]
    assert train_cli(args, monkeypatch) == 0
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == "ok" and clipped == [0.5]


def test_training_sets_intra_op_threads_and_restores_them(synthetic_root, tmp_path, monkeypatch, capsys):
    from lightning import Trainer

    import bev.utils.threads as threads

    seen, fit = [], Trainer.fit
    monkeypatch.setattr(
        Trainer, "fit", lambda self, *a, **k: (seen.append(torch.get_num_threads()), fit(self, *a, **k))[1]
    )
    before = torch.get_num_threads()
    cpus = before + 2  # so that the expected count (cpus less one worker) differs from torch's
    monkeypatch.setattr(threads, "available_cpus", lambda: cpus)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    args = [*TINY, "debug=fdr", "data.num_workers=1", f"data.dataroot={synthetic_root}", f"hydra.run.dir={tmp_path}"]
    assert train_cli(args, monkeypatch) == 0
    assert seen == [cpus - 1]  # the CPUs less the loader worker, during fit only
    assert torch.get_num_threads() == before
    assert f"threads: {cpus - 1} ({cpus} CPUs less 1 loader worker(s))" in capsys.readouterr().out


@pytest.fixture
def two_of_four_cpus_busy(monkeypatch) -> list[int]:
    """Four CPUs, two kept busy by other processes; returns the thread counts ThreadsFollowLoad sets."""
    import bev.utils.threads as threads
    from bev.callbacks import ThreadsFollowLoad

    monkeypatch.setattr(threads, "available_cpus", lambda: 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads.OtherLoad, "cpus_busy", lambda self: 2.0)
    seen, follow = [], ThreadsFollowLoad._follow
    monkeypatch.setattr(
        ThreadsFollowLoad, "_follow", lambda self, when: (follow(self, when), seen.append(torch.get_num_threads()))
    )
    return seen


def test_training_threads_give_way_to_other_processes(
    synthetic_root, tmp_path, monkeypatch, capsys, two_of_four_cpus_busy
):
    seen = two_of_four_cpus_busy
    before = torch.get_num_threads()
    args = [*TINY, "debug=fdr", "data.num_workers=0", f"data.dataroot={synthetic_root}", f"hydra.run.dir={tmp_path}"]
    assert train_cli(args, monkeypatch) == 0
    assert seen == [2] and torch.get_num_threads() == before
    assert "threads: 2 (other processes kept 2.0 of the CPUs busy at the start)" in capsys.readouterr().out


def test_run_writes_checkpoints_logs_and_pictures(tiny_run):
    ck = tiny_run / "checkpoints"
    assert (ck / "last.ckpt").is_file() and (ck / "epoch_000.ckpt").is_file()
    assert not list(ck.glob("*.tmp"))  # atomic writes leave no temporaries behind
    ckpt = torch.load(ck / "last.ckpt", weights_only=True)
    assert ckpt["bev_config"]["grid"]["xbound"] == [-24.0, 24.0, 2.0]
    assert list(tiny_run.glob("pngs/step_*.png"))
    assert read_csv_metric(tiny_run, "val/iou") and read_csv_metric(tiny_run, "train/loss_step")
    rec = json.loads((tiny_run / "metrics.json").read_text())
    assert {"val/iou", "val/iou_best", "val/iou_vis", "val/iou_0_20m"} <= set(rec["metrics"])


def test_eval_reproduces_the_logged_validation(tiny_run, synthetic_root, tmp_path, monkeypatch, capsys):
    out = tmp_path / "eval"
    assert (
        eval_cli([f"ckpt_path={tiny_run}", f"data.dataroot={synthetic_root}", f"hydra.run.dir={out}"], monkeypatch) == 0
    )
    rec = json.loads((out / "metrics.json").read_text())
    run = json.loads((tiny_run / "metrics.json").read_text())["metrics"]
    assert rec["checkpoint"].endswith("epoch_000.ckpt")  # a run directory resolves to its best checkpoint
    assert abs(rec["metrics"]["iou"] - run["val/iou"]) <= 0.005
    assert abs(rec["metrics"]["iou"] - rec["logged_val_iou"]) <= 0.005
    # The loss is continuous, so it also catches a different crop or model that happens to give the same IoU.
    assert rec["metrics"]["loss"] == pytest.approx(run["val/loss"], rel=1e-4, abs=1e-5)
    assert len(list(out.glob("sample_*.png"))) == 3  # the fixture's val split has 3 samples
    printed = capsys.readouterr().out
    assert "vehicle" in printed and "35-50m" in printed and "IoU (vis>1)" in printed  # one row per class


def test_resume_from_last_continues_the_step_count(tiny_run, synthetic_root, tmp_path, monkeypatch):
    first = json.loads((tiny_run / "metrics.json").read_text())["global_step"]
    args = [
        *TINY,
        "trainer.max_epochs=2",
        f"ckpt_path={tiny_run}/checkpoints/last.ckpt",
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={tmp_path}",
    ]
    assert train_cli(args, monkeypatch) == 0
    rec = json.loads((tmp_path / "metrics.json").read_text())
    assert first > 0 and rec["global_step"] == 2 * first and rec["epochs"] == 2


def test_last_checkpoint_follows_every_epoch_not_only_the_best(synthetic_root, tmp_path, monkeypatch):
    # val/iou_best never falls, so under mode=min only the first epoch is a top-k checkpoint.
    args = [
        *TINY,
        "data.batch_size=1",
        "trainer.max_epochs=3",
        "callbacks.model_checkpoint.monitor=val/iou_best",
        "callbacks.model_checkpoint.mode=min",
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={tmp_path}",
    ]
    assert train_cli(args, monkeypatch) == 0
    best = sorted(p.name for p in (tmp_path / "checkpoints").glob("epoch_*.ckpt"))
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert best == ["epoch_000.ckpt"] and last["global_step"] == 9 and last["epoch"] == 2


def test_sweep_writes_a_sorted_summary(synthetic_root, tmp_path, monkeypatch):
    args = [
        "-m",
        *TINY,
        "model.optimizer.lr=1e-3,3e-3",
        "callbacks.bev_png.every_n_steps=0",
        f"data.dataroot={synthetic_root}",
        f"hydra.sweep.dir={tmp_path}",
    ]
    assert train_cli(args, monkeypatch) == 0
    rows = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert len(rows) == 2 and {float(r["overrides"].split("lr=")[1].split()[0]) for r in rows} == {1e-3, 3e-3}
    ious = [float(r["val/iou_best"]) for r in rows]
    assert ious == sorted(ious, reverse=True)
    assert "| run |" in (tmp_path / "summary.md").read_text()


def test_ddp_on_two_cpu_processes(synthetic_root, tmp_path):
    args = [
        *TINY,
        "trainer=ddp_cpu",
        "trainer.max_epochs=2",
        "callbacks.bev_png.every_n_steps=0",
        "malloc_tuning=false",
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={tmp_path}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bev.train", *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((tmp_path / "metrics.json").read_text())
    # 3 train samples, 2 processes, batch 2: one step per epoch on each process.
    assert rec["global_step"] == 2 and rec["status"] == "ok"
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


# ----------------------------------------------------------------------------- bad input
def test_unknown_config_option(tmp_path, monkeypatch, capsys):
    assert train_cli(["experiment=synthetic_cpu", "trainer.max_epoch=3", f"hydra.run.dir={tmp_path}"], monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "trainer.max_epoch")


def test_dataroot_without_data(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert train_cli([*TINY, f"data.dataroot={empty}", f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-train: error:", str(empty))


def test_missing_checkpoint(tmp_path, monkeypatch, capsys):
    assert eval_cli([f"ckpt_path={tmp_path}/nope.ckpt", f"hydra.run.dir={tmp_path}"], monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-eval: error:", "does not exist")


def test_corrupt_checkpoint(tiny_run, tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes((tiny_run / "checkpoints" / "last.ckpt").read_bytes()[:5000])  # a truncated write
    assert eval_cli([f"ckpt_path={bad}", f"hydra.run.dir={tmp_path}"], monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "corrupt")


def test_checkpoint_from_an_incompatible_model(tiny_run, synthetic_root, tmp_path, monkeypatch, capsys):
    args = [
        *TINY,
        "model.net.decoder.widths=[8,16,32]",
        f"ckpt_path={tiny_run}/checkpoints/last.ckpt",
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={tmp_path}",
    ]
    assert train_cli(args, monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "different model config", "model.net.decoder.widths")


def test_eval_threads_give_way_to_other_processes(
    tiny_run, synthetic_root, tmp_path, monkeypatch, capsys, two_of_four_cpus_busy
):
    seen = two_of_four_cpus_busy
    before = torch.get_num_threads()
    args = [
        f"ckpt_path={tiny_run}",
        f"data.dataroot={synthetic_root}",
        "data.num_workers=0",
        "threads=auto",
        f"hydra.run.dir={tmp_path}",
    ]
    assert eval_cli(args, monkeypatch) == 0
    assert seen == [2] and torch.get_num_threads() == before  # one probe before the pass; restored after
    assert "threads: 2 (other processes kept 2.0 of the CPUs busy at the start)" in capsys.readouterr().out


def test_eval_model_override_applies_to_the_checkpoint_config(tiny_run, synthetic_root, tmp_path, monkeypatch, capsys):
    base = [f"ckpt_path={tiny_run}", f"data.dataroot={synthetic_root}", "num_pngs=0"]
    # A setting that does not change the weights is applied on top of the checkpoint's model config...
    assert eval_cli([*base, "+model.segmentation.threshold=0.3", f"hydra.run.dir={tmp_path / 'a'}"], monkeypatch) == 0
    assert json.loads((tmp_path / "a" / "metrics.json").read_text())["threshold"] == 0.3
    # ...the place it had before model.segmentation is named.
    assert eval_cli([*base, "+model.threshold=0.3", f"hydra.run.dir={tmp_path / 'c'}"], monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-eval: error:", "+model.segmentation.threshold")
    # ...one that does is refused, naming the key.
    assert (
        eval_cli([*base, "+model.net.camera.context_channels=16", f"hydra.run.dir={tmp_path / 'b'}"], monkeypatch) == 1
    )
    assert_one_paragraph(capsys.readouterr().err, "bev-eval: error:", "model.net.camera.context_channels: 8 -> 16")


def test_resume_in_the_run_dir_continues_its_metrics_log(tiny_run, synthetic_root, tmp_path, monkeypatch):
    from bev.utils.metrics_log import read_metrics_log

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    (log,) = run.glob("csv/version_*/metrics.csv")
    first = read_metrics_log(run)["train/loss_step"]
    # A run killed after logging a step past its last checkpoint: the resumed run logs that step again.
    with open(log, newline="") as f:
        header = next(csv.reader(f))
    redo = max(first[0]) + 1
    with open(log, "a", newline="") as f:
        csv.DictWriter(f, header).writerow({"step": redo, "epoch": 1, "train/loss_step": 999.0})
    args = [
        *TINY,
        "trainer.max_epochs=2",
        "callbacks.bev_png.every_n_steps=0",
        f"ckpt_path={run}/checkpoints/last.ckpt",
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={run}",
    ]
    assert train_cli(args, monkeypatch) == 0
    assert list(run.glob("csv/version_*/metrics.csv")) == [log]  # no new version: the same log goes on
    steps, values = read_metrics_log(run)["train/loss_step"]
    assert steps == sorted(set(steps)) and len(steps) == 2 * len(first[0])  # both epochs, one value per step
    assert steps[: len(first[0])] == first[0] and values[: len(first[1])] == first[1]  # the first epoch is kept
    assert redo in steps and 999.0 not in values  # the re-logged step keeps the resumed run's record
    assert len(read_metrics_log(run)["val/iou"][0]) == 2


def write_log(run: Path, version: int, rows: list[dict]) -> None:
    d = run / "csv" / f"version_{version}"
    d.mkdir(parents=True)
    with open(d / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["epoch", "step", "train/loss_step", "val/iou"])
        w.writeheader()
        w.writerows(rows)


def test_metrics_log_merges_versions_in_numeric_order(tmp_path):
    from bev.utils.metrics_log import read_metrics_log

    write_log(tmp_path, 2, [{"step": s, "train/loss_step": 1.0} for s in range(4)] + [{"step": 3, "val/iou": 0.1}])
    write_log(tmp_path, 10, [{"step": s, "train/loss_step": 2.0} for s in range(3, 6)])  # resumed after step 2
    loss = read_metrics_log(tmp_path)["train/loss_step"]
    assert loss == ([0, 1, 2, 3, 4, 5], [1.0, 1.0, 1.0, 2.0, 2.0, 2.0])
    assert read_metrics_log(tmp_path)["val/iou"] == ([3], [0.1])
    write_log(tmp_path, 11, [{"step": s, "train/loss_step": 3.0} for s in range(2)])  # a new run from scratch
    assert read_metrics_log(tmp_path)["train/loss_step"] == ([0, 1], [3.0, 3.0])
