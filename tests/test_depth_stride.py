"""Depth targets at the model's stride: data.depth_stride (null: model.net.camera.downsample, filled by bev-train) sets the
feature cells the LiDAR depth bins are computed for, so a stride-8 camera encoder (FIERY's) is supervised at
stride 8; a stride given that differs from the model's is refused in one line before the data is read."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from bev.data.depth import depth_targets
from bev.data.nuscenes import NuScenesBEVDataset
from bev.geometry import CAMERA_GEOMETRY, Grid
from helpers.cli import TINY, assert_one_paragraph, train_cli

GRID = Grid([-24, 24, 2.0], [-24, 24, 2.0], [-10, 10, 20.0], [4, 44, 8.0])


@pytest.mark.parametrize("stride", [8, 16, None])
def test_the_dataset_gives_depth_targets_at_its_stride(stride, synthetic_root, tmp_path):
    ds = NuScenesBEVDataset(
        synthetic_root,
        split="mini_val",
        grid=GRID,
        final_dim=(64, 160),
        depth_target=True,
        depth_stride=stride,
        augment=False,
        cache_dir=tmp_path,
        verbose=False,
    )
    item = ds[0]
    s = stride or 16  # null: LSS's stride, as before the option
    assert item["depth"].shape == (6, 64 // s, 160 // s)
    hw = torch.from_numpy(ds.index["image_hw"][0, item["cam_ids"].numpy()])
    cams = (item[k] for k in CAMERA_GEOMETRY)
    expected = depth_targets(ds.lidar_points(0), *cams, (64, 160), s, GRID, hw)
    assert torch.equal(item["depth"], expected) and (expected >= 0).sum() > 20


@pytest.mark.parametrize("bad", [4, 8.0, "8", True])
def test_other_strides_are_refused_naming_the_key(bad, synthetic_root, tmp_path):
    with pytest.raises(ValueError, match=r"data.depth_stride must be 8 or 16 \(model.net.camera.downsample\)"):
        NuScenesBEVDataset(synthetic_root, split="mini_val", depth_stride=bad, cache_dir=tmp_path, verbose=False)


def test_bev_train_at_stride_8_supervises_depth_at_stride_8(synthetic_root, tmp_path, monkeypatch):
    args = [
        *TINY,
        "model.net.camera.downsample=8",
        "model.depth_weight=0.1",
        "callbacks.bev_png.every_n_steps=0",
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={tmp_path}",
    ]
    assert train_cli(args, monkeypatch) == 0
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["global_step"] == 1 and torch.isfinite(torch.tensor(record["metrics"]["train/depth_loss"]))
    stored = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["bev_config"]
    assert stored["data"]["depth_stride"] == 8 and stored["model"]["net"]["camera"]["downsample"] == 8


def test_a_depth_stride_other_than_the_models_is_refused_before_the_data_is_read(tmp_path, monkeypatch, capsys):
    # data.dataroot does not exist: a check made after the data is indexed would report that instead.
    args = [
        *TINY,
        "model.net.camera.downsample=8",
        "data.depth_stride=16",
        f"data.dataroot={tmp_path / 'nowhere'}",
        f"hydra.run.dir={tmp_path}",
    ]
    assert train_cli(args, monkeypatch) == 1
    assert_one_paragraph(
        capsys.readouterr().err, "data.depth_stride=16 but model.net.camera.downsample=8", "pass data.depth_stride=8"
    )


def test_every_experiment_with_a_depth_loss_follows_its_model():
    """The experiments set no depth stride of their own: bev-train fills it from model.net.camera.downsample."""
    from hydra import compose, initialize_config_dir

    from bev.utils.config import CONFIG_DIR, resolve_depth_stride

    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        for downsample in (8, 16):
            cfg = compose("train", [*TINY, f"model.net.camera.downsample={downsample}"])
            assert cfg.data.depth_target and cfg.model.depth_weight > 0 and cfg.data.depth_stride is None
            resolve_depth_stride(cfg)
            assert OmegaConf.select(cfg, "data.depth_stride") == downsample
