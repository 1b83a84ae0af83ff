"""Pictures of samples with LiDAR points (bev.viz): the points of one sample of a batch, drawn in the BEV panel at
their (y, x) and in each camera where a pinhole projection written here puts them."""

from __future__ import annotations

import numpy as np
import torch
from matplotlib.collections import PathCollection
from test_lidar_data import dataset, sweep_root  # noqa: F401 (a synthetic set with sweeps)

from bev.data.lidar import collate_points
from bev.geometry import Grid
from bev.viz import MAX_DRAWN_POINTS, batch_sample, render_figure


def _pinhole(points: np.ndarray, s: dict, n: int) -> np.ndarray:
    """(K, 2) pixels of the points camera n sees (depth > 0.5 m, inside the image), numpy, as the loader's
    augmentation defines them: (u, v, depth) through post_rot, plus post_tran."""
    K, R, t, P, pt = (
        np.asarray(s[k][0][n], np.float64) for k in ("intrinsics", "rots", "trans", "post_rots", "post_trans")
    )
    cam = (points - t) @ R
    uvz = np.stack([cam[:, 0] / cam[:, 2], cam[:, 1] / cam[:, 2], np.ones(len(cam))], 1) @ K.T
    uvd = np.stack([uvz[:, 0], uvz[:, 1], cam[:, 2]], 1) @ P.T + pt
    H, W = s["images"].shape[-2:]
    ok = (cam[:, 2] > 0.5) & (uvd[:, 0] >= 0) & (uvd[:, 0] < W) & (uvd[:, 1] >= 0) & (uvd[:, 1] < H)
    return uvd[ok, :2]


def test_the_points_of_a_sample_are_drawn_in_the_bev_and_the_cameras(sweep_root, tmp_path):  # noqa: F811
    grid = Grid(xbound=(-30.0, 30.0, 0.5), ybound=(-30.0, 30.0, 0.5), zbound=(-2.0, 4.0, 6.0))
    ds = dataset(sweep_root, tmp_path, grid=grid, sweeps=0)
    batch = collate_points([ds[0], ds[1]])
    s = batch_sample(batch, 1)
    assert torch.equal(s["points"][:, 1:], ds[1]["points"]) and (s["points"][:, 0] == 0).all()
    points = ds[1]["points"][:, :3].double().numpy()
    assert len(points) <= MAX_DRAWN_POINTS
    fig = render_figure(s, grid=grid)
    cams_ax, bev_ax = fig.axes[0], fig.axes[1]
    bev_dots = [c for c in bev_ax.collections if isinstance(c, PathCollection)]
    assert len(bev_dots) == 1 and np.allclose(bev_dots[0].get_offsets(), points[:, [1, 0]])
    drawn = np.concatenate([c.get_offsets() for c in cams_ax.collections if isinstance(c, PathCollection)])
    H, W = s["images"].shape[-2:]
    cols = 3  # the six cameras in two rows of three
    expected = np.concatenate([_pinhole(points, s, n) + [n % cols * W, n // cols * H] for n in range(6)])
    assert 0 < len(drawn) == len(expected) and np.allclose(drawn, expected, atol=1e-6)
