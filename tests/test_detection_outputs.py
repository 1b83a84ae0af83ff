"""3D boxes out of a detecting model: drawn in the BEV and the cameras (bev.viz), written by bev-predict
(npz, predictions.json, PNGs, GIF), and the detection head's maps exported by bev-export (ONNX Runtime and
torch.export agree with PyTorch). The tests that run an entry point are end-to-end (marker e2e)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

import bev
from bev import export as bev_export
from bev import predict_cli
from bev.classes import DETECTION_CLASSES
from bev.geometry import Grid, box_corners
from bev.inference import CAMERA_INPUTS, ring_rig
from bev.viz import (
    DETECTION_COLORS,
    box_edges_in_image,
    draw_boxes_bev,
    render_figure,
)
from helpers.cli import TINY, assert_one_paragraph, run_cli, train_cli

CAR = DETECTION_CLASSES.index("car")


def _box(x=10.0, y=0.0, z=1.0, w=2.0, l=4.0, h=2.0, yaw=0.0, vx=0.0, vy=0.0):  # noqa: E741 (nuScenes' l)
    return np.array([[x, y, z, w, l, h, yaw, vx, vy]], dtype=np.float32)


def _pixels_of(fig, ax, rgb, tol=40):
    """Data coordinates (horizontal, vertical) of the pixels of `ax` within `tol` of colour rgb."""
    fig.canvas.draw()
    img = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(int)
    H = img.shape[0]
    rows, cols = np.nonzero(np.abs(img - np.asarray(rgb)).sum(-1) < tol)
    disp = np.stack([cols + 0.5, H - rows - 0.5], axis=1)  # display coordinates: origin bottom-left
    bbox = ax.get_window_extent()
    inside = (disp[:, 0] > bbox.x0) & (disp[:, 0] < bbox.x1) & (disp[:, 1] > bbox.y0) & (disp[:, 1] < bbox.y1)
    return ax.transData.inverted().transform(disp[inside])


# --------------------------------------------------------------------------------------- drawing
def test_box_corners_follow_the_geometry_conventions():
    """yaw pi/2: the length runs along ego y; the first corner is the front-left one, bottom then top."""
    c = box_corners(_box(x=10, y=0, z=1, w=2, l=4, h=2, yaw=math.pi / 2))[0]
    np.testing.assert_allclose(c[0], [9, 2, 0], atol=1e-6)  # front (+y) left (-x of a box facing +y)
    np.testing.assert_allclose(c[2], [11, -2, 0], atol=1e-6)  # rear-right
    np.testing.assert_allclose(c[4:, :2], c[:4, :2])
    np.testing.assert_allclose(c[4:, 2], 2.0)
    assert sorted(np.round(c[:4, 0]).tolist()) == [9, 9, 11, 11]


def test_a_box_ahead_is_drawn_above_the_ego_in_the_bev_panel():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from bev.viz import _draw_bev, box_detections

    grid = Grid()
    fig = Figure(figsize=(4, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    _draw_bev(ax, np.zeros(grid.bev_shape), grid, "boxes", cmap="gray", vmin=0, vmax=1)
    det = box_detections({"boxes": _box(x=10, y=5, l=8, w=4), "labels": [CAR]})  # no score: no label
    draw_boxes_bev(ax, det, grid)
    yx = _pixels_of(fig, ax, DETECTION_COLORS["car"])
    assert len(yx) > 20
    # Every car-coloured pixel is on the footprint (x 6..14, y 3..7, in ego metres), within a line's width.
    assert (yx[:, 1] > 5).all() and (yx[:, 1] < 15).all() and (yx[:, 0] > 2).all() and (yx[:, 0] < 8).all()
    assert yx[:, 1].min() < 6.5 and yx[:, 1].max() > 13.5 and yx[:, 0].min() < 3.5 and yx[:, 0].max() > 6.5
    # ... and the panel puts it above the ego and to its left on the screen.
    ego = ax.transData.transform([(0, 0)])[0]
    box = ax.transData.transform([(5, 10)])[0]
    assert box[1] > ego[1] and box[0] < ego[0]


def test_projection_into_a_camera_by_hand():
    """Camera 0 of the ring rig looks along ego x from 1.5 m up: u = W/2 + f * (-y) / x, v = H/2 + f * (1.5 - z) / x."""
    H, W = 32, 96
    cams = ring_rig(6, (H, W), 1)
    cam = [cams[k][0, 0] for k in list(CAMERA_INPUTS)[1:]]
    f = W / 2
    uv = box_edges_in_image(_box(x=10, y=1, z=1.5), *cam)
    assert np.isfinite(uv).all()
    corner = box_corners(_box(x=10, y=1, z=1.5))[0, 0]  # edge 0 starts at corner 0
    np.testing.assert_allclose(
        uv[0, 0, 0], [W / 2 + f * -corner[1] / corner[0], H / 2 + f * (1.5 - corner[2]) / corner[0]], atol=1e-4
    )
    assert ((uv[..., 0] >= 0) & (uv[..., 0] < W) & (uv[..., 1] >= 0) & (uv[..., 1] < H)).all()
    back = [cams[k][0, 3] for k in list(CAMERA_INPUTS)[1:]]  # camera 3 looks backwards
    assert np.isnan(box_edges_in_image(_box(x=10, y=1, z=1.5), *back)).all()
    # A box through the camera's plane: edges are cut where they cross depth = near (0.5 m ahead).
    uv = box_edges_in_image(_box(x=0.5, y=1, z=1.5, l=4), *cam, near=0.5)
    corner = box_corners(_box(x=0.5, y=1, z=1.5, l=4))[0, 0]  # (2.5, 2, 0.5); edge 0 runs to x = -1.5
    np.testing.assert_allclose(uv[0, 0, 1], [W / 2 + f * -corner[1] / 0.5, H / 2 + f * (1.5 - corner[2]) / 0.5])
    assert np.isnan(uv[0, 1]).all() and np.isnan(uv[0, 5]).all()  # the rear edges (x = -1.5): wholly behind


def test_render_figure_draws_boxes_in_the_bev_and_the_right_camera():
    """A ground-truth car 10 m ahead: in the target panel above the ego, in camera 0's slot (it looks ahead)."""
    H, W = 32, 96
    cams = {k: v[0] for k, v in ring_rig(6, (H, W), 1).items()}
    grid = Grid(xbound=(-24, 24, 2.0), ybound=(-24, 24, 2.0))
    sample = {
        "images": torch.zeros(6, 3, H, W),
        "bev": torch.zeros(1, *grid.bev_shape),
        "sample_token": "tok",
        **cams,
        "det_boxes": torch.from_numpy(np.concatenate([_box(x=10, y=0), np.zeros((3, 9), np.float32)])),
        "det_labels": torch.tensor([CAR, -1, -1, -1]),
    }
    fig = render_figure(sample, grid=grid)
    cam_ax, bev_ax = fig.axes[0], fig.axes[1]
    uv = _pixels_of(fig, cam_ax, DETECTION_COLORS["car"])
    assert len(uv) > 5 and (uv[:, 0] < W).all() and (uv[:, 1] < H).all()  # slot 0 only
    yx = _pixels_of(fig, bev_ax, DETECTION_COLORS["car"])
    assert len(yx) > 5 and (np.abs(yx[:, 1] - 10) < 3).all() and (np.abs(yx[:, 0]) < 2).all()
    assert "car" in [t.get_text() for t in fig.legends[0].get_texts()]


def test_boxes_option_is_checked():
    from bev.inference import boxes_option

    assert boxes_option("auto") == "auto" and boxes_option(True) is True
    with pytest.raises(ValueError, match="boxes='yes': choose auto"):
        boxes_option("yes")


# ------------------------------------------------------------------------------- entry points
@pytest.fixture(scope="module")
def det_run(synthetic_root, tmp_path_factory):
    """A 1-epoch bev-train run of the tiny model with the light detection head (segmentation + detection)."""
    run = tmp_path_factory.mktemp("det_run")
    mp = pytest.MonkeyPatch()
    try:
        args = [
            *TINY,
            "data.detection=true",
            "model.net.heads.detection={shared_channels: 8, head_channels: 0}",
            "model.tasks=[segmentation,detection]",
            # Velocities from tracks, with every past box starting one: an untrained head's boxes match often.
            "+model.detection={track_velocity: {past_frames: 1, gate: 6.0, min_past_score: 0.0, still_speed: 0.0}}",
            "trainer.max_epochs=1",
            "callbacks.bev_png.every_n_steps=0",
            f"data.dataroot={synthetic_root}",
            f"hydra.run.dir={run}",
        ]
        assert train_cli(args, mp) == 0
    finally:
        mp.undo()
    return run


def _val_batch(model, dataroot, n):
    from omegaconf import OmegaConf

    from bev.inference import build_data_config, select_samples

    cfg = OmegaConf.create(model.run_config)
    ds, order, _ = select_samples(build_data_config(OmegaConf.create({"dataroot": str(dataroot)}), cfg))
    return torch.utils.data.default_collate([ds[int(i)] for i in order[:n]])


@pytest.mark.e2e
def test_bev_predict_writes_and_draws_the_boxes(det_run, synthetic_root, tmp_path, monkeypatch):
    out = tmp_path / "pred"
    args = [f"ckpt_path={det_run}", f"data.dataroot={synthetic_root}", f"out={out}", f"hydra.run.dir={tmp_path / 'r'}"]
    assert run_cli(predict_cli._hydra_main, [*args, "box_threshold=0.1"], monkeypatch) == 0
    rec = json.loads((out / "predictions.json").read_text())
    assert rec["box_fields"] == ["x", "y", "z", "w", "l", "h", "yaw", "vx", "vy"] and rec["box_threshold"] == 0.1
    model = bev.load_model(det_run)
    # The first batch bev-predict ran (data.batch_size 2): the same numbers, so the same boxes.
    expected = bev.predict(model, _val_batch(model, synthetic_root, 2))["detections"][0]
    for k, s in enumerate(rec["samples"]):
        z = np.load(s["npz"])
        assert z["det_boxes"].shape == (s["num_boxes"], 9) and z["det_labels"].shape == (s["num_boxes"],)
        assert (np.diff(z["det_scores"]) <= 0).all() and ((z["det_labels"] >= 0) & (z["det_labels"] < 10)).all()
        assert len(s["boxes"]) == int((z["det_scores"] >= 0.1).sum())
        assert all(b["label"] in DETECTION_CLASSES and b["score"] >= 0.1 for b in s["boxes"])
        if k == 0:  # the model's own decoded boxes
            np.testing.assert_allclose(z["det_boxes"], expected["boxes"].numpy(), atol=1e-5)
        assert Image.open(s["png"]).size[0] > 0
    assert Image.open(out / "scene-0103.gif").n_frames == 3
    _check_tracked_velocities(rec["samples"], synthetic_root)
    # The boxes are drawn: the same sample's picture without them differs.
    with_boxes = np.asarray(Image.open(rec["samples"][0]["png"]).convert("RGB"))
    out2 = tmp_path / "pred2"
    args2 = [a if not a.startswith("out=") else f"out={out2}" for a in args]
    assert run_cli(predict_cli._hydra_main, [*args2, "boxes=false", "gif=false"], monkeypatch) == 0
    rec2 = json.loads((out2 / "predictions.json").read_text())
    assert "boxes" not in rec2["samples"][0] and "det_boxes" not in np.load(rec2["samples"][0]["npz"])
    without = np.asarray(Image.open(rec2["samples"][0]["png"]).convert("RGB"))
    assert with_boxes.shape == without.shape and (with_boxes != without).any()


def _check_tracked_velocities(samples, dataroot):
    """bev-predict's boxes carry the velocities bev-eval scores: those of track_velocity over the same boxes in the
    global frame (ego poses from the devkit's tables here), turned back into each sample's ego frame."""
    from nuscenes import NuScenes

    from bev.geometry import quaternion_to_matrix
    from bev.tasks.detection.tracking import TrackVelocity, sample_links, track_velocity

    nusc = NuScenes("v1.0-mini", dataroot=str(dataroot), verbose=False)
    results, ego, heads = {}, {}, {}
    for s in samples:
        z, token = np.load(s["npz"]), s["sample_token"]
        sd = nusc.get("sample_data", nusc.get("sample", token)["data"]["LIDAR_TOP"])
        pose = nusc.get("ego_pose", sd["ego_pose_token"])
        rot, trans = quaternion_to_matrix(pose["rotation"]), np.asarray(pose["translation"])
        centres = z["det_boxes"][:, :3] @ rot.T + trans
        ego[token], heads[token] = rot, z["det_boxes"][:, 7:9]
        results[token] = [
            {
                "translation": c.tolist(),
                "velocity": [0.0, 0.0],
                "detection_name": DETECTION_CLASSES[int(label)],
                "detection_score": float(score),
                "attribute_name": "",
            }
            for c, label, score in zip(centres, z["det_labels"], z["det_scores"])
        ]
    options = TrackVelocity(past_frames=1, gate=6.0, min_past_score=0.0, still_speed=0.0)
    tracked = track_velocity(results, sample_links(nusc), options)
    matched = 0
    for token, boxes in tracked.items():
        for box, head in zip(boxes, heads[token]):
            if box["velocity"] != [0.0, 0.0]:  # a track's: in bev-predict's box, turned into the ego frame
                matched += 1
                np.testing.assert_allclose(head, (np.array([*box["velocity"], 0.0]) @ ego[token])[:2], atol=1e-3)
    assert matched > 10


@pytest.mark.e2e
def test_bev_export_onnx_gives_the_detection_maps(det_run, synthetic_root, tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install 'bev[export]')")
    from bev.inference import onnx_outputs
    from bev.tasks.detection.decode import decode

    path = tmp_path / "det.onnx"
    args = [f"ckpt_path={det_run}", f"out={path}", f"hydra.run.dir={tmp_path / 'r'}"]
    assert run_cli(bev_export._hydra_main, args, monkeypatch) == 0
    model = bev.load_model(det_run)
    batch = _val_batch(model, synthetic_root, 3)  # exported with batch 1: the batch size is dynamic
    inputs = tuple(batch[k] for k in CAMERA_INPUTS)
    with torch.no_grad():
        out = model.net(*inputs)
    expected = {"bev": out["segmentation"], **out["detection"]}
    got = onnx_outputs(path, inputs)
    assert list(got) == ["logits", "heatmap", "regression"]
    assert got["heatmap"].shape == (3, 10, 24, 24) and got["regression"].shape == (3, 6, 10, 24, 24)
    for name, key in (("logits", "bev"), ("heatmap", "heatmap"), ("regression", "regression")):
        assert float((got[name] - expected[key]).abs().max()) <= 1e-3, name
        assert expected[key].std() > 0

    # Decoding stays in Python, on the exported maps. (Box-for-box equality with PyTorch is not asserted: this
    # barely trained model's heatmap is flat to float noise, so peaks and NMS ties flip under 1e-6 changes.)
    boxes = decode(got["heatmap"], got["regression"], model.grid)
    assert len(boxes) == 3 and all(b["boxes"].shape[1] == 9 and len(b["scores"]) > 0 for b in boxes)


@pytest.mark.e2e
@pytest.mark.slow
def test_bev_export_torch_program_gives_the_detection_maps(det_run, synthetic_root, tmp_path, monkeypatch):
    path = tmp_path / "det.pt2"
    args = [f"ckpt_path={det_run}", f"out={path}", "format=torch_export", "batch_size=2", f"hydra.run.dir={tmp_path}"]
    assert run_cli(bev_export._hydra_main, args, monkeypatch) == 0
    model = bev.load_model(det_run)
    batch = _val_batch(model, synthetic_root, 2)
    inputs = tuple(batch[k] for k in CAMERA_INPUTS)
    with torch.no_grad():
        got, expected = torch.export.load(path).module()(*inputs), model.net(*inputs)
    assert sorted(got) == ["heatmap", "logits", "regression"]
    torch.testing.assert_close(got["logits"], expected["segmentation"])
    torch.testing.assert_close(got["heatmap"], expected["detection"]["heatmap"])
    torch.testing.assert_close(got["regression"], expected["detection"]["regression"])


@pytest.mark.e2e
@pytest.mark.parametrize("entry", ["predict", "export"])
def test_boxes_from_a_checkpoint_without_a_detection_head(
    entry, tiny_run, synthetic_root, tmp_path, monkeypatch, capsys
):
    if entry == "predict":
        main, name = predict_cli._hydra_main, "bev-predict"
        args = [f"data.dataroot={synthetic_root}", f"out={tmp_path / 'pred'}"]
    else:
        main, name = bev_export._hydra_main, "bev-export"
        args = [f"out={tmp_path / 'm.onnx'}"]
    args += [f"ckpt_path={tiny_run}", "boxes=true", f"hydra.run.dir={tmp_path / 'r'}"]
    assert run_cli(main, args, monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, f"{name}: error:", "boxes=true", "no detection head", "boxes=auto")
