"""SparseOcc's RayIoU (bev.tasks.occupancy.rayiou): its rays and origins, the ray walk against dense sampling, and
scores computed by hand: the truth as prediction gives 1, an empty prediction 0, a prediction moved by a known distance
hits at the thresholds above that distance only."""

import math

import numpy as np
import pytest
import torch
from test_occupancy_data import occ_root  # noqa: F401 (the synthetic set with Occ3D labels)
from test_occupancy_predict import occ_run  # noqa: F401 (one training step of the CPU occupancy experiment)

from bev.tasks.occupancy.grid import CLASS_ID, FREE, OCC_RANGE, OCC_SHAPE, VOXEL_SIZE
from bev.tasks.occupancy.rayiou import RayIoU, cast_rays, lidar_directions, scene_origins

LIDAR = np.array([0.94, 0.0, 1.84])  # LIDAR_TOP in the ego frame, about where nuScenes mounts it
MANMADE, VEG, ROAD, CAR = CLASS_ID["manmade"], CLASS_ID["vegetation"], CLASS_ID["driveable_surface"], CLASS_ID["car"]


def _empty():
    return np.full(OCC_SHAPE, FREE, np.uint8)


def _street():
    """A road (the ground layer, z in [-0.2, 0.2)), a car ahead and a building on the left."""
    sem = _empty()
    sem[:, :, 2] = ROAD
    sem[120:130, 95:105, 3:7] = CAR
    sem[60:160, 150:170, 3:] = MANMADE
    return sem


def test_lidar_directions_are_sparseoccs():
    d = lidar_directions()
    assert d.shape == (39 * 360, 3)
    np.testing.assert_allclose(np.linalg.norm(d, axis=1), 1, atol=1e-12)
    elevation = np.arcsin(d[:, 2]).reshape(39, 360)
    assert np.ptp(elevation, axis=1).max() < 1e-12  # 360 azimuths per elevation
    slopes = np.tan(elevation[:10, 0])
    np.testing.assert_allclose(slopes, [-1 / k for k in range(1, 11)])  # land 1..10 sensor heights away
    gaps = np.diff(elevation[9:, 0])
    np.testing.assert_allclose(gaps, gaps[0])  # then the last gap, evenly
    assert elevation[-2, 0] < 0.21 <= elevation[-1, 0]  # up to nuScenes's LiDAR field of view (0.2108 rad)
    np.testing.assert_allclose(np.degrees(np.arctan2(d[:360, 1], d[:360, 0])) % 360, np.arange(360), atol=1e-9)


def _yaw(a):
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1.0]])


def test_origins_are_the_scene_lidars_in_the_present_ego_frame():
    # Facing global +y; the next frame is 5 m further on, the last 60 m away (outside the 39 m reach).
    R = np.stack([_yaw(math.pi / 2)] * 3)
    t = np.array([[100.0, 0, 0], [100, 5, 0], [100, 60, 0]])
    lidar = np.tile(LIDAR, (3, 1))
    np.testing.assert_allclose(scene_origins(R, t, lidar, 0), [LIDAR, LIDAR + [5, 0, 0]], atol=1e-12)
    np.testing.assert_allclose(scene_origins(R, t, lidar, 1), [LIDAR - [5, 0, 0], LIDAR], atol=1e-12)
    # Twelve frames 5 m apart along x, all within reach: 8 of them, at round(linspace(0, 11, 8)), in time order.
    R, t = np.stack([np.eye(3)] * 12), np.array([[5.0 * j, 0, 0] for j in range(12)])
    got = scene_origins(R, t, np.tile(LIDAR, (12, 1)), 6)
    picked = [0, 2, 3, 5, 6, 8, 9, 11]
    np.testing.assert_allclose(got, [LIDAR + [5.0 * (j - 6), 0, 0] for j in picked], atol=1e-12)
    with pytest.raises(ValueError, match="not a frame"):
        scene_origins(R, t, np.tile(LIDAR, (12, 1)), 12)


def _dense_first_hits(occ: np.ndarray, origin: np.ndarray, direction: np.ndarray, step=2e-4):
    """Per volume of occ (V, 200, 200, 16): (flat index, exit depth in m) of the ray's first occupied voxel, found by
    sampling the ray every `step` m; (-1, inf) where it meets none."""
    t = np.arange(0, 120, step)
    idx = np.floor((origin + t[:, None] * direction - np.asarray(OCC_RANGE[:3])) / VOXEL_SIZE).astype(np.int64)
    inside = np.all((idx >= 0) & (idx < OCC_SHAPE), axis=1)
    out = np.flatnonzero(~inside & (np.cumsum(inside) > 0))
    n = out[0] if len(out) else len(t)  # the samples before the ray leaves the grid
    flat = np.where(
        inside[:n], np.ravel_multi_index(tuple(np.clip(idx[:n], 0, np.array(OCC_SHAPE) - 1).T), OCC_SHAPE), -1
    )
    found = []
    for vol in occ.reshape(len(occ), -1):
        hits = np.flatnonzero((flat >= 0) & vol[np.maximum(flat, 0)])
        if not len(hits):
            found.append((-1, math.inf))
            continue
        first, after = flat[hits[0]], flat[hits[0] :] != flat[hits[0]]
        last = hits[0] + np.argmax(after) if after.any() else n  # the first sample past that voxel
        found.append((int(first), float(t[last - 1])))
    return found


def test_the_walk_matches_dense_sampling():
    rng = np.random.default_rng(0)
    occ = rng.random((2,) + OCC_SHAPE) < np.array([0.004, 0.02])[:, None, None, None]
    origins = np.array([LIDAR, [-12.3, 20.1, 0.7], [39.5, -39.9, 5.3], [0.0, 0.0, 8.0]])  # the last above the grid
    dirs = rng.normal(size=(24, 3))
    dirs[:12, 2] = -np.abs(dirs[:12, 2])
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    index, depth = cast_rays(torch.from_numpy(occ), origins, dirs)
    assert index.shape == depth.shape == (2, len(origins) * len(dirs))
    for n in range(len(origins) * len(dirs)):
        for v, (want_i, want_d) in enumerate(_dense_first_hits(occ, origins[n // len(dirs)], dirs[n % len(dirs)])):
            assert int(index[v, n]) == want_i, (v, n)
            assert float(depth[v, n]) == pytest.approx(want_d, abs=5e-4)
    assert (index >= 0).any() and (index < 0).any()


def test_the_truth_as_prediction_scores_one_and_an_empty_prediction_zero():
    sem = _street()
    origins = np.array([LIDAR, LIDAR + [8.0, 0, 0], LIDAR - [8.0, 0, 0]])
    acc = RayIoU()
    acc.update(sem, sem, origins)
    s = acc.compute()
    present = [ROAD, CAR, MANMADE]
    np.testing.assert_array_equal(s.iou[:, present], 1)
    assert np.isnan(np.delete(s.iou, present, axis=1)).all()  # classes that neither occur nor are predicted
    assert s.rayiou == 1 and s.per_threshold == [1, 1, 1] and s.rays > 0
    assert s.as_dict() == {"rayiou": 1.0, "rayiou_1m": 1.0, "rayiou_2m": 1.0, "rayiou_4m": 1.0}
    empty = RayIoU()
    empty.update(_empty(), sem, origins)
    assert empty.compute().as_dict() == {"rayiou": 0.0, "rayiou_1m": 0.0, "rayiou_2m": 0.0, "rayiou_4m": 0.0}
    # Only rays that hit something in the truth are scored: a canopy that the prediction adds over the far right
    # corner, where every truth ray leaves the grid unhit, costs nothing.
    sky = sem.copy()
    sky[150:, 0:20, 15] = VEG
    same = RayIoU()
    same.update(sky, sem, origins)
    assert same.compute().rayiou == 1


def _wall_rays():
    """Rays along +x from 2 x 13 origins, at y = -10.2 m (left half) and +10.2 m, z = -0.6 .. 4.2 m at voxel
    centres; the truth: a manmade wall filling x in [20, 20.4) m (voxel row 150). Each ray leaves the wall 20.2 m
    after its origin at x = 0.2 m."""
    ys, zs = (-10.2, 10.2), OCC_RANGE[2] + (np.arange(1, 14) + 0.5) * VOXEL_SIZE
    origins = np.array([[0.2, y, z] for y in ys for z in zs])
    gt = _empty()
    gt[150] = MANMADE
    return origins, np.array([[1.0, 0.0, 0.0]]), gt


def test_a_moved_prediction_hits_at_the_thresholds_above_its_error():
    origins, dirs, gt = _wall_rays()
    index, depth = cast_rays(torch.from_numpy(np.stack([gt != FREE])), origins, dirs)
    np.testing.assert_allclose(depth[0].numpy(), 20.2, atol=1e-9)  # by hand: x 20.4 - 0.2
    # The wall moved 3 voxels (1.2 m) back behind the left origins, 7 voxels (2.8 m) behind the right ones.
    pred = _empty()
    pred[153, :100] = MANMADE
    pred[157, 100:] = MANMADE
    acc = RayIoU(directions=dirs)
    acc.update(pred, gt, origins)
    s = acc.compute()
    n = len(origins)  # rays, all of them manmade in the truth and in the prediction
    assert acc.gt_count[MANMADE] == acc.pred_count[MANMADE] == n
    # TP at 1 m: none; at 2 m: the left half (error 1.2 m); at 4 m: all. IoU = TP / (n + n - TP).
    assert acc.tp[:, MANMADE].tolist() == [0, n // 2, n]
    assert s.iou[:, MANMADE].tolist() == pytest.approx([0, (n / 2) / (2 * n - n / 2), 1])  # 0, 1/3, 1
    assert s.rayiou == pytest.approx((0 + 1 / 3 + 1) / 3)
    # In the right place but the wrong class: a miss for manmade and a false vegetation, at every threshold.
    wrong = RayIoU(directions=dirs)
    wrong.update(np.where(gt == MANMADE, VEG, gt).astype(np.uint8), gt, origins)
    w = wrong.compute()
    assert w.iou[:, [MANMADE, VEG]].tolist() == [[0, 0]] * 3 and w.rayiou == 0


def test_scores_sum_over_samples_and_bad_input_is_refused():
    origins, dirs, gt = _wall_rays()
    near = _empty()
    near[150, :100] = MANMADE  # the left half right, the right half missing
    acc = RayIoU(directions=dirs)
    acc.update(gt, gt, origins)
    acc.update(near, gt, origins)
    n = len(origins)
    assert acc.samples == 2 and acc.gt_count[MANMADE] == 2 * n and acc.pred_count[MANMADE] == n + n // 2
    assert acc.compute().rayiou == pytest.approx((n + n / 2) / (2 * n))
    with pytest.raises(ValueError, match="class ids"):
        acc.update(gt.astype(np.float32), gt, origins)
    with pytest.raises(ValueError, match="must"):
        acc.update(gt[:100], gt, origins)
    with pytest.raises(ValueError, match="one sample at a time"):
        acc.update(np.stack([gt, gt]), np.stack([gt, gt]), origins)
    with pytest.raises(ValueError, match="0..17"):
        acc.update(np.full(OCC_SHAPE, 18, np.uint8), gt, origins)
    with pytest.raises(ValueError, match="thresholds"):
        RayIoU(thresholds=[0, 1])


def _lidar_poses(root):
    """{sample token: (scene name, timestamp, ego -> global R, t, LIDAR_TOP's position in the ego frame)}, read
    from the tables' JSON."""
    import json

    from pyquaternion import Quaternion

    def load(name):
        return json.loads((root / "v1.0-mini" / f"{name}.json").read_text())

    channel = {s["token"]: s["channel"] for s in load("sensor")}
    calib = {c["token"]: c for c in load("calibrated_sensor")}
    ego = {p["token"]: p for p in load("ego_pose")}
    scene = {s["token"]: s["name"] for s in load("scene")}
    sample = {s["token"]: s for s in load("sample")}
    out = {}
    for sd in load("sample_data"):
        c = calib[sd["calibrated_sensor_token"]]
        if sd["is_key_frame"] and channel[c["sensor_token"]] == "LIDAR_TOP":
            p, s = ego[sd["ego_pose_token"]], sample[sd["sample_token"]]
            R = Quaternion(p["rotation"]).rotation_matrix
            out[s["token"]] = (scene[s["scene_token"]], s["timestamp"], R, np.array(p["translation"]), c["translation"])
    return out


def test_bev_eval_prints_and_writes_rayiou(occ_run, occ_root, tmp_path, monkeypatch, capsys):  # noqa: F811
    import json

    from bev.tasks.occupancy.io import labels_path, read_labels, read_prediction
    from helpers.cli import eval_cli

    out = tmp_path / "eval"
    args = [f"ckpt_path={occ_run}", f"data.dataroot={occ_root}", "num_pngs=0"]
    assert eval_cli([*args, f"hydra.run.dir={out}"], monkeypatch) == 0, capsys.readouterr().err[-3000:]
    printed = capsys.readouterr().out
    assert "RayIoU (x 100)" in printed and "RayIoU (mean of the 3 thresholds)" in printed
    rec = json.loads((out / "metrics.json").read_text())
    m = rec["metrics"]
    assert {"rayiou", "rayiou_1m", "rayiou_2m", "rayiou_4m"} <= set(m) and "occ_miou" in m
    assert m["rayiou"] == pytest.approx(np.nanmean([m["rayiou_1m"], m["rayiou_2m"], m["rayiou_4m"]]))
    assert len(rec["rayiou_per_class"]) == 17 and "SparseOcc" in rec["rayiou_metric"]
    # The same from the written files, the label files and the poses in the tables.
    poses = _lidar_poses(occ_root)
    acc = RayIoU()
    for pred_file in sorted((out / "predictions").glob("*.npz")):
        token = pred_file.stem
        name = poses[token][0]
        frames = sorted((p[1], k) for k, p in poses.items() if p[0] == name)
        R, t, lidar = (np.stack([poses[k][j] for _, k in frames]) for j in (2, 3, 4))
        origins = scene_origins(R, t, lidar, [k for _, k in frames].index(token))
        gt = read_labels(labels_path(occ_root, name, token)).semantics
        acc.update(read_prediction(pred_file), gt, origins)
    assert acc.samples == 3 and m["rayiou"] == pytest.approx(acc.compute().rayiou, nan_ok=True)
    assert m["rayiou_1m"] == pytest.approx(acc.compute().per_threshold[0], nan_ok=True)
    # rayiou=false leaves it out.
    assert eval_cli([*args, "rayiou=false", f"hydra.run.dir={tmp_path / 'plain'}"], monkeypatch) == 0
    assert "rayiou" not in json.loads((tmp_path / "plain" / "metrics.json").read_text())["metrics"]
