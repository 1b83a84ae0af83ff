"""BEVDet's and BEVDet4D's nuScenes experiments carry the papers' recipe (CBGS, BEV augmentation, image
augmentation, the training range, per-group decoding) and run as they are, two steps on the synthetic set."""

import json

import pytest
from hydra import compose, initialize_config_dir

from bev.train import CONFIG_DIR
from helpers.cli import train_cli

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
    "trainer.val_check_interval=2",  # validate (per-group decoding, the devkit) after the two steps
    "trainer.enable_progress_bar=false",
    "callbacks.bev_png.every_n_steps=0",
]


@pytest.mark.parametrize("experiment", ["bevdet_nuscenes", "bevdet4d_nuscenes"])
def test_the_recipe_is_in_the_experiment(experiment):
    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={experiment}"])
    data, decoding = cfg.data, cfg.model.detection.decoding
    assert data.cbgs and data.bev_aug == "bevdet" and data.det_range == "grid"
    assert list(data.resize_lim) == [0.38, 0.55] and list(data.rot_lim) == [-5.4, 5.4] and data.rand_flip
    assert decoding.pre_nms_top_k == 500 and decoding.post_nms_max == 83  # BEVDet's bbox coder max_num per task
    assert decoding.nms == "scale_nms" and decoding.max_pool is False  # its Scale-NMS, no max-pool peak filter
    assert cfg.model.optimizer.lr == 2e-4 and cfg.trainer.max_epochs == 24


@pytest.mark.e2e
@pytest.mark.parametrize("experiment", ["bevdet_nuscenes", "bevdet4d_nuscenes"])
def test_the_experiment_trains_two_steps(experiment, synthetic_root, tmp_path, monkeypatch, capsys):
    args = [f"experiment={experiment}", *SMALL, f"data.dataroot={synthetic_root}", f"hydra.run.dir={tmp_path}"]
    assert train_cli(args, monkeypatch) == 0, capsys.readouterr().err[-3000:]
    assert "data.cbgs: an epoch draws" in capsys.readouterr().err
    rec = json.loads((tmp_path / "metrics.json").read_text())
    assert rec["global_step"] == 2 and "val/NDS" in rec["metrics"]


@pytest.mark.e2e
@pytest.mark.parametrize("experiment", ["synthetic_det_cpu", "synthetic_det_temporal_cpu"])
def test_the_synthetic_detection_experiments_train_two_steps(experiment, synthetic_root, tmp_path, monkeypatch, capsys):
    """The embedded detection experiments as configured: the static one with a decoder per task and detection
    weighted 0.05 and velocities from tracks, the temporal one with its own weighting and the head's velocities."""
    small = [("++" + a.lstrip("+")) if a.startswith(("+trainer", "trainer.val_check")) else a for a in SMALL]
    small = [a for a in small if not a.startswith("callbacks.bev_png")] + ["callbacks.bev_png=null"]
    args = [
        f"experiment={experiment}",
        *small,
        "++trainer.check_val_every_n_epoch=1",
        f"data.dataroot={synthetic_root}",
    ]
    args.append(f"hydra.run.dir={tmp_path}")
    assert train_cli(args, monkeypatch) == 0, capsys.readouterr().err[-3000:]
    rec = json.loads((tmp_path / "metrics.json").read_text())
    assert rec["global_step"] == 2 and "val/NDS" in rec["metrics"]
