"""Any camera rig: the model, a custom in-memory dataset, training, prediction and pictures work with
1 to 12 cameras of any (stride-16) image size, with no nuScenes camera names anywhere."""

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import bev
from bev.geometry import Grid
from bev.inference import ring_rig
from bev.lit import BEVLitModule
from bev.viz import camera_grid, camera_layout, render_sample
from helpers.models import lss_net

GRID = Grid(xbound=(-16, 16, 2.0), ybound=(-16, 16, 2.0), zbound=(-10, 10, 20), dbound=(2, 18, 4.0))
TINY = dict(
    context_channels=8,
    camera=dict(backbone="small", widths=(8, 8, 8, 16, 16), mid_channels=16),
    bev=dict(widths=(8, 8, 16), blocks=1),
)


class ToyRig(Dataset):
    """The documented sample dict for N cameras: a bright square in the first camera's image and a
    vehicle cell block in front of it (what a custom dataset returns)."""

    def __init__(self, num_cameras: int, image_size=(32, 64), length: int = 4):
        self.n, self.size, self.length = num_cameras, image_size, length
        self.cams = {k: v[0] for k, v in ring_rig(num_cameras, image_size).items()}

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        H, W = self.size
        g = torch.Generator().manual_seed(i)
        images = 0.1 * torch.randn(self.n, 3, H, W, generator=g)
        images[0, :, H // 2 - 4 : H // 2 + 4, W // 2 - 8 : W // 2 + 8] += 2.0  # "a vehicle" straight ahead of camera 0
        bev_target = torch.zeros(1, *GRID.bev_shape)
        bev_target[0, 11:13, 7:9] = 1.0  # x 6..10 m ahead, y -2..2 m
        return {
            **self.cams,
            "images": images,
            "bev": bev_target,
            "bev_bounds": torch.tensor([GRID.xbound, GRID.ybound], dtype=torch.float64),
            "sample_token": f"toy-{i}",
        }


@pytest.mark.parametrize("num_cameras", [1, 3])
def test_custom_rig_trains_predicts_and_draws(num_cameras, tmp_path):
    torch.manual_seed(0)
    net = lss_net(GRID, (32, 64), pool_backend="torch", **TINY)
    model = BEVLitModule(net, optimizer=lambda params: torch.optim.Adam(params, lr=1e-2))
    ds = ToyRig(num_cameras)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, DataLoader(ds, batch_size=2), DataLoader(ds, batch_size=2))
    assert trainer.global_step == 3 and torch.isfinite(trainer.callback_metrics["train/loss_step"])
    changed = [k for k, v in model.state_dict().items() if v.dtype.is_floating_point and not torch.equal(v, before[k])]
    assert any(k.startswith("net.camera.encoder") for k in changed) and any(
        k.startswith("net.decoder") for k in changed
    )

    batch = torch.utils.data.default_collate([ds[0], ds[1]])
    probs = bev.predict(model, batch)
    assert probs.shape == (2, 1, 16, 16) and ((probs >= 0) & (probs <= 1)).all()
    img = render_sample({k: v[:1] for k, v in batch.items()}, pred=probs[:1])
    assert img.ndim == 3 and img.shape[2] == 3


@pytest.mark.parametrize("num_cameras, size", [(1, (16, 32)), (5, (48, 80)), (12, (32, 96))])
def test_any_camera_count_and_image_size(num_cameras, size):
    net = lss_net(GRID, size, pool_backend="torch", **TINY).eval()
    cams = ring_rig(num_cameras, size, batch_size=2)
    images = torch.randn(2, num_cameras, 3, *size)
    with torch.no_grad():
        out = net(images, *(cams[k] for k in ("intrinsics", "rots", "trans", "post_rots", "post_trans")))[
            "segmentation"
        ]
    assert out.shape == (2, 1, 16, 16) and torch.isfinite(out).all()


def test_each_camera_of_a_ring_fills_its_own_side():
    """With only camera i's features non-zero, the splatted BEV mass lies in camera i's direction."""
    n, size = 5, (32, 64)
    net = lss_net(GRID, size, pool_backend="torch", **TINY).eval()
    cams = ring_rig(n, size)
    coords = net.camera.voxel_coords(*(cams[k] for k in ("intrinsics", "rots", "trans", "post_rots", "post_trans")))
    fH, fW = size[0] // 16, size[1] // 16
    centres = torch.as_tensor(GRID.cell_centers())
    for i in range(n):
        depth = torch.zeros(1, n, GRID.depth_bins, fH, fW)
        depth[:, i] = 1.0
        bev_mass = net.camera.splat(depth, torch.ones(1, n, fH, fW, 1), coords)[0, 0]
        mean_xy = (bev_mass[..., None] * centres).sum((0, 1)) / bev_mass.sum()
        yaw = 2 * np.pi * i / n
        direction = torch.tensor([np.cos(yaw), np.sin(yaw)])
        assert float(mean_xy.double() @ direction.double()) > 0.8 * float(mean_xy.norm())


@pytest.mark.parametrize("n, layout", [(1, (1, 1)), (3, (1, 3)), (6, (2, 3)), (8, (3, 3)), (12, (3, 4))])
def test_camera_picture_adapts_to_the_rig(n, layout):
    assert camera_layout(n) == layout
    grid = camera_grid(torch.zeros(n, 3, 16, 32))
    assert grid.shape == (layout[0] * 16, layout[1] * 32, 3)
