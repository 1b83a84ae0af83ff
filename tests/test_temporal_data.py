"""Sequence windows and FIERY-style labels (bev.data.temporal, NuScenesBEVDataset(past_frames, future_frames)).

Label checks build small worlds by hand: global boxes and ego poses written into an index of the
reader's layout (boxes in each frame's ego frame), and compare with footprints computed here
directly in the present frame's level (yaw-only) frame and filled by the LSS rule.
Dataset checks use a tiny nuScenes-format set (tests/helpers/tiny_nuscenes.py), whose boxes stand
at fixed ego positions while the ego drives and turns, so every box moves and turns in the world.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from bev.data import NuScenesBEVDataset, NuScenesDataModule, temporal
from bev.data.rasterize import lss_polygon_mask
from bev.geometry import Grid
from helpers.tiny_nuscenes import BOXES, ego_pose, write_tiny

GRID = Grid(xbound=(-25.0, 25.0, 0.5), ybound=(-25.0, 25.0, 0.5))
DT = 0.5  # s between key frames


def rot(yaw: float, pitch: float = 0.0, roll: float = 0.0) -> np.ndarray:
    """Rz(yaw) @ Ry(pitch) @ Rx(roll)."""
    cz, sz, cy, sy, cx, sx = (f(a) for a in (yaw, pitch, roll) for f in (math.cos, math.sin))
    Rz = np.array([[cz, -sz, 0], [sz, cz, 0], [0, 0, 1.0]])
    Ry = np.array([[cy, 0, sy], [0, 1.0, 0], [-sy, 0, cy]])
    Rx = np.array([[1.0, 0, 0], [0, cx, -sx], [0, sx, cx]])
    return Rz @ Ry @ Rx


def make_index(poses: list[tuple], frames: list[list[tuple]]) -> dict[str, np.ndarray]:
    """A split index (the reader's layout) of one scene.

    poses: per frame (x, y, yaw[, pitch, roll]) of the ego in the world; frames: per frame a list of boxes
    (token, x, y, yaw, (w, l, h), visibility) in the world, standing on the ground (z = 0)."""
    idx = {
        k: []
        for k in (
            "ego_rotation",
            "ego_translation",
            "box_center",
            "box_size",
            "box_rotation",
            "box_visibility",
            "box_instance",
        )
    }
    offsets = [0]
    for pose, boxes in zip(poses, frames):
        R, t = rot(*pose[2:]), np.array([pose[0], pose[1], 0.0])
        idx["ego_rotation"].append(R)
        idx["ego_translation"].append(t)
        for tok, x, y, yaw, size, vis in boxes:
            idx["box_center"].append(R.T @ (np.array([x, y, size[2] / 2]) - t))
            idx["box_rotation"].append(R.T @ rot(yaw))
            idx["box_size"].append(size)
            idx["box_visibility"].append(vis)
            idx["box_instance"].append(tok.encode())
        offsets.append(len(idx["box_instance"]))
    out = {
        k: np.asarray(v, dtype=np.float64).reshape(-1, *np.shape(v)[1:])
        for k, v in idx.items()
        if k not in ("box_visibility", "box_instance")
    }
    out["box_center"], out["box_size"] = out["box_center"].reshape(-1, 3), out["box_size"].reshape(-1, 3)
    out["box_rotation"] = out["box_rotation"].reshape(-1, 3, 3)
    out["box_visibility"] = np.asarray(idx["box_visibility"], dtype=np.uint8)
    out["box_instance"] = np.asarray(idx["box_instance"], dtype=bytes)
    out["box_offsets"] = np.asarray(offsets, dtype=np.int64)
    return out


def level_corners(box: tuple, pose: tuple) -> np.ndarray:
    """(4, 2) footprint of a world box in the level frame of an ego pose, computed in 2D."""
    _, x, y, yaw, (w, l, _h), _ = box
    c, s = math.cos(yaw), math.sin(yaw)
    local = np.array([[l / 2, w / 2], [-l / 2, w / 2], [-l / 2, -w / 2], [l / 2, -w / 2]])
    world = local @ np.array([[c, s], [-s, c]]) + [x, y]
    c, s = math.cos(pose[2]), math.sin(pose[2])
    return (world - pose[:2]) @ np.array([[c, -s], [s, c]])  # rows: Rz(yaw)^T (p - t)


def direct_mask(box: tuple, pose: tuple, grid: Grid = GRID) -> np.ndarray:
    return lss_polygon_mask(level_corners(box, pose), grid)


def boundary_distance(box: tuple, pose: tuple, cells: np.ndarray, grid: Grid = GRID) -> np.ndarray:
    """Distance (cells) from the centres of `cells` (K, 2) to the box outline in the pose's level frame."""
    poly = level_corners(box, pose)
    p = np.stack(
        [grid.xbound[0] + (cells[:, 0] + 0.5) * grid.xbound[2], grid.ybound[0] + (cells[:, 1] + 0.5) * grid.ybound[2]],
        1,
    )
    d = np.full(len(p), np.inf)
    for a, b in zip(poly, np.roll(poly, -1, 0)):
        u = np.clip(((p - a) @ (b - a)) / ((b - a) @ (b - a)), 0, 1)
        d = np.minimum(d, np.linalg.norm(p - (a + u[:, None] * (b - a)), axis=1))
    return d / grid.xbound[2]


# ---------------------------------------------------------------- window index and bad input


def brute_windows(scenes: list[str], length: int) -> list[int]:
    return [s for s in range(len(scenes) - length + 1) if len(set(scenes[s : s + length])) == 1]


@pytest.mark.parametrize("past,future", [(0, 1), (1, 1), (2, 4), (3, 0)])
def test_windows_never_cross_scenes_and_skip_short_ones(past, future):
    scenes = ["a"] * 7 + ["b"] * 2 + ["c"] * 4 + ["d"] * 1 + ["e"] * 5
    starts, short = temporal.window_index(np.asarray(scenes), past, future)
    length = past + 1 + future
    assert starts.tolist() == brute_windows(scenes, length)
    assert short == [s for s in "abcde" if scenes.count(s) < length]


def test_window_longer_than_every_scene_and_negative_counts_are_one_clear_error():
    with pytest.raises(
        ValueError, match=r"= 8 key frames is longer than every scene of the split \(the longest has 7\)"
    ):
        temporal.window_index(np.asarray(["a"] * 7 + ["b"] * 3), 3, 4)
    for past, future, what in [
        (-1, 0, "past_frames"),
        (0, -2, "future_frames"),
        (1.5, 0, "past_frames"),
        (0, "2", "future_frames"),
    ]:
        with pytest.raises(ValueError, match=f"data.{what} must be"):
            temporal.check_frames(past, future)
    assert temporal.check_frames(np.int64(2), 4) == (2, 4)
    with pytest.raises(ValueError, match="unknown data.label_warp 'nearest'"):
        temporal.check_label_warp("nearest")


# ---------------------------------------------------------------- ego motion


def test_future_egomotion_maps_frame_t_points_into_frame_t_plus_1():
    poses = [(10.0, 5.0, 0.3), (14.0, 7.5, 0.45), (17.0, 11.0, 0.7), (19.0, 15.0, 1.0)]
    R = np.stack([rot(p[2]) for p in poses])
    t = np.array([[p[0], p[1], 0.0] for p in poses])
    ego = temporal.future_egomotion(R, t)
    assert ego.shape == (4, 4, 4) and ego.dtype == np.float32
    assert np.array_equal(ego[-1], np.eye(4, dtype=np.float32))
    pts = np.random.default_rng(0).uniform(-30, 30, (20, 3)) * [1, 1, 0]
    for k in range(3):
        world = pts @ R[k].T + t[k]
        expected = (world - t[k + 1]) @ R[k + 1]  # rows: R^T (p - t)
        moved = np.c_[pts, np.ones(20)] @ ego[k].T.astype(np.float64)
        np.testing.assert_allclose(moved[:, :3], expected, atol=1e-4)


def test_future_egomotion_keeps_x_y_yaw_only():
    R = np.stack([rot(0.2, 0.05, -0.03), rot(0.5, -0.02, 0.04)])
    t = np.array([[0.0, 0.0, 0.0], [4.0, 1.0, 0.3]])
    e = temporal.future_egomotion(R, t)[0].astype(np.float64)
    M = np.linalg.inv(np.block([[R[1], t[1][:, None]], [np.zeros((1, 3)), 1]])) @ np.block(
        [[R[0], t[0][:, None]], [np.zeros((1, 3)), 1]]
    )
    a = math.atan2(-M[0, 1], M[0, 0])  # FIERY's rz
    expected = np.eye(4)
    expected[:2, :2] = [[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]]
    expected[:2, 3] = M[:2, 3]
    np.testing.assert_allclose(e, expected, atol=1e-6)


# ---------------------------------------------------------------- labels: warp, ids, centres, flow


def turning_drive(n: int = 5, pitch: float = 0.0) -> list[tuple]:
    """Ego poses of a car at 8 m/s turning left at 0.25 rad/s (plus a little pitch and roll)."""
    poses, x, y, yaw = [], 100.0, 50.0, 0.4
    for k in range(n):
        poses.append((x, y, yaw, pitch * (-1) ** k, -pitch / 2))
        x, y = x + 8 * DT * math.cos(yaw + 0.0625), y + 8 * DT * math.sin(yaw + 0.0625)
        yaw += 0.25 * DT
    return poses


STATIC = [  # (token, x, y, yaw, (w, l, h), visibility): world boxes in view of every frame of turning_drive
    ("plaza", 108.0, 56.0, 0.7, (20.0, 24.0, 0.5), 4),  # the drive crosses it
    ("truck", 118.3, 43.8, 1.2, (3.0, 12.0, 3.5), 3),
    ("car", 97.7, 68.2, -0.5, (1.9, 4.6, 1.6), 2),
    ("van", 104.0, 72.0, 2.0, (2.2, 5.5, 2.2), 4),
]


@pytest.mark.parametrize("pitch", [0.0, 0.04])
def test_static_world_warped_labels_equal_rasterising_in_the_present_frame(pitch):
    poses = turning_drive(6, pitch)
    labels = temporal.window_labels(make_index(poses, [STATIC] * 6), np.arange(6), 1, GRID)
    inst = labels["instance"]
    assert inst.shape == (5, 100, 100) and inst.dtype == np.int64
    present = poses[1]
    big_inter = big_union = 0
    for k, box in enumerate(STATIC, start=1):
        want = direct_mask(box, present)
        assert np.array_equal(inst[0] == k, want), box[0]  # the present frame is drawn, not warped
        for t in range(1, 5):
            got = inst[t] == k
            # A cell differs only by rounding: the LSS rule decides a cell by its corner point (half a
            # cell diagonal, 0.71, from its centre, turned by the yaw between the frames), corners are
            # rounded (<= 0.71) and the nearest warp moves a centre by <= 0.71: within 2.2 cells.
            diff = np.argwhere(got ^ want)
            assert boundary_distance(box, present, diff).max(initial=0) <= 2.2, (box[0], t)
            if box[0] == "plaza":  # rounding touches the outline only: a large area's IoU stays high
                big_inter, big_union = big_inter + (got & want).sum(), big_union + (got | want).sum()
    assert big_inter / big_union >= 0.95


def test_fiery_warp_reproduces_its_lateral_sign_error():
    """FIERY's warp_features samples at (-tx, +ty) for a translation (tx, ty) (checked against its code by
    scripts/check_labels_vs_fiery.py): a lateral ego step of ty moves its future labels by -2 ty."""
    poses = [(50.0, 20.0, 0.0), (54.0, 21.5, 0.0)]  # a pure translation: 4 m forward, 1.5 m left
    boxes = [("a", 60.0, 18.0, 0.3, (2.0, 5.0, 1.5), 4), ("b", 40.0, 30.0, 0.0, (3.0, 3.0, 2.0), 4)]
    index = make_index(poses, [boxes] * 2)
    exact = temporal.window_labels(index, np.arange(2), 0, GRID)["instance"][1]
    fiery = temporal.window_labels(index, np.arange(2), 0, GRID, label_warp="fiery")["instance"][1]
    assert np.array_equal(exact, temporal.window_labels(index, np.arange(2), 0, GRID)["instance"][0])
    shift = round(2 * 1.5 / GRID.ybound[2])
    assert np.array_equal(fiery[:, :-shift], exact[:, shift:]) and (exact > 0).sum() > 50


def test_ids_follow_first_appearance_over_the_window_and_the_visibility_filter():
    def car(tok, x, vis=4):
        return tok, x, 0.0, 0.0, (2.0, 4.0, 1.5), vis

    pose = [(0.0, 0.0, 0.0)] * 4
    frames = [
        [car("old", -10)],
        [car("hid", 10, 1), car("b", 0)],
        [car("b", 0), car("hid", 10, 3)],
        [car("hid", 10), car("c", -18)],
    ]
    index = make_index(pose, frames)

    def ids(labels):
        return [sorted(set(np.unique(m).tolist()) - {0}) for m in labels["instance"]]

    plain = temporal.window_labels(index, np.arange(4), 1, GRID)
    # "old" (id 1) is only in the past frame: numbered, not drawn; "hid" appears before "b" (annotation order)
    assert ids(plain) == [[2, 3], [2, 3], [2, 4]]
    filtered = temporal.window_labels(index, np.arange(4), 1, GRID, filter_invisible=True)
    assert ids(filtered) == [[2], [2, 3], [3, 4]]  # its level-1 box dropped, "hid" is numbered after "b"
    assert np.array_equal(filtered["segmentation"], (filtered["instance"] > 0).astype(np.int64))


def fiery_centres(instance: np.ndarray, sigma: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
    """FIERY's centerness and offset of one instance map, over the whole grid (its definition, in float64)."""
    X, Y = instance.shape
    x, y = np.meshgrid(np.arange(X, dtype=np.float64), np.arange(Y, dtype=np.float64), indexing="ij")
    centre = np.zeros((1, X, Y))
    offset = np.full((2, X, Y), 255.0)
    for k in range(1, instance.max() + 1):
        m = instance == k
        if not m.any():
            continue
        xc, yc = np.round(x[m].mean()), np.round(y[m].mean())
        centre[0] = np.maximum(centre[0], np.exp(-((xc - x) ** 2 + (yc - y) ** 2) / sigma**2))
        offset[0][m], offset[1][m] = (xc - x)[m], (yc - y)[m]
    return centre.astype(np.float32), offset.astype(np.float32)


def test_centerness_and_offset_are_fierys():
    inst = np.zeros((2, 90, 80), np.int64)  # larger than CENTER_RADIUS: the cut-off Gaussian is checked too
    inst[0, 3:9, 5:12] = 1  # centre (5.5, 8) -> rounded half to even: (6, 8)
    inst[0, 30:38, 70:80] = 3  # touches the border
    inst[0, 20:23, 20:21] = 2
    inst[1, 80:85, 2:9] = 3
    centerness, offset = temporal.centre_targets(inst)
    assert centerness.shape == (2, 1, 90, 80) and offset.shape == (2, 2, 90, 80)
    assert centerness.dtype == offset.dtype == np.float32
    for t in range(2):
        want_c, want_o = fiery_centres(inst[t])
        assert np.array_equal(centerness[t], want_c) and np.array_equal(offset[t], want_o)
    assert centerness[0, 0, 6, 8] == 1 and offset[0, :, 3, 5].tolist() == [3, 3]
    assert np.array_equal(temporal.centre_targets(np.zeros((1, 4, 4), np.int64))[1], np.full((1, 2, 4, 4), 255))


def test_a_straight_line_movers_flow_is_its_velocity_times_half_a_second():
    poses = turning_drive(5)
    v = np.array([6.0, -3.0])  # m/s in the world
    start = np.array([100.0, 64.0])
    frames = []
    for k in range(5):
        x, y = start + v * DT * k
        frames.append(
            [("mover", x, y, math.atan2(v[1], v[0]), (2.0, 4.5, 1.6), 4), STATIC[1]]
            + ([("leaver", 95.0, 48.0, 0.0, (2.0, 4.0, 1.5), 4)] if k < 2 else [])
        )
    labels = temporal.window_labels(make_index(poses, frames), np.arange(5), 1, GRID)
    inst, flow = labels["instance"], labels["flow"]
    assert flow.shape == (4, 2, 100, 100) and flow.dtype == np.float32
    a = poses[1][2]
    want = np.array([[math.cos(a), math.sin(a)], [-math.sin(a), math.cos(a)]]) @ v * DT / GRID.xbound[2]
    for t in range(3):
        cells = inst[t] == 1
        assert cells.sum() > 20
        np.testing.assert_allclose(flow[t][:, cells].T, np.broadcast_to(want, (cells.sum(), 2)), atol=1e-4)
        np.testing.assert_allclose(flow[t][:, inst[t] == 2], 0, atol=1e-4)  # static: the ego motion is removed
    assert (flow[0][:, inst[0] == 3] == 255).all()  # "leaver" has no box at t + 1
    assert (flow[:, :, inst[0] == 0][0] == 255).all() and (flow[-1] == 255).all()
    assert (labels["offset"][:, :, inst[0] == 0][0] == 255).all()


# ---------------------------------------------------------------- the dataset on a hand-made set


@pytest.fixture(scope="module")
def tiny_windows(tmp_path_factory) -> Path:
    """The tiny set with 5 key frames a scene, scene-0103 renamed into mini_train and cut to 2 key frames."""
    root = write_tiny(tmp_path_factory.mktemp("tiny_windows") / "nuscenes", samples=5, with_map=False)
    tables = root / "v1.0-mini"
    scenes = json.loads((tables / "scene.json").read_text())
    scenes[1].update(name="scene-0553", nbr_samples=2, last_sample_token="s1-1")
    (tables / "scene.json").write_text(json.dumps(scenes))
    samples = [
        s for s in json.loads((tables / "sample.json").read_text()) if s["token"] not in ("s1-2", "s1-3", "s1-4")
    ]
    next(s for s in samples if s["token"] == "s1-1")["next"] = ""
    (tables / "sample.json").write_text(json.dumps(samples))
    kept = {}
    for name in ("sample_data", "sample_annotation"):
        rows = json.loads((tables / f"{name}.json").read_text())
        rows = [r for r in rows if r["sample_token"] not in ("s1-2", "s1-3", "s1-4")]
        kept[name] = {r["token"]: r for r in rows}
        for r in rows:  # the chains end at the cut, as in a consistent set
            r["next"] = r["next"] if r["next"] in kept[name] or not r["next"] else ""
        (tables / f"{name}.json").write_text(json.dumps(rows))
    instances = json.loads((tables / "instance.json").read_text())
    for inst in instances:
        anns = [a for a in kept["sample_annotation"].values() if a["instance_token"] == inst["token"]]
        inst["nbr_annotations"] = len(anns)
        inst["last_annotation_token"] = next(a["token"] for a in anns if not a["next"])
    (tables / "instance.json").write_text(json.dumps(instances))
    return root


def _ds(root, **kw):
    kw.setdefault("verbose", False)
    return NuScenesBEVDataset(root, split="mini_train", grid=GRID, final_dim=(64, 176), **kw)


def test_dataset_windows_stay_in_their_scene_and_count_the_skipped(tiny_windows, tmp_path, capsys):
    ds = _ds(tiny_windows, past_frames=0, future_frames=1, cache_dir=tmp_path)
    tokens = [ds[w]["sample_tokens"] for w in range(len(ds))]
    assert tokens == [["s0-0", "s0-1"], ["s0-1", "s0-2"], ["s0-2", "s0-3"], ["s0-3", "s0-4"], ["s1-0", "s1-1"]]
    assert "skipped" not in capsys.readouterr().err
    ds = _ds(tiny_windows, past_frames=1, future_frames=2, cache_dir=tmp_path)
    assert [ds[w]["sample_tokens"] for w in range(len(ds))] == [[f"s0-{k}" for k in range(s, s + 4)] for s in (0, 1)]
    assert "mini_train: skipped 1 of 2 scenes shorter than a window of 4 key frames" in capsys.readouterr().err
    with pytest.raises(ValueError, match="longer than every scene of the split"):
        _ds(tiny_windows, past_frames=2, future_frames=3, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="data.past_frames must be >= 0"):
        _ds(tiny_windows, past_frames=-1, cache_dir=tmp_path)
    with pytest.raises(IndexError, match="window index 2 out of range for 2 windows"):
        ds[2]


def test_zero_frames_keep_single_frame_items(tiny_windows, tmp_path):
    default, zero = (
        _ds(tiny_windows, cache_dir=tmp_path),
        _ds(tiny_windows, past_frames=0, future_frames=0, cache_dir=tmp_path),
    )
    assert len(default) == len(zero) == 7 and not zero.temporal
    a, b = default[6], zero[6]
    assert (
        list(a)
        == [
            "images",
            "intrinsics",
            "rots",
            "trans",
            "post_rots",
            "post_trans",
            "cam_ids",
            "bev",
            "visibility",
            "bev_bounds",
            "sample_token",
        ]
        == list(b)
    )
    assert all(torch.equal(a[k], b[k]) for k in a if k != "sample_token") and a["sample_token"] == "s1-1"


def test_dataset_window_keys_shapes_and_dtypes(tiny_windows, tmp_path):
    ds = _ds(tiny_windows, past_frames=1, future_frames=2, cache_dir=tmp_path, depth_target=True)
    item = ds[1]
    X, Y = GRID.bev_shape
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in item.items() if isinstance(v, torch.Tensor)}
    assert shapes == {
        "images": ((2, 6, 3, 64, 176), torch.float32),
        "intrinsics": ((2, 6, 3, 3), torch.float32),
        "rots": ((2, 6, 3, 3), torch.float32),
        "trans": ((2, 6, 3), torch.float32),
        "post_rots": ((2, 6, 3, 3), torch.float32),
        "post_trans": ((2, 6, 3), torch.float32),
        "depth": ((2, 6, 4, 11), torch.int64),
        "cam_ids": ((6,), torch.int64),
        "bev": ((1, X, Y), torch.float32),
        "visibility": ((X, Y), torch.uint8),
        "bev_bounds": ((2, 3), torch.float64),
        "future_egomotion": ((4, 4, 4), torch.float32),
        "instance": ((3, X, Y), torch.int64),
        "segmentation": ((3, X, Y), torch.int64),
        "centerness": ((3, 1, X, Y), torch.float32),
        "offset": ((3, 2, X, Y), torch.float32),
        "flow": ((3, 2, X, Y), torch.float32),
    }
    assert item["sample_tokens"] == ["s0-1", "s0-2", "s0-3", "s0-4"] and item["sample_token"] == "s0-2"


def test_dataset_present_frame_keys_equal_the_single_frame_item(tiny_windows, tmp_path):
    single = _ds(tiny_windows, cache_dir=tmp_path, depth_target=True, raster="lss")
    ds = _ds(tiny_windows, past_frames=2, future_frames=1, cache_dir=tmp_path, depth_target=True, raster="lss")
    item = ds[0]
    for pos, token in enumerate(item["sample_tokens"][:3]):
        ref = single[int(np.flatnonzero(single.index["sample_token"] == token)[0])]
        for key in ("images", "intrinsics", "rots", "trans", "post_rots", "post_trans", "depth"):
            assert torch.equal(item[key][pos], ref[key]), (key, pos)
        if pos == 2:
            for key in ("bev", "visibility", "bev_bounds", "cam_ids"):
                assert torch.equal(item[key], ref[key]), key
            assert item["sample_token"] == ref["sample_token"] == token


def test_dataset_labels_follow_the_moving_boxes(tiny_windows, tmp_path):
    """tiny boxes ride at fixed ego positions: in the world they move and turn with the ego."""
    ds = _ds(tiny_windows, past_frames=1, future_frames=3, cache_dir=tmp_path, categories=["vehicle."])
    item = ds[0]  # s0-0 .. s0-4, present s0-1
    poses = [(*ego_pose(0, k)[0][:2], ego_pose(0, k)[1]) for k in range(5)]
    vehicles = [b for b in BOXES if b[0].startswith("vehicle.")]

    def world_box(b, k):
        (x, y, _), yaw = ego_pose(0, k)
        c, s = math.cos(yaw), math.sin(yaw)
        return (b[0], x + c * b[1] - s * b[2], y + s * b[1] + c * b[2], yaw + b[3], b[4], 4)

    inst, flow, present = item["instance"].numpy(), item["flow"].numpy(), poses[1]
    ego = item["future_egomotion"].numpy().astype(np.float64)
    for k in range(3):
        expected = (
            np.linalg.inv(np.c_[np.r_[rot(poses[k + 1][2]), [[0, 0, 0]]], [*poses[k + 1][:2], 0, 1]])
            @ np.c_[np.r_[rot(poses[k][2]), [[0, 0, 0]]], [*poses[k][:2], 0, 1]]
        )
        np.testing.assert_allclose(ego[k], expected, atol=1e-5)
    for j, b in enumerate(vehicles, start=1):  # ids in annotation order (the first frame holds every box)
        for t in range(4):
            box = world_box(b, t + 1)
            diff = np.argwhere((inst[t] == j) ^ direct_mask(box, present))
            assert boundary_distance(box, present, diff).max(initial=0) <= 2.2, (b[0], t)
            if t < 3:
                a = present[2]
                motion = np.array(world_box(b, t + 2)[1:3]) - box[1:3]
                want = np.array([[math.cos(a), math.sin(a)], [-math.sin(a), math.cos(a)]]) @ motion / 0.5
                np.testing.assert_allclose(flow[t][:, inst[t] == j].T - want, 0, atol=1e-3)


def test_training_windows_share_each_cameras_augmentation(tiny_windows, tmp_path):
    ds = _ds(tiny_windows, past_frames=2, future_frames=0, cache_dir=tmp_path, augment=True, ncams=4)
    torch.manual_seed(0)
    item = ds[0]
    assert item["images"].shape[:2] == (3, 4) and item["cam_ids"].shape == (4,)
    for key in ("post_rots", "post_trans"):
        assert all(torch.equal(item[key][t], item[key][0]) for t in (1, 2))
    assert len({tuple(item["post_trans"][0, c].tolist()) for c in range(4)}) == 4  # one draw per camera


def test_each_jpeg_of_a_window_is_decoded_once_and_val_windows_share_the_memo(tiny_windows, tmp_path, monkeypatch):
    calls = []
    ds = _ds(tiny_windows, past_frames=2, future_frames=1, cache_dir=tmp_path, input_memo_mb=64)
    decode = ds.decode_image
    monkeypatch.setattr(ds, "decode_image", lambda i, cam, *a: calls.append((i, cam)) or decode(i, cam, *a))
    ds[0]
    assert sorted(calls) == [(i, c) for i in range(3) for c in range(6)]  # the future frame needs no image
    calls.clear()
    ds[1]  # frames 1..3 as inputs: only frame 3 is new
    assert sorted(calls) == [(3, c) for c in range(6)]
    train = _ds(tiny_windows, past_frames=2, future_frames=1, cache_dir=tmp_path, augment=True)
    decode_t = train.decode_image
    monkeypatch.setattr(train, "decode_image", lambda i, cam, *a: calls.append((i, cam)) or decode_t(i, cam, *a))
    calls.clear()
    train[0]
    assert sorted(calls) == [(i, c) for i in range(3) for c in range(6)]


def test_collate_stacks_windows_and_keeps_token_lists(tiny_windows, tmp_path):
    ds = _ds(tiny_windows, past_frames=0, future_frames=1, cache_dir=tmp_path)
    batch = next(iter(DataLoader(ds, batch_size=2, collate_fn=temporal.collate)))
    assert batch["sample_tokens"] == [["s0-0", "s0-1"], ["s0-1", "s0-2"]]
    assert batch["images"].shape == (2, 1, 6, 3, 64, 176) and batch["instance"].shape == (2, 2, 100, 100)
    assert batch["sample_token"] == ["s0-0", "s0-1"] and batch["future_egomotion"].shape == (2, 2, 4, 4)
    single = _ds(tiny_windows, cache_dir=tmp_path)
    items = [single[0], single[1]]
    a, b = temporal.collate(items), default_collate(items)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


def test_datamodule_passes_the_frame_counts_and_collates(tiny_windows, tmp_path):
    dm = NuScenesDataModule(
        tiny_windows,
        train_split="mini_train",
        val_split="mini_train",
        grid=GRID,
        final_dim=(64, 176),
        past_frames=1,
        future_frames=1,
        filter_invisible=True,
        batch_size=2,
        num_workers=0,
        cache_dir=tmp_path,
    )
    batch = next(iter(dm.train_dataloader()))
    assert batch["images"].shape[:3] == (2, 2, 6) and batch["instance"].shape == (2, 2, 100, 100)
    assert all(len(t) == 3 for t in batch["sample_tokens"])
    assert dm.train_set.filter_invisible and dm.train_set.augment and not dm.val_set.augment
    val = next(iter(dm.val_dataloader()))
    assert val["sample_tokens"] == [["s0-0", "s0-1", "s0-2"], ["s0-1", "s0-2", "s0-3"]]


def test_data_config_states_the_frame_defaults_once():
    import dataclasses

    import yaml

    from bev.data.config import DataConfig

    configs = Path(__file__).resolve().parents[1] / "configs" / "data"
    keys = ("past_frames", "future_frames", "filter_invisible", "label_warp")
    defaults = {f.name: f.default for f in dataclasses.fields(DataConfig)}
    assert [defaults[k] for k in keys] == [0, 0, False, "exact"]
    for name in ("nuscenes", "synthetic"):
        stated = yaml.safe_load((configs / f"{name}.yaml").read_text())
        assert not set(keys) & set(stated), name


def test_synthetic_set_windows(synthetic_root, tmp_path):
    ds = NuScenesBEVDataset(
        synthetic_root, split="mini_val", past_frames=1, future_frames=1, cache_dir=tmp_path, verbose=False
    )
    assert len(ds) == 1
    item = ds[0]
    assert item["instance"].shape == (2, 200, 200) and (item["instance"][0] > 0).any()
    defined, on = item["flow"][0, 0] != 255, item["instance"][0] > 0
    assert not (defined & ~on).any() and defined.sum() > 0.5 * on.sum()  # off the vehicles: never
    with pytest.raises(ValueError, match="longer than every scene"):
        NuScenesBEVDataset(
            synthetic_root, split="mini_val", past_frames=2, future_frames=1, cache_dir=tmp_path, verbose=False
        )


def test_windows_need_no_devkit_once_indexed(tiny_windows, tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_windows, copy)
    _ds(copy, cache_dir=tmp_path / "cache")  # builds and caches the split index
    import nuscenes.nuscenes

    monkeypatch.setattr(nuscenes.nuscenes, "NuScenes", None)  # any devkit use now fails
    ds = _ds(copy, past_frames=1, future_frames=1, cache_dir=tmp_path / "cache")
    assert len(ds) == 3 and ds[2]["sample_tokens"] == ["s0-2", "s0-3", "s0-4"]
