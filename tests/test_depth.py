"""Lidar depth targets (bev.data.depth) and depth supervision (model.depth_weight).

The reader's targets are checked against the devkit's own lidar-to-image projection
(NuScenesExplorer.map_pointcloud_to_image: lidar -> ego -> global -> ego at camera time ->
camera), which shares no code with bev.geometry.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bev.data import NuScenesBEVDataset
from bev.data.depth import depth_targets, load_lidar
from bev.geometry import CAMERA_NAMES, FEATURE_STRIDE, Grid

GRID = Grid(dbound=(4.0, 45.0, 1.0))


def _camera(n=1):
    """A camera at the ego origin looking along +x (z_cam = x_ego), 64x160 image, focal 100 px."""
    K = torch.tensor([[100.0, 0, 80], [0, 100.0, 32], [0, 0, 1]])
    R = torch.tensor([[0.0, 0, 1], [-1, 0, 0], [0, -1, 0]])  # camera (right, down, forward) -> ego
    eye = torch.eye(3)
    return [t.expand(n, 3, 3) for t in (K, R)] + [torch.zeros(n, 3)] + [eye.expand(n, 3, 3), torch.zeros(n, 3)]


def test_hand_computed_targets():
    # Ego (x fwd, y left, z up). A point 10 m ahead on the optical axis hits pixel (80, 32): cell (2, 5).
    pts = torch.tensor(
        [
            [10.0, 0.0, 0.0],  # cell (2, 5), depth 10 -> bin 6
            [20.0, 0.0, 0.0],  # same cell, farther: the nearest point wins
            [60.0, -6.0, 0.0],  # u = 80 + 100*6/60 = 90: cell (2, 5) again, farther still
            [12.0, 3.0, 0.0],  # u = 80 - 100*3/12 = 55: cell (2, 3); depth 12 -> bin 8
            [-5.0, 0.0, 0.0],  # behind the camera: ignored
            [50.0, 30.0, 0.0],  # u = 20: cell (2, 1); depth 50 beyond the last bin (44 m): no target
            [3.7, 0.0, -0.6],  # v = 32 + 100*0.6/3.7 = 48.2: cell (3, 5); 3.7 m is nearest to the 4 m bin 0
            [2.0, -0.5, 0.0],  # u = 105: cell (2, 6); 2 m is nearer than any bin's half-width: no target
        ]
    )
    out = depth_targets(pts, *_camera(), (64, 160), FEATURE_STRIDE, GRID)
    assert out.shape == (1, 4, 10) and out.dtype == torch.long
    expected = torch.full((4, 10), -1)
    expected[2, 5] = 6
    expected[2, 3] = 8
    expected[3, 5] = 0
    torch.testing.assert_close(out[0], expected)


def test_targets_follow_the_image_augmentation():
    # A horizontal flip about the image centre (post_rots diag(-1, 1, 1), post_trans (160, 0, 0)) mirrors the cell.
    K, R, t, _, _ = _camera()
    pts = torch.tensor([[12.0, 3.0, 0.0]])
    flip = torch.diag(torch.tensor([-1.0, 1.0, 1.0])).unsqueeze(0)
    out = depth_targets(pts, K, R, t, flip, torch.tensor([[160.0, 0, 0]]), (64, 160), FEATURE_STRIDE, GRID)
    assert out[0, 2, 10 - 1 - 3] == 8 and (out >= 0).sum() == 1  # u = 160 - 55 = 105 -> col 6


def test_depth_targets_match_the_devkit_projection(synthetic_root, tmp_path):
    from nuscenes.nuscenes import NuScenes, NuScenesExplorer

    nusc = NuScenes("v1.0-mini", str(synthetic_root), verbose=False)
    explorer = NuScenesExplorer(nusc)
    torch.manual_seed(0)
    for augment in (False, True):
        ds = NuScenesBEVDataset(
            synthetic_root,
            split="mini_val",
            grid=GRID,
            depth_target=True,
            augment=augment,
            cache_dir=tmp_path,
            verbose=False,
        )
        compared = 0
        for i in range(len(ds)):
            s = ds[i]
            H, W = s["images"].shape[-2:]
            sample = nusc.get("sample", s["sample_token"])
            for n, c in enumerate(s["cam_ids"].tolist()):
                uv_raw, depth, _ = explorer.map_pointcloud_to_image(
                    sample["data"]["LIDAR_TOP"], sample["data"][CAMERA_NAMES[c]], min_dist=1e-3
                )
                uv = (
                    s["post_rots"][n, :2, :2].double() @ torch.from_numpy(uv_raw[:2])
                    + s["post_trans"][n, :2, None].double()
                )
                u, v = uv.numpy()
                keep = (u >= 0) & (u < W) & (v >= 0) & (v < H)
                expected = np.full((H // FEATURE_STRIDE, W // FEATURE_STRIDE), np.inf)
                np.minimum.at(
                    expected,
                    ((v[keep] // FEATURE_STRIDE).astype(int), (u[keep] // FEATURE_STRIDE).astype(int)),
                    depth[keep],
                )
                bins = np.round((expected - GRID.dbound[0]) / GRID.dbound[2])
                bins = np.where(np.isfinite(bins) & (bins >= 0) & (bins < GRID.depth_bins), bins, -1)
                got = s["depth"][n].numpy()
                has = (got >= 0) | (bins >= 0)
                # Equal up to points within float rounding of a cell edge or a bin's midpoint.
                assert (got != bins).sum() <= max(2, 0.02 * has.sum()), (augment, i, c, (got != bins).sum(), has.sum())
                compared += has.sum()
        assert compared > 500


def test_missing_or_damaged_lidar_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="depth_target=false"):
        load_lidar(str(tmp_path / "nope.pcd.bin"))
    bad = tmp_path / "bad.pcd.bin"
    np.zeros(7, np.float32).tofile(bad)
    with pytest.raises(ValueError, match="damaged"):
        load_lidar(str(bad))
    empty = tmp_path / "empty.pcd.bin"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty .*damaged.*depth_target=false"):
        load_lidar(str(empty))


def _tiny_lss():
    from helpers.models import lss_net

    grid = dict(xbound=[-8.0, 8.0, 1.0], ybound=[-8.0, 8.0, 1.0], zbound=[-10.0, 10.0, 20.0], dbound=[4.0, 12.0, 2.0])
    return lss_net(
        grid,
        image_size=(32, 64),
        context_channels=4,
        num_classes=1,
        camera=dict(backbone="small", widths=[4, 4, 4, 4, 4], mid_channels=8),
        bev=dict(widths=[4, 4, 4], blocks=1),
    )


def _batch(B=1, N=2, with_depth=True):
    K, R, t, pr, pt = _camera(N)
    batch = dict(
        images=torch.randn(B, N, 3, 32, 64),
        intrinsics=K.expand(B, N, 3, 3),
        rots=R.expand(B, N, 3, 3),
        trans=t.expand(B, N, 3),
        post_rots=pr.expand(B, N, 3, 3),
        post_trans=pt.expand(B, N, 3),
        bev=(torch.rand(B, 1, 16, 16) > 0.8).float(),
    )
    if with_depth:
        batch["depth"] = torch.randint(-1, 4, (B, N, 2, 4))
    return batch


def test_depth_supervision_adds_the_cross_entropy_of_the_depth_logits():
    import torch.nn.functional as F

    from bev.lit import CAMERA_KEYS, BEVLitModule

    torch.manual_seed(0)
    net, batch = _tiny_lss(), _batch()
    out = net(*(batch[k] for k in CAMERA_KEYS))
    bev, depth_logits = out["segmentation"], out["depth"]
    assert depth_logits.shape == (1, 2, 4, 2, 4)  # (B, N, D, H/16, W/16)
    m = BEVLitModule(net, optimizer=None, segmentation=dict(object_classes=["vehicle"]), depth_weight=0.5)
    m.log = lambda *a, **k: None
    loss = m.training_step(batch, 0)["loss"]
    valid = batch["depth"] >= 0
    ce = F.cross_entropy(depth_logits.permute(0, 1, 3, 4, 2)[valid], batch["depth"][valid])
    torch.testing.assert_close(loss, m.task_modules.segmentation.loss_fn(bev, batch["bev"]) + 0.5 * ce)
    # No target anywhere: no depth term (not NaN).
    batch["depth"].fill_(-1)
    torch.testing.assert_close(
        m.training_step(batch, 0)["loss"], m.task_modules.segmentation.loss_fn(bev, batch["bev"])
    )


def test_depth_weight_without_depth_targets_names_the_fix():
    from bev.lit import BEVLitModule

    m = BEVLitModule(_tiny_lss(), optimizer=None, segmentation=dict(object_classes=["vehicle"]), depth_weight=1.0)
    with pytest.raises(ValueError, match="data.depth_target=true"):
        m.training_step(_batch(with_depth=False), 0)
