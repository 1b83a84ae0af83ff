"""The camera + LiDAR experiments (synthetic_fusion_cpu, synthetic_lidar_cpu) train two steps through bev-train on
the synthetic fixture, their LiDAR branch fed by the items' points."""

import json

import pytest
import torch

from helpers.cli import TINY, eval_cli, train_cli

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
