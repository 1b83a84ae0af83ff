"""bev.tasks.detection.tracking: velocities from the boxes' tracks over past key frames, on hand-made tracks and on the
devkit's own annotations (whose instance links are the true matches)."""

from __future__ import annotations

import numpy as np
import pytest

from bev.tasks.detection.tracking import TrackVelocity, sample_links, track_velocity

OPTIONS = TrackVelocity(past_frames=1, gate=6.0, min_past_score=0.2, still_speed=2.5)


def _box(token, name, x, y, score=0.9, velocity=(0.5, 0.5)):
    return {
        "sample_token": token,
        "translation": [x, y, 1.0],
        "size": [2.0, 4.5, 1.6],
        "rotation": [1.0, 0.0, 0.0, 0.0],
        "velocity": list(velocity),
        "detection_name": name,
        "detection_score": score,
        "attribute_name": "",
    }


def _frames(positions, names=None, **kw):
    """positions: per frame a list of (x, y); frames 0.5 s apart, chained by prev links."""
    links, results = {}, {}
    for f, frame in enumerate(positions):
        token = f"s{f}"
        links[token] = (f"s{f - 1}" if f else "", 1000.0 + 0.5 * f)
        results[token] = [_box(token, (names or ["car"] * len(frame))[i], x, y, **kw) for i, (x, y) in enumerate(frame)]
    return results, links


def test_constant_velocity_and_still_objects():
    # A car at 8 m/s along x whose head says 6 m/s, a parked car 3 m beside its path, a barrier (velocity
    # unscored) that moves.
    positions = [[(8.0 * t, 0.0), (10.0, 3.0), (0.0, 20.0 + 4 * t)] for t in (0.0, 0.5, 1.0, 1.5)]
    results, links = _frames(positions, names=["car", "car", "barrier"])
    for boxes in results.values():
        boxes[0]["velocity"] = [6.0, 0.0]
    out = track_velocity(results, links, OPTIONS)
    assert [b["velocity"] for b in out["s0"]] == [[6.0, 0.0], [0.5, 0.5], [0.5, 0.5]]  # no past: the head's stays
    for token in ("s1", "s2", "s3"):
        moving, parked, barrier = out[token]
        np.testing.assert_allclose(moving["velocity"], [8.0, 0.0], atol=1e-9)
        assert moving["attribute_name"] == "vehicle.moving"
        assert parked["velocity"] == [0.0, 0.0] and parked["attribute_name"] == "vehicle.parked"
        assert barrier["velocity"] == [0.5, 0.5]
    assert results["s1"][0]["velocity"] == [6.0, 0.0]  # the input is left as it was


def test_span_averages_position_noise():
    # The same car with +-0.4 m of alternating noise: over 2 key frames (1 s: outside the detection rules) the
    # noise cancels, over 1 it doubles.
    xs = [0.0 + 0.4, 4.0 - 0.4, 8.0 + 0.4, 12.0 - 0.4]
    results, links = _frames([[(x, 0.0)] for x in xs])
    one = track_velocity(results, links, TrackVelocity(1, 6.0, 0.2, 0.0))
    two = track_velocity(results, links, TrackVelocity(2, 6.0, 0.2, 0.0, outside_rules=True))
    np.testing.assert_allclose(one["s2"][0]["velocity"], [9.6, 0.0], atol=1e-9)
    np.testing.assert_allclose(two["s2"][0]["velocity"], [8.0, 0.0], atol=1e-9)
    np.testing.assert_allclose(two["s3"][0]["velocity"], [(xs[3] - xs[1]) / 1.0, 0.0], atol=1e-9)


def test_crossing_cars_are_told_apart_by_their_own_velocities():
    # Head-on, 0.5 m apart sideways, 10 m/s each: at t = 1 s car A (now at x=10) is nearer to where B was
    # (x=6) than to where A was (x=5); moved back by the velocities the head gives them (CenterPoint), the boxes
    # match the right past boxes.
    positions = [[(0.0, 0.0), (11.0, 0.5)], [(5.0, 0.0), (6.0, 0.5)], [(10.0, 0.0), (1.0, 0.5)]]
    results, links = _frames(positions)
    for boxes in results.values():
        boxes[0]["velocity"], boxes[1]["velocity"] = [9.0, 0.0], [-9.0, 0.0]  # a head's, off by 1 m/s
    out = track_velocity(results, links, TrackVelocity(1, 6.0, 0.2, 2.5))
    np.testing.assert_allclose(out["s2"][0]["velocity"], [10.0, 0.0], atol=1e-9)
    np.testing.assert_allclose(out["s2"][1]["velocity"], [-10.0, 0.0], atol=1e-9)


def test_gate_score_and_class_keep_the_heads_velocity():
    jump = track_velocity(*_frames([[(0.0, 0.0)], [(7.0, 0.0)]]), OPTIONS)  # 14 m/s: beyond the 6 m gate
    assert jump["s1"][0]["velocity"] == [0.5, 0.5]
    weak = track_velocity(*_frames([[(0.0, 0.0)], [(4.0, 0.0)]], score=0.1), OPTIONS)  # past box under 0.2
    assert weak["s1"][0]["velocity"] == [0.5, 0.5]
    other = track_velocity(*_frames([[(0.0, 0.0)], [(4.0, 0.0)]], names=["truck"]), OPTIONS)
    assert other["s1"][0]["velocity"] != [0.5, 0.5]
    results, links = _frames([[(0.0, 0.0)], [(4.0, 0.0)]])
    results["s1"][0]["detection_name"] = "bus"  # a box of another class is another object
    assert track_velocity(results, links, OPTIONS)["s1"][0]["velocity"] == [0.5, 0.5]
    loop = {"s0": ("s1", 1000.0), "s1": ("s0", 1000.5)}  # prev links in a loop (a broken table): boxes kept as they are
    assert track_velocity(*_frames([[(0.0, 0.0)], [(4.0, 0.0)]])[:1], loop, OPTIONS)["s1"][0]["velocity"] == [0.5, 0.5]
    links["s1"] = ("s0", links["s0"][1])  # two key frames at one time (a broken table): no speed from them
    assert track_velocity(*_frames([[(0.0, 0.0)], [(4.0, 0.0)]])[:1], links, OPTIONS)["s1"][0]["velocity"] == [0.5, 0.5]


def test_ground_truth_boxes_track_as_the_devkits_instance_links(nusc):
    """Every annotation of the synthetic set as a perfect detection with the devkit's velocity as the head's: from an
    object's third key frame on, the velocities equal the displacement from the same instance's annotation 1 or 2
    key frames before (the devkit's prev links): moved back by its velocity, each box is nearest to its own past
    box (all 155 of this small set)."""
    from nuscenes.eval.detection.utils import category_to_detection_name

    results, anns = {}, {}
    for s in nusc.sample:
        kept = [
            a
            for a in (nusc.get("sample_annotation", t) for t in s["anns"])
            if category_to_detection_name(a["category_name"]) not in (None, "barrier", "traffic_cone")
        ]
        results[s["token"]] = [
            _box(
                s["token"],
                category_to_detection_name(a["category_name"]),
                *a["translation"][:2],
                velocity=np.nan_to_num(nusc.box_velocity(a["token"])[:2]).tolist(),  # a perfect head's
            )
            for a in kept
        ]
        anns[s["token"]] = kept
    for span in (1, 2):
        out = track_velocity(results, sample_links(nusc), TrackVelocity(span, 6.0, 0.2, 0.0, outside_rules=span > 1))
        agree = total = 0
        bad = []
        for token, boxes in out.items():
            for box, ann in zip(boxes, anns[token]):
                chain = [ann]
                while len(chain) < 3 and chain[-1]["prev"]:
                    chain.append(nusc.get("sample_annotation", chain[-1]["prev"]))
                if len(chain) == 3:
                    past = chain[span]
                    dt = (
                        nusc.get("sample", token)["timestamp"] - nusc.get("sample", past["sample_token"])["timestamp"]
                    ) / 1e6
                    v = (np.array(ann["translation"][:2]) - np.array(past["translation"][:2])) / dt
                    total += 1
                    agree += bool(np.allclose(box["velocity"], v, atol=1e-6))
                    bad += (
                        []
                        if np.allclose(box["velocity"], v, atol=1e-6)
                        else [(box["detection_name"], box["velocity"], v.tolist())]
                    )
        assert total > 50
        assert agree / total >= 0.99, (span, agree, total, bad[:5])


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(past_frames=0, gate=6.0, min_past_score=0.2, still_speed=2.5), "past_frames"),
        (dict(past_frames=2, gate=0.0, min_past_score=0.2, still_speed=2.5), "gate"),
        (dict(past_frames=2, gate=6.0, min_past_score=1.5, still_speed=2.5), "min_past_score"),
        (dict(past_frames=2, gate=6.0, min_past_score=0.2, still_speed=-1.0), "still_speed"),
    ],
)
def test_bad_options_name_the_key(kw, name):
    with pytest.raises(ValueError, match=rf"model\.detection\.track_velocity\.{name} must be"):
        TrackVelocity(**kw)


@pytest.mark.e2e
def test_the_scoring_script_scores_both_velocities(nusc, synthetic_root, tmp_path):
    """scripts/track_velocity_scores.py on the devkit's own val boxes written with zero velocity: the same mAP both
    ways, and the tracks' velocities score a lower mAVE than the zeros (they are the true displacements)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from nuscenes.eval.detection.utils import category_to_detection_name

    from bev.tasks.detection.nusc_eval import attribute_name, split_sample_tokens

    results = {}
    for token in split_sample_tokens(nusc, "mini_val"):
        boxes = []
        for a in (nusc.get("sample_annotation", t) for t in nusc.get("sample", token)["anns"]):
            name = category_to_detection_name(a["category_name"])
            if name is not None:
                boxes.append(
                    {
                        "sample_token": token,
                        "translation": a["translation"],
                        "size": a["size"],
                        "rotation": a["rotation"],
                        "velocity": [0.0, 0.0],
                        "detection_name": name,
                        "detection_score": 0.9,
                        "attribute_name": attribute_name(name, 0.0),
                    }
                )
        results[token] = boxes
    meta = {"use_camera": True, "use_lidar": False, "use_radar": False, "use_map": False, "use_external": False}
    path = tmp_path / "run" / "eval" / "results_nusc.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"meta": meta, "results": results}))
    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "scores.json"
    done = subprocess.run(
        [
            sys.executable,
            str(repo / "scripts/track_velocity_scores.py"),
            str(path),
            "--dataroot",
            str(synthetic_root),
            "--out",
            str(out),
        ],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    scores = json.loads(out.read_text())["variants"]
    assert scores["run/head"]["mAP"] == scores["run/tracks_1_frame"]["mAP"] == scores["run/tracks_2_frames"]["mAP"]
    assert scores["run/tracks_1_frame"]["mAVE"] < scores["run/head"]["mAVE"]
    again = subprocess.run(
        done.args, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True, text=True
    )
    assert again.returncode != 0 and "exists" in again.stderr  # --out is replaced only with --overwrite


def test_options_from_a_config_are_checked():
    good = {"past_frames": 1, "gate": 6.0, "min_past_score": 0.2, "still_speed": 2.5}
    assert TrackVelocity.from_config(good) == OPTIONS
    for bad in ({**good, "extra": 1}, {"gate": 6.0}, [2, 6.0, 0.2, 2.5]):
        with pytest.raises(ValueError, match="track_velocity needs exactly past_frames, gate"):
            TrackVelocity.from_config(bad)
    with pytest.raises(ValueError, match=r"track_velocity\.gate must be"):
        TrackVelocity.from_config({**good, "gate": "6"})
