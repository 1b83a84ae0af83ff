"""bev.tasks.detection.nusc_eval against the devkit itself: the devkit's ground truth, taken into our ego frame
here (matrices, independent of to_results' quaternion product) and back through to_results, scored by
DetectionEval on the synthetic set's mini_val (scene-0103 of the session's `synthetic_root`).

Classes absent from that val get AP 0 from the devkit, so mAP is below 1 there: per-class checks use
the classes present, and mAP / NDS are checked against their definitions from the per-class numbers."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from bev.classes import DETECTION_CLASSES
from bev.geometry import quaternion_to_matrix
from bev.tasks.detection import nusc_eval
from bev.tasks.detection.nusc_eval import evaluate, format_table, to_results, write_results

VERSION, SPLIT = "v1.0-mini", "mini_val"


def _ego_pose(nusc, token):
    sample = nusc.get("sample", token)
    pose = nusc.get("ego_pose", nusc.get("sample_data", sample["data"]["LIDAR_TOP"])["ego_pose_token"])
    return np.array(pose["rotation"]), np.array(pose["translation"])


@pytest.fixture(scope="module")
def truth(nusc):
    """The devkit's GT of mini_val that it scores (points > 0, inside the class ranges), in our ego frame.

    Returns (tokens, per-sample dict of boxes / labels / ego pose, per-sample global GT boxes)."""
    from nuscenes.eval.common.config import config_factory
    from nuscenes.eval.common.loaders import add_center_dist, filter_eval_boxes, load_gt
    from nuscenes.eval.detection.data_classes import DetectionBox

    gt = load_gt(nusc, SPLIT, DetectionBox)
    gt = filter_eval_boxes(nusc, add_center_dist(nusc, gt), config_factory("detection_cvpr_2019").class_range)
    tokens = [s["token"] for s in nusc.sample if nusc.get("scene", s["scene_token"])["name"] == "scene-0103"]
    assert sorted(tokens) == sorted(gt.sample_tokens)
    ego = {}
    for t in tokens:
        q, tr = _ego_pose(nusc, t)
        r_inv = quaternion_to_matrix(q).T
        rows, labels = [], []
        for b in gt[t]:
            heading = r_inv @ quaternion_to_matrix(b.rotation)[:, 0]  # the box's length axis in the ego frame
            vel = np.nan_to_num(np.array([*b.velocity, 0.0]))  # NaN: no speed known, the devkit ignores it
            rows.append(
                [
                    *(r_inv @ (np.array(b.translation) - tr)),
                    *b.size,
                    math.atan2(heading[1], heading[0]),
                    *(r_inv @ vel)[:2],
                ]
            )
            labels.append(DETECTION_CLASSES.index(b.detection_name))
        ego[t] = {"boxes": np.array(rows).reshape(-1, 9), "labels": np.array(labels, dtype=int), "pose": (q, tr)}
    return tokens, ego, gt


def _scores(truth):
    """Distinct scores, decreasing over all boxes in sample order; boxes whose true velocity is NaN last."""
    tokens, ego, gt = truth
    nan_vel = {t: np.array([np.isnan(b.velocity).any() for b in gt[t]], dtype=bool) for t in tokens}
    order = [(t, i) for t in tokens for i in np.flatnonzero(~nan_vel[t])] + [
        (t, i) for t in tokens for i in np.flatnonzero(nan_vel[t])
    ]
    scores = {t: np.zeros(len(ego[t]["labels"])) for t in tokens}
    for rank, (t, i) in enumerate(order):
        scores[t][i] = 1.0 - rank / (len(order) + 1)
    return scores


def _results(truth, edit=lambda boxes: boxes):
    tokens, ego, _ = truth
    scores = _scores(truth)
    return to_results(
        tokens,
        [edit(ego[t]["boxes"].copy()) for t in tokens],
        [scores[t] for t in tokens],
        [ego[t]["labels"] for t in tokens],
        [ego[t]["pose"][0] for t in tokens],
        [ego[t]["pose"][1] for t in tokens],
    )


def _present(truth):
    _, _, gt = truth
    return sorted({b.detection_name for b in gt.all})


def _near_range_edge(truth, margin):
    """The classes with a true box within `margin` of its class range (the devkit drops predictions past it)."""
    from nuscenes.eval.common.config import config_factory

    ranges = config_factory("detection_cvpr_2019").class_range
    _, _, gt = truth
    return {b.detection_name for t in gt.sample_tokens for b in gt[t] if b.ego_dist > ranges[b.detection_name] - margin}


def _apart(truth, distance):
    """The classes whose true boxes are more than `distance` apart (xy) in every sample."""
    tokens, _, gt = truth
    out = set(_present(truth))
    for t in tokens:
        for c in list(out):
            xy = np.array([b.translation[:2] for b in gt[t] if b.detection_name == c]).reshape(-1, 2)
            d = np.linalg.norm(xy[:, None] - xy[None], axis=-1) + np.eye(len(xy)) * 1e9
            if (d <= distance).any():
                out.discard(c)
    return out


def _score(results, synthetic_root, tmp_path, nusc):
    metrics = evaluate(results, synthetic_root, VERSION, SPLIT, tmp_path, nusc=nusc)
    summary = json.loads((tmp_path / "metrics_summary.json").read_text())
    return metrics, summary


def test_synthetic_val_has_boxes_to_score(truth):
    _, _, gt = truth
    assert len(gt.all) >= 50 and {"car", "pedestrian"} <= set(_present(truth))


def test_to_results_round_trips_the_devkit_ground_truth(truth):
    tokens, _, gt = truth
    results = _results(truth)
    assert list(results) == tokens
    for t in tokens:
        got = sorted(results[t], key=lambda b: -b["detection_score"])
        want = [gt[t][i] for i in np.argsort(-_scores(truth)[t], kind="stable")]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g["detection_name"] == w.detection_name and g["sample_token"] == t
            np.testing.assert_allclose(g["translation"], w.translation, atol=1e-9)
            np.testing.assert_allclose(g["size"], w.size, atol=1e-12)
            np.testing.assert_allclose(g["velocity"], np.nan_to_num(np.array(w.velocity)), atol=1e-9)
            assert abs(np.dot(g["rotation"], w.rotation)) == pytest.approx(1, abs=1e-9)  # q and -q: one rotation


def test_attribute_rule():
    """mmdet3d's nuScenes rule: moving above 0.2 m/s; a still bus is stopped, other still vehicles parked."""
    boxes = np.array([[0, 0, 0, 1, 2, 1, 0, vx, 0] for vx in (0.1, 0.3)] * 4, dtype=float)
    labels = [
        DETECTION_CLASSES.index(c)
        for c in ("car", "car", "bus", "bus", "bicycle", "bicycle", "pedestrian", "pedestrian")
    ]
    labels += [DETECTION_CLASSES.index("barrier"), DETECTION_CLASSES.index("traffic_cone")]
    boxes = np.concatenate([boxes, boxes[:2]])
    out = to_results(["s"], [boxes], [np.linspace(1, 0.1, 10)], [labels], [[1, 0, 0, 0]], [[0, 0, 0]])["s"]
    assert [b["attribute_name"] for b in out] == [
        "vehicle.parked", "vehicle.moving", "vehicle.stopped", "vehicle.moving", "cycle.without_rider",
        "cycle.with_rider", "pedestrian.standing", "pedestrian.moving", "", "",
    ]  # fmt: skip


def test_to_results_global_frame_by_hand():
    """A box 10 m ahead of an ego at (100, 200, 0) turned 90 degrees left: 10 m along global +y, heading and
    velocity turned by 90 degrees."""
    q_ego = [math.cos(math.pi / 4), 0, 0, math.sin(math.pi / 4)]
    box = [[10, 0, 1, 2, 4, 1.5, 0.5, 3, 0]]
    (out,) = to_results(["s"], [box], [[0.9]], [[0]], [q_ego], [[100, 200, 0]])["s"]
    np.testing.assert_allclose(out["translation"], [100, 210, 1], atol=1e-12)
    np.testing.assert_allclose(out["velocity"], [0, 3], atol=1e-12)
    np.testing.assert_allclose(
        np.abs(out["rotation"]),
        [math.cos((0.5 + math.pi / 2) / 2), 0, 0, math.sin((0.5 + math.pi / 2) / 2)],
        atol=1e-12,
    )
    assert out["size"] == [2, 4, 1.5] and out["detection_name"] == "car" and out["attribute_name"] == "vehicle.moving"


def test_to_results_keeps_the_500_best_and_checks_its_input():
    n = 600
    boxes = np.tile([1.0, 0, 0, 1, 1, 1, 0, 0, 0], (n, 1))
    scores = np.random.default_rng(0).permutation(n) / n
    out = to_results(
        ["s", "e"], [boxes, np.zeros((0, 9))], [scores, []], [[0] * n, []], [[1, 0, 0, 0]] * 2, [[0, 0, 0]] * 2
    )
    assert len(out["s"]) == 500 and out["e"] == []
    assert min(b["detection_score"] for b in out["s"]) == pytest.approx(np.sort(scores)[-500])
    with pytest.raises(ValueError, match="labels must index DETECTION_CLASSES"):
        to_results(["s"], [boxes[:1]], [[0.5]], [[10]], [[1, 0, 0, 0]], [[0, 0, 0]])
    with pytest.raises(ValueError, match="one entry per sample"):
        to_results(["s", "t"], [boxes[:1]], [[0.5]], [[0]], [[1, 0, 0, 0]], [[0, 0, 0]])
    with pytest.raises(ValueError, match="size"):
        to_results(["s"], [[[0, 0, 0, 0, 1, 1, 0, 0, 0]]], [[0.5]], [[0]], [[1, 0, 0, 0]], [[0, 0, 0]])


def test_ground_truth_scores_ap_1(truth, synthetic_root, tmp_path, nusc):
    metrics, _ = _score(_results(truth), synthetic_root, tmp_path, nusc)
    for c in _present(truth):
        assert metrics[f"AP/{c}"] >= 0.99, c
        assert metrics[f"trans_err/{c}"] < 1e-6 and metrics[f"scale_err/{c}"] < 1e-6, c
        if c not in nusc_eval.UNSCORED:
            assert metrics[f"orient_err/{c}"] < 1e-6 and metrics[f"vel_err/{c}"] < 1e-6, c
    # mAP averages all 10 classes (absent ones score 0); NDS by its definition from the means.
    assert metrics["mAP"] == pytest.approx(np.mean([metrics[f"AP/{c}"] for c in DETECTION_CLASSES]), abs=1e-9)
    tp = [metrics[m] for m in nusc_eval.TP_ERRORS.values()]
    assert metrics["NDS"] == pytest.approx((5 * metrics["mAP"] + sum(1 - min(1, e) for e in tp)) / 10, abs=1e-9)
    assert json.loads((tmp_path / nusc_eval.RESULTS_FILE).read_text())["meta"] == nusc_eval.CAMERA_META
    table = format_table(metrics)
    assert f"mAP: {metrics['mAP']:.4f}" in table and f"NDS: {metrics['NDS']:.4f}" in table
    assert f"car                 \t{metrics['AP/car']:<6.3f}" in table


def test_shift_075_m(truth, synthetic_root, tmp_path, nusc):
    def shift(boxes):
        boxes[:, 0] += 0.6
        boxes[:, 1] += 0.45  # 0.75 m in all
        return boxes

    metrics, summary = _score(_results(truth, shift), synthetic_root, tmp_path, nusc)
    # Boxes more than 2 + 0.75 m apart: within the 2 m matching distance a shifted box is then nearer its own
    # truth than any other (the devkit matches greedily, so closer neighbours may swap their truths).
    apart = _apart(truth, 2.75) - _near_range_edge(truth, 0.75)  # a box shifted out of range is not scored
    assert len(apart) >= 3, apart
    for c in _present(truth):
        assert summary["label_aps"][c]["0.5"] == 0.0, c
        if c in apart:  # else a shifted box may be nearer another one's truth and take it (the greedy matching)
            assert summary["label_aps"][c]["2.0"] >= 0.99, c
            assert metrics[f"trans_err/{c}"] == pytest.approx(0.75, abs=1e-3), c


def test_yaw_plus_pi(truth, synthetic_root, tmp_path, nusc):
    def turn(boxes):
        boxes[:, 6] += math.pi
        return boxes

    metrics, _ = _score(_results(truth, turn), synthetic_root, tmp_path, nusc)
    present = _present(truth)
    assert "barrier" in present
    for c in present:
        if c == "barrier":  # its yaw counts modulo pi
            assert metrics[f"orient_err/{c}"] == pytest.approx(0.0, abs=1e-6)
        elif c != "traffic_cone":
            assert metrics[f"orient_err/{c}"] == pytest.approx(math.pi, abs=1e-6), c
        assert metrics[f"AP/{c}"] >= 0.99


def test_zero_velocity_gives_the_true_speed(truth, synthetic_root, tmp_path, nusc):
    """AVE of a class is the mean, over recall 0.11..1, of the running mean of the speed error of its true
    positives in score order; with zero predicted velocity that error is the true speed."""

    def stop(boxes):
        boxes[:, 7:9] = 0
        return boxes

    tokens, _, gt = truth
    metrics, _ = _score(_results(truth, stop), synthetic_root, tmp_path, nusc)
    scores = _scores(truth)
    for c in sorted(set(_present(truth)) - set(nusc_eval.UNSCORED)):
        ranked = sorted(
            (
                (scores[t][i], np.hypot(*b.velocity))
                for t in tokens
                for i, b in enumerate(gt[t])
                if b.detection_name == c
            ),
            reverse=True,
        )
        speeds = np.array([s for _, s in ranked])
        known = ~np.isnan(speeds)
        running = np.cumsum(np.where(known, speeds, 0)) / np.maximum(np.cumsum(known), 1)
        recall = np.arange(1, len(speeds) + 1) / len(speeds)
        expected = np.interp(np.linspace(0, 1, 101)[11:], recall, running).mean()
        assert metrics[f"vel_err/{c}"] == pytest.approx(expected, abs=1e-6), c


def test_no_box_scores_zero_without_the_devkit(truth, synthetic_root, tmp_path, nusc, monkeypatch):
    tokens, _, _ = truth

    def refuse(*args, **kwargs):
        raise AssertionError("the devkit must not be called without a box")

    monkeypatch.setattr(nusc_eval, "_run_devkit", refuse)
    metrics = evaluate({t: [] for t in tokens}, synthetic_root, VERSION, SPLIT, tmp_path, nusc=nusc)
    assert metrics["mAP"] == 0 and metrics["NDS"] == 0 and metrics["mATE"] == 1
    assert all(metrics[f"AP/{c}"] == 0 for c in DETECTION_CLASSES)
    assert "NDS: 0.0000" in format_table(metrics)
    # what the devkit gives a set whose only box is out of every class range (so it can load the file)
    far = to_results(tokens[:1], [[[5000.0, 0, 0, 1, 1, 1, 0, 0, 0]]], [[0.5]], [[0]], [[1, 0, 0, 0]], [[0, 0, 0]])
    monkeypatch.undo()
    devkit = evaluate({t: far.get(t, []) for t in tokens}, synthetic_root, VERSION, SPLIT, tmp_path, nusc=nusc)
    assert devkit == pytest.approx(metrics, nan_ok=True) and list(devkit) == list(metrics)
    # the same from a file
    monkeypatch.setattr(nusc_eval, "_run_devkit", refuse)
    path = write_results(tmp_path / "empty.json", {t: [] for t in tokens}, tokens)
    assert evaluate(path, synthetic_root, VERSION, SPLIT, tmp_path, nusc=nusc)["NDS"] == 0


def test_bad_results_are_refused(truth, synthetic_root, tmp_path, nusc):
    tokens, _, _ = truth
    results = _results(truth)
    missing = {t: b for t, b in results.items() if t != tokens[0]}
    with pytest.raises(ValueError, match="miss 1 of the .* empty list"):
        write_results(tmp_path / "r.json", missing, tokens)
    with pytest.raises(ValueError, match="miss 1 of the"):
        evaluate(missing, synthetic_root, VERSION, SPLIT, tmp_path, nusc=nusc)
    with pytest.raises(ValueError, match="not in the split"):
        write_results(tmp_path / "r.json", {**results, "stranger": []}, tokens)
    renamed = {t: [dict(b, detection_name="van") for b in boxes] for t, boxes in results.items()}
    with pytest.raises(ValueError, match="unknown class name 'van'"):
        write_results(tmp_path / "r.json", renamed, tokens)
    # a file written by someone else is checked the same way
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"meta": nusc_eval.CAMERA_META, "results": renamed}))
    with pytest.raises(ValueError, match="unknown class name 'van'"):
        evaluate(bad, synthetic_root, VERSION, SPLIT, tmp_path, nusc=nusc)
    assert not (tmp_path / "r.json").exists()


def test_unknown_split_lists_the_splits(synthetic_root, tmp_path, nusc):
    with pytest.raises(
        ValueError, match=r"'val' is not a split .* it has: mini_train \(1 scenes\), mini_val \(1 scenes\)"
    ):
        evaluate({}, synthetic_root, VERSION, "val", tmp_path, nusc=nusc)


def test_devkit_class_order_is_the_configs():
    from nuscenes.eval.common.config import config_factory

    assert nusc_eval.DEVKIT_CLASS_ORDER == tuple(config_factory("detection_cvpr_2019").class_names)
    assert sorted(nusc_eval.DEVKIT_CLASS_ORDER) == sorted(DETECTION_CLASSES)


def _own_scene_names(synthetic_root, root, splits):
    """A copy of the tables whose mini_val scene is renamed "town-7", with `splits` as splits.json."""
    shutil.copytree(synthetic_root / VERSION, root / VERSION)
    (root / "maps").symlink_to(synthetic_root / "maps")  # NuScenes() opens the map masks
    scenes = json.loads((root / VERSION / "scene.json").read_text())
    for s in scenes:
        s["name"] = "town-7" if s["name"] == "scene-0103" else s["name"]
    (root / VERSION / "scene.json").write_text(json.dumps(scenes))
    (root / VERSION / "splits.json").write_text(json.dumps(splits))
    return root


def test_custom_split_of_own_scene_names(truth, synthetic_root, tmp_path, nusc):
    from nuscenes import NuScenes

    root = _own_scene_names(synthetic_root, tmp_path / "own", {"holdout": ["town-7"]})
    own = NuScenes(VERSION, dataroot=str(root), verbose=False)
    results = _results(truth)
    custom = evaluate(results, root, VERSION, "holdout", tmp_path / "custom", nusc=own)
    mini = evaluate(results, synthetic_root, VERSION, SPLIT, tmp_path / "mini", nusc=nusc)
    assert custom == pytest.approx(mini, nan_ok=True)
    with pytest.raises(ValueError, match=r"'mini_val' is not a split .* it has: mini_train \(1 scenes\), holdout"):
        evaluate(results, root, VERSION, SPLIT, tmp_path / "custom", nusc=own)


def test_custom_split_named_as_a_devkit_split_is_refused(synthetic_root, tmp_path):
    from nuscenes import NuScenes

    root = _own_scene_names(synthetic_root, tmp_path / "own", {"val": ["town-7"]})
    own = NuScenes(VERSION, dataroot=str(root), verbose=False)
    with pytest.raises(ValueError, match=r"names \['val'\], which the devkit reserves"):
        evaluate({}, root, VERSION, "val", tmp_path, nusc=own)


def test_format_table_prints_as_the_devkit(truth, synthetic_root, tmp_path, nusc, capsys):
    from nuscenes.eval.common.config import config_factory
    from nuscenes.eval.detection.evaluate import DetectionEval

    metrics = evaluate(_results(truth), synthetic_root, VERSION, SPLIT, tmp_path, nusc=nusc)
    capsys.readouterr()
    devkit = DetectionEval(
        nusc, config_factory("detection_cvpr_2019"), str(tmp_path / nusc_eval.RESULTS_FILE), SPLIT, str(tmp_path), False
    )
    devkit.main(render_curves=False)
    printed = [line for line in capsys.readouterr().out.splitlines() if not line.startswith(("Eval time", "Saving"))]
    assert format_table(metrics).splitlines() == printed


def test_one_band_over_everything_is_the_devkits_ap(truth, synthetic_root, tmp_path, nusc):
    """range_aps on a band holding every box: the devkit's own AP per class, and their mean over the classes
    with ground truth."""

    def shift(boxes):  # 0.7 m: AP below 1 (it fails the 0.5 m threshold), so that equal numbers say more
        boxes[:, 0] += 0.7
        return boxes

    metrics = evaluate(_results(truth, shift), synthetic_root, VERSION, SPLIT, tmp_path, nusc=nusc, ranges=[(0, 500)])
    present = _present(truth)
    for c in DETECTION_CLASSES:
        assert metrics.get(f"AP_0-500m/{c}") == (metrics[f"AP/{c}"] if c in present else None), c
    assert metrics["mAP_0-500m"] == pytest.approx(np.mean([metrics[f"AP/{c}"] for c in present]), abs=1e-12)
    assert 0 < metrics["mAP_0-500m"] < 0.99


def test_bands_score_only_their_boxes(truth, synthetic_root, tmp_path, nusc):
    """Predictions = the ground truth nearer than 20 m: that band scores AP 1, the next one 0, and bev-eval's table
    names each band."""
    tokens, ego, gt = truth
    near = {t: np.array([b.ego_dist < 20 for b in gt[t]], dtype=bool) for t in tokens}
    scores = _scores(truth)
    results = to_results(
        tokens,
        *([src[t][near[t]] for t in tokens] for src in ({t: ego[t]["boxes"] for t in tokens}, scores)),
        [ego[t]["labels"][near[t]] for t in tokens],
        [ego[t]["pose"][0] for t in tokens],
        [ego[t]["pose"][1] for t in tokens],
    )
    ranges = nusc_eval.RANGES
    metrics = evaluate(results, synthetic_root, VERSION, SPLIT, tmp_path, nusc=nusc, ranges=ranges)
    far = {b.detection_name for t in tokens for b in gt[t] if 20 <= b.ego_dist < 35}
    assert far and metrics["mAP_0-20m"] >= 0.99 and metrics["mAP_20-35m"] == 0.0
    assert all(metrics[f"AP_20-35m/{c}"] == 0.0 for c in far)
    assert "0-20m: 1.0000  20-35m: 0.0000" in format_table(metrics)
