"""Pictures: BEV orientation, camera grid order, error map, atomic PNG writing, bev-gallery."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from bev.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from bev.gallery import main as gallery_main
from bev.geometry import Grid
from bev.viz import (
    FN_COLOR,
    FP_COLOR,
    TP_COLOR,
    bev_to_display,
    camera_grid,
    error_map,
    gif_frame,
    render_figure,
    render_sample,
    save_gif,
    save_png,
    save_sample_png,
)


def _sample(X=200, Y=200, ncam=6, H=32, W=88):
    images = torch.zeros(ncam, 3, H, W)
    for c in range(ncam):  # camera c is a flat grey of level 40 * (c + 1)
        images[c] = ((40 * (c + 1) / 255.0) - torch.tensor(IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor(
            IMAGENET_STD
        ).view(3, 1, 1)
    bev = torch.zeros(1, X, Y)
    bev[0, 150:160, 120:130] = 1  # x > 0 (front), y > 0 (left)
    return {"images": images, "bev": bev, "visibility": torch.zeros(X, Y, dtype=torch.uint8), "sample_token": "tok"}


def test_bev_display_orientation():
    grid = Grid()
    bev = np.zeros(grid.bev_shape)
    ((i, j),) = grid.xy_to_index(np.array([[30.0, 20.0]]))  # 30 m ahead, 20 m to the left
    bev[i, j] = 1
    r, c = np.argwhere(bev_to_display(bev))[0]
    assert r < 100 and c < 100  # ahead = up, left = left: the top-left quadrant
    ((i, j),) = grid.xy_to_index(np.array([[-30.0, -20.0]]))
    bev[:] = 0
    bev[i, j] = 1
    r, c = np.argwhere(bev_to_display(bev))[0]
    assert r >= 100 and c >= 100


def test_camera_grid_order_and_missing_cameras():
    s = _sample()
    g = camera_grid(s["images"])
    assert g.shape == (64, 264, 3) and g.dtype == np.uint8
    levels = [int(g[r * 32 + 5, c * 88 + 5, 0]) for r in range(2) for c in range(3)]
    assert levels == [40, 80, 120, 160, 200, 240]
    g = camera_grid(s["images"][:2], cam_ids=torch.tensor([1, 5]))
    assert int(g[5, 88 + 5, 0]) == 40 and int(g[32 + 5, 176 + 5, 0]) == 80 and g[5, 5].sum() == 0


def test_error_map_colours():
    prob = np.array([[0.9, 0.9], [0.1, 0.1]])
    tgt = np.array([[1.0, 0.0], [1.0, 0.0]])
    m = error_map(prob, tgt)
    assert tuple(m[0, 0]) == TP_COLOR and tuple(m[0, 1]) == FP_COLOR and tuple(m[1, 0]) == FN_COLOR
    assert tuple(m[1, 1]) == (0, 0, 0)


def test_save_sample_png_with_and_without_prediction(tmp_path):
    s = _sample()
    p1 = save_sample_png(tmp_path / "a" / "sample.png", s)
    batch = {k: (v[None] if isinstance(v, torch.Tensor) else [v]) for k, v in s.items()}
    pred = s["bev"][None] * 0.8 + 0.1  # (B, 1, X, Y) probabilities
    p2 = save_sample_png(tmp_path / "pred.png", batch, pred=pred[0])
    for p in (p1, p2):
        with Image.open(p) as im:
            assert im.format == "PNG" and im.size[0] > 600
    assert sorted(x.name for x in tmp_path.rglob("*") if x.is_file()) == [
        "pred.png",
        "sample.png",
    ]  # no temp files left
    # The prediction figure has more content (two extra panels) than the target-only one.
    a = render_sample(s)
    b = render_sample(s, pred=pred)
    assert a.shape == b.shape and (a != b).mean() > 0.05
    with pytest.raises(ValueError, match="does not match"):
        render_sample(s, pred=torch.zeros(1, 10, 10))


def test_gallery_cli(synthetic_root, tmp_path, capsys):
    out = tmp_path / "g.png"
    assert (
        gallery_main(
            [
                "--dataroot",
                str(synthetic_root),
                "--split",
                "mini_val",
                "--index",
                "1",
                "--out",
                str(out),
                "--cache-dir",
                str(tmp_path / "cache"),
            ]
        )
        == 0
    )
    assert out.is_file() and capsys.readouterr().out.strip() == str(out)
    assert gallery_main(["--dataroot", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "nuscenes.org/download" in capsys.readouterr().err


def test_bev_axes_follow_the_sample_grid():
    s = _sample(X=400, Y=200)  # x [-10, 30, 0.1], y [-10, 10, 0.1]: not the default grid
    s["bev_bounds"] = torch.tensor([[-10.0, 30.0, 0.1], [-10.0, 10.0, 0.1]], dtype=torch.float64)
    ax = render_figure(s).axes[1]
    assert ax.get_ylim() == pytest.approx((-10.0, 30.0))  # x forward, up
    assert ax.get_xlim() == pytest.approx((10.0, -10.0))  # y left, to the left


def test_map_layers_in_colour_under_the_vehicles(tmp_path):
    from bev.viz import BACKGROUND, MAP_COLORS, OBJECT_COLORS, compose_layers

    names = ("vehicle", "drivable_area", "divider")
    bev = torch.zeros(3, 200, 200)
    bev[1, :, 80:120] = 1  # a road ahead of and behind the ego
    bev[2, :, 99:101] = 1  # its centre line
    bev[0, 150:160, 95:105] = 1  # a vehicle on the road, over the line
    img = compose_layers(bev.numpy(), names)
    assert tuple(img[155, 100]) == OBJECT_COLORS[0]  # the vehicle is on top
    assert tuple(img[50, 100]) == MAP_COLORS["divider"] and tuple(img[50, 85]) == MAP_COLORS["drivable_area"]
    assert tuple(img[50, 10]) == BACKGROUND
    half = compose_layers(bev.numpy() * 0.5, names)  # a prediction blends by probability
    assert 0 < half[50, 85].astype(int).sum() < img[50, 85].astype(int).sum() + 3 * 40
    s = _sample()
    s["bev"] = bev
    fig = render_figure(s, pred=bev.clone() * 0.9, class_names=names)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == list(names)
    path = save_sample_png(tmp_path / "map.png", s, pred=bev * 0.9, class_names=names)
    png = np.asarray(Image.open(path).convert("RGB"))
    assert (np.abs(png.astype(int) - MAP_COLORS["drivable_area"]).sum(-1) == 0).sum() > 500
    with pytest.raises(ValueError, match="2 class names"):
        render_figure(s, class_names=names[:2])


def test_temporal_picture_paints_instances_and_their_future_paths():
    from bev.viz import BACKGROUND, instance_color, paint_instances, render_temporal_figure

    grid = Grid(xbound=(-24, 24, 0.5), ybound=(-24, 24, 0.5))
    T, X, Y = 5, 96, 96
    inst = torch.zeros(T, X, Y, dtype=torch.long)
    for t in range(T):  # vehicle 1 drives forward (+x), vehicle 2 to the left (+y)
        inst[t, 40 + 3 * t : 46 + 3 * t, 30:34] = 1
        inst[t, 60:64, 50 + 2 * t : 56 + 2 * t] = 2
    painted = paint_instances(inst[0])
    assert tuple(painted[42, 31]) == instance_color(1) and tuple(painted[61, 52]) == instance_color(2)
    assert tuple(painted[0, 0]) == BACKGROUND and instance_color(1) != instance_color(2)
    window = {"images": torch.zeros(1, 3, 6, 3, 32, 88), "instance": inst[None], "bev": torch.zeros(1, 3, X, Y)}
    pred = {"bev": torch.rand(3, X, Y), "segmentation": (inst > 0).float()}
    fig = render_temporal_figure(window, pred, inst, grid=grid, class_names=["vehicle", "drivable_area", "divider"])
    target_ax, pred_ax = fig.axes[1], fig.axes[2]
    for ax in (target_ax, pred_ax):  # one path per vehicle, from its centre now to its centre 4 frames on, in metres
        lines = {tuple(np.round(line.get_color(), 3)): line for line in ax.get_lines() if line.get_linestyle() == "-"}
        one = lines[tuple(np.round(np.asarray(instance_color(1)) / 255, 3))].get_xydata()
        assert one[0] == pytest.approx([-8.0, -2.5]) and one[-1] == pytest.approx([-8.0, 3.5])  # (y, x): forward 6 m
        two = lines[tuple(np.round(np.asarray(instance_color(2)) / 255, 3))].get_xydata()
        assert two[0] == pytest.approx([2.5, 7.0]) and two[-1] == pytest.approx([6.5, 7.0])  # leftward 4 m


def test_picture_files_png_gif_and_gif_frames(tmp_path):
    img = np.zeros((40, 100, 3), np.uint8)
    img[:, :50] = (255, 0, 0)
    png = save_png(tmp_path / "a.png", img)
    assert np.array_equal(np.asarray(Image.open(png).convert("RGB")), img)
    small = gif_frame(img, 50)
    assert small.shape == (20, 50, 3) and gif_frame(img, 500).shape == img.shape
    gif = Image.open(save_gif(tmp_path / "a.gif", [small, small[:, ::-1]], fps=4.0))
    assert gif.n_frames == 2 and gif.info["duration"] == 250 and gif.info["loop"] == 0
    with pytest.raises(ValueError, match="at least one frame"):
        save_gif(tmp_path / "b.gif", [])
    assert not (tmp_path / "b.gif").exists()
