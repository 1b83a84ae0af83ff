"""Occupancy experiments compose with their published settings and train two steps on the synthetic set; bev-eval on
an occupancy checkpoint prints and writes Occ3D's mIoU and the predictions in the challenge's format."""

import json

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from test_lidar_experiments import SMALL_LIDAR
from test_occupancy_data import occ_root  # noqa: F401 (the synthetic set with Occ3D labels)

from bev.train import CONFIG_DIR
from helpers.cli import eval_cli, train_cli

EXPERIMENTS = ["synthetic_occ_cpu", "synthetic_occ_fusion_cpu", "bevdet_occ_nuscenes", "flashocc_nuscenes"]
# The fused experiment with BEVDet-Occ's 3D decoder: the fused map read as (C, Z) voxels
VOXEL3D = ["model=occ_small", "grid.zbound=[-1,5.4,1.6]"]
# Only what a CPU test must change: the synthetic set, a small input, no ImageNet download, two steps.
SMALL = [
    "data.version=v1.0-mini",
    "data.train_split=mini_train",
    "data.val_split=mini_val",
    "data.final_dim=[64,176]",
    "data.batch_size=1",
    "data.num_workers=0",
    "data.pin_memory=false",
    "model.net.camera.weights=null",
    "trainer=cpu",
    "+trainer.max_steps=2",
    "trainer.max_epochs=1",
    "+trainer.limit_val_batches=1",
    "++trainer.val_check_interval=2",
    "trainer.check_val_every_n_epoch=1",
    "trainer.enable_progress_bar=false",
    "callbacks.bev_png.every_n_steps=0",
    "callbacks.time_budget.budget=null",
]
# The published heads at 1.6 m lift cells (the logits are still 200 x 200 x 16; a 3D encoder at 0.4 m costs
# minutes per step on a CPU), behind a ResNet-18 (ResNet-50's checkpoints take most of a run's time here).
COARSE = ["grid.xbound=[-40,40,1.6]", "grid.ybound=[-40,40,1.6]", "grid.dbound=[2,46,4]", "data.final_dim=[32,96]"]
NUSCENES_SMALL = [*COARSE, "model.net.camera.backbone=resnet18"]


def _compose(experiment, *overrides):
    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        return compose("train", overrides=[f"experiment={experiment}", *overrides])


def test_the_published_settings_are_in_the_experiments():
    bevdet, flash = _compose("bevdet_occ_nuscenes"), _compose("flashocc_nuscenes")
    for cfg in (bevdet, flash):
        assert cfg.data.occupancy and list(cfg.data.final_dim) == [256, 704] and list(cfg.grid.dbound) == [1, 45, 0.5]
        assert (
            list(cfg.grid.xbound) == [-40, 40, 0.4]
            and cfg.data.bev_aug.flip_x == 0.5
            and cfg.data.bev_aug.rot_lim == [0, 0]
        )
        assert (
            cfg.model.optimizer.lr == 1e-4 and cfg.model.optimizer.weight_decay == 1e-2 and cfg.trainer.max_epochs == 24
        )
        assert cfg.model.occupancy.loss.visible_only and cfg.model.net.camera.backbone == "resnet50"
        assert cfg.callbacks.model_checkpoint.monitor == "val/occ_miou"
    occ = bevdet.model.net.decoder
    assert occ.kind == "voxel3d" and list(occ.widths) == [32, 64, 128] and list(occ.blocks) == [1, 2, 4]
    assert bevdet.model.net.heads.occupancy.kind == "voxel3d"
    assert bevdet.model.net.camera.context_channels == 32 and list(bevdet.grid.zbound) == [-1, 5.4, 0.4]
    occ = flash.model.net.heads.occupancy
    assert occ.kind == "channel_to_height" and occ.channels == 256 and flash.model.net.decoder.kind == "bev"
    assert flash.model.net.camera.context_channels == 64 and list(flash.grid.zbound) == [-1, 5.4, 6.4]
    assert list(flash.model.net.decoder.widths) == [128, 256, 512]


@pytest.mark.e2e
@pytest.mark.parametrize(
    "experiment, decoder", [*((e, None) for e in EXPERIMENTS), ("synthetic_occ_fusion_cpu", "voxel3d")]
)
def test_the_experiment_trains_two_steps(experiment, decoder, occ_root, tmp_path, monkeypatch, capsys):  # noqa: F811
    synthetic = experiment.startswith("synthetic_")
    extra = COARSE if synthetic else NUSCENES_SMALL
    extra = extra + (["grid.zbound=[-1,5.4,1.6]"] if experiment == "bevdet_occ_nuscenes" or synthetic else [])
    fused = experiment == "synthetic_occ_fusion_cpu"  # cameras + LiDAR: the occupancy head on the fused BEV
    extra = extra + ([*SMALL_LIDAR, *(VOXEL3D if decoder else ["grid.zbound=[-1,5.4,6.4]"])] if fused else [])
    args = [f"experiment={experiment}", *SMALL, *extra, f"data.dataroot={occ_root}", f"hydra.run.dir={tmp_path}"]
    assert train_cli(args, monkeypatch) == 0, capsys.readouterr().err[-3000:]
    rec = json.loads((tmp_path / "metrics.json").read_text())
    m = rec["metrics"]
    assert rec["global_step"] == 2 and 0 <= m["val/occ_miou"] <= 1 and "val/occ_iou_car" in m
    assert m["train/occ_loss_step"] > 0 and "val/occ_miou_0-20m" in m and "val/iou_best" not in m
    assert f"val/occ_miou_best={m['val/occ_miou_best']:.4f}" in capsys.readouterr().out  # the headline, named
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert (
        any(k.startswith("net.lidar.") for k in state) == fused
        and any(k.startswith("net.fuser.") for k in state) == fused
    )
    assert any(k.startswith("net.decoder.stages.") for k in state) == (decoder == "voxel3d" or "bevdet" in experiment)


@pytest.mark.e2e
def test_bev_eval_scores_and_writes_challenge_predictions(occ_root, tmp_path, monkeypatch, capsys):  # noqa: F811
    from bev.tasks.occupancy.io import labels_path, read_prediction

    run = tmp_path / "run"
    small = [*SMALL, "grid.xbound=[-40,40,1.6]", "grid.ybound=[-40,40,1.6]", "grid.zbound=[-1,5.4,1.6]"]
    args = ["experiment=synthetic_occ_cpu", *small, "model=occ_small"]
    assert train_cli([*args, f"data.dataroot={occ_root}", f"hydra.run.dir={run}"], monkeypatch) == 0
    out = tmp_path / "eval"
    eval_args = [f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"data.dataroot={occ_root}", f"hydra.run.dir={out}"]
    capsys.readouterr()
    assert eval_cli(eval_args, monkeypatch) == 0, capsys.readouterr().err[-3000:]
    printed = capsys.readouterr().out
    assert "Occ3D mIoU (x 100), voxels of mask_camera" in printed and "mIoU over classes 0-16" in printed
    rec = json.loads((out / "metrics.json").read_text())
    # The printed and written mIoU is Occ3D's over the written predictions and the label files.
    tokens = [p.stem for p in sorted((out / "predictions").glob("*.npz"))]
    assert len(tokens) == 3  # mini_val: one scene of three samples
    scene = json.loads((occ_root / "v1.0-mini" / "scene.json").read_text())
    names = {s["token"]: s["name"] for s in scene}
    samples = {
        s["token"]: names[s["scene_token"]] for s in json.loads((occ_root / "v1.0-mini" / "sample.json").read_text())
    }
    hist = np.zeros((18, 18), np.int64)
    for t in tokens:
        pred = read_prediction(out / "predictions" / f"{t}.npz")
        with np.load(labels_path(occ_root, samples[t], t)) as z:
            gt, mask = z["semantics"], z["mask_camera"] > 0
        hist += np.bincount(18 * gt[mask].astype(np.int64) + pred[mask], minlength=324).reshape(18, 18)
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = np.diag(hist) / (hist.sum(0) + hist.sum(1) - np.diag(hist))
    assert rec["metrics"]["occ_miou"] == pytest.approx(np.nanmean(iou[:17]), abs=1e-9)
    assert rec["metrics"]["occ_iou_car"] == pytest.approx(iou[4], nan_ok=True)
    assert f"{100 * np.nanmean(iou[:17]):6.2f}" in printed
    assert len(list(out.glob("sample_*.png"))) == 3  # cameras and the occupancy views of each val sample
    # A second evaluation into the same folder is refused without overwrite=true.
    assert eval_cli(eval_args, monkeypatch) != 0
    assert "already holds" in capsys.readouterr().err


@pytest.mark.e2e
def test_ddp_logs_the_miou_of_the_whole_split(occ_root, tmp_path, monkeypatch):  # noqa: F811
    """Two processes each score part of the val split; the logged mIoU is the whole split's, as bev-eval's in one."""
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    args = [
        "experiment=synthetic_occ_cpu",
        *[a for a in SMALL if not a.startswith(("trainer=", "+trainer.limit_val_batches"))],  # every val sample
        *COARSE,
        "grid.zbound=[-1,5.4,1.6]",
        "trainer=ddp_cpu",
        "trainer.precision=32-true",
        "malloc_tuning=false",
        "threads=null",
        f"data.dataroot={occ_root}",
        f"hydra.run.dir={run}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bev.train", *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = json.loads((run / "metrics.json").read_text())["metrics"]
    ev = tmp_path / "eval"
    ckpt = run / "checkpoints" / "last.ckpt"
    eval_args = [f"ckpt_path={ckpt}", f"data.dataroot={occ_root}", "threads=1", "num_pngs=0", f"hydra.run.dir={ev}"]
    assert eval_cli(eval_args, monkeypatch) == 0
    scored = json.loads((ev / "metrics.json").read_text())["metrics"]
    keys = [k for k in scored if k.startswith("occ_") and not k.endswith("_loss")]
    assert len(keys) == 1 + 17 + 3
    for k in keys:
        assert logged[f"val/{k}"] == pytest.approx(scored[k], abs=1e-6, nan_ok=True), k
