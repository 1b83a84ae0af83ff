"""The camera + LiDAR experiments (synthetic_fusion_cpu, synthetic_lidar_cpu, synthetic_temporal_fusion_cpu) train
two steps through bev-train on the synthetic fixture, their LiDAR branch fed by the items' points."""

import json

import numpy as np
import pytest
import torch

from bev import predict_cli
from helpers.cli import TINY, eval_cli, run_cli, train_cli

SMALL_LIDAR = [
    "model.net.lidar.pfn_channels=[8]",
    "model.net.lidar.widths=[8,8,8]",
    "model.net.lidar.up_channels=[4,4,4]",
]


@pytest.mark.e2e
@pytest.mark.parametrize("experiment", ["synthetic_fusion_cpu", "synthetic_lidar_cpu"])
def test_the_lidar_experiments_train_two_steps(experiment, synthetic_root, tmp_path, monkeypatch):
    camera = experiment == "synthetic_fusion_cpu"  # the LiDAR-only one has no camera branch to size
    args = [
        *[a for a in TINY if not a.startswith("experiment=") and (camera or not a.startswith("model.net.camera."))],
        f"experiment={experiment}",
        *SMALL_LIDAR,
        "trainer.max_epochs=2",
        "++trainer.limit_val_batches=1",
        "callbacks.bev_png.every_n_steps=0",
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={tmp_path}",
    ]
    assert train_cli(args, monkeypatch) == 0
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["global_step"] >= 2 and torch.isfinite(torch.tensor(record["metrics"]["train/loss"]))
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert any(k.startswith("net.lidar.") for k in state)
    assert any(k.startswith("net.camera.") for k in state) == (experiment == "synthetic_fusion_cpu")
    # bev-eval scores it (and draws it) from its checkpoint, points and all
    args = [
        f"ckpt_path={tmp_path}",
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={tmp_path / 'eval'}",
        "num_pngs=1",
    ]
    assert eval_cli(args, monkeypatch) == 0
    assert "NDS" in json.loads((tmp_path / "eval" / "metrics.json").read_text())["metrics"]
    # bev-predict writes its boxes and draws its points (batched as in training)
    args = [f"ckpt_path={tmp_path}", f"data.dataroot={synthetic_root}", f"out={tmp_path / 'pred'}", "gif=false"]
    assert run_cli(predict_cli._hydra_main, [*args, f"hydra.run.dir={tmp_path / 'pred_log'}"], monkeypatch) == 0
    records = json.loads((tmp_path / "pred" / "predictions.json").read_text())["samples"]
    assert records and all("num_boxes" in r for r in records)
    assert len(list((tmp_path / "pred").rglob("*.png"))) == len(records)


@pytest.mark.e2e
def test_fiery_present_and_future_train_on_the_fused_bev(synthetic_root, tmp_path, monkeypatch):
    """experiment=synthetic_temporal_fusion_cpu: camera windows and the present frame's points, one fused BEV for
    the motion head; bev-eval scores its future and bev-predict writes its future instances."""
    args = [
        "experiment=synthetic_temporal_fusion_cpu",
        *TINY[1:],
        *SMALL_LIDAR,
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={tmp_path}",
        "data.past_frames=1",
        "data.future_frames=1",
        "data.input_memo_mb=0",
        "++trainer.max_steps=2",
        "trainer.max_epochs=2",
    ]
    assert train_cli(args, monkeypatch) == 0
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    parts = ("net.camera.", "net.lidar.", "net.fuser.", "net.temporal.", "net.heads.motion.")
    assert all(any(k.startswith(p) for k in state) for p in parts)
    args = [f"ckpt_path={tmp_path}", f"data.dataroot={synthetic_root}", f"hydra.run.dir={tmp_path / 'eval'}"]
    assert eval_cli(args, monkeypatch) == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())["metrics"]
    assert {"future_iou_long", "vpq_long", "vpq_long_present_copied"} <= set(metrics)
    args = [f"ckpt_path={tmp_path}", f"data.dataroot={synthetic_root}", f"out={tmp_path / 'pred'}", "gif=false"]
    assert run_cli(predict_cli._hydra_main, [*args, f"hydra.run.dir={tmp_path / 'pred_log'}"], monkeypatch) == 0
    records = json.loads((tmp_path / "pred" / "predictions.json").read_text())["samples"]
    assert records and all(np.load(r["npz"])["future_instances"].shape[0] == 2 for r in records)


# What a CPU test changes in the nuScenes experiments: the synthetic set, small inputs and branches, two steps.
NUSCENES_SMALL = [
    "data.version=v1.0-mini",
    "data.train_split=mini_train",
    "data.val_split=mini_val",
    "data.batch_size=1",
    "data.num_workers=0",
    "data.pin_memory=false",
    "trainer=cpu",
    "+trainer.max_steps=2",
    "trainer.max_epochs=1",
    "+trainer.limit_val_batches=1",
    "trainer.val_check_interval=2",
    "trainer.enable_progress_bar=false",
    "callbacks.bev_png.every_n_steps=0",
    "grid.xbound=[-54,54,1.8]",
    "grid.ybound=[-54,54,1.8]",
    *SMALL_LIDAR,
]
CAMERA_SMALL = ["data.final_dim=[64,176]", "model.net.camera.weights=null", "grid.dbound=[1,60,4]"]


@pytest.mark.parametrize("experiment", ["bevfusion_nuscenes", "lidar_nuscenes"])
def test_the_nuscenes_lidar_experiments_carry_bevfusion_settings(experiment):
    from hydra import compose, initialize_config_dir

    from bev.train import CONFIG_DIR

    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={experiment}"])
    assert cfg.data.lidar.enabled and cfg.data.lidar.sweeps == 9 and cfg.data.cbgs
    assert list(cfg.grid.xbound) == [-54.0, 54.0, 0.6] and cfg.data.map_layers == "bevfusion"
    assert (cfg.model.net.camera is None) == (experiment == "lidar_nuscenes")
    assert (cfg.model.net.fuser is None) == (experiment == "lidar_nuscenes")
    lr, epochs = (2e-4, 6) if experiment == "bevfusion_nuscenes" else (1e-4, 20)
    assert cfg.model.optimizer.lr == lr and cfg.trainer.max_epochs == epochs


@pytest.mark.e2e
@pytest.mark.parametrize("experiment", ["bevfusion_nuscenes", "lidar_nuscenes"])
def test_the_nuscenes_lidar_experiments_train_two_steps(experiment, synthetic_root, tmp_path, monkeypatch, capsys):
    camera = CAMERA_SMALL if experiment == "bevfusion_nuscenes" else []
    args = [f"experiment={experiment}", *NUSCENES_SMALL, *camera, f"data.dataroot={synthetic_root}"]
    assert train_cli([*args, f"hydra.run.dir={tmp_path}"], monkeypatch) == 0, capsys.readouterr().err[-3000:]
    rec = json.loads((tmp_path / "metrics.json").read_text())
    assert rec["global_step"] == 2 and "val/NDS" in rec["metrics"]
