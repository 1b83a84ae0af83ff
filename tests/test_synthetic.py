"""The synthetic nuScenes-format dataset: devkit compatibility, links, splits, geometry, visibility, errors."""

from __future__ import annotations

import errno
import io
import json
import math
import os
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from bev.data.rig import MINI_LOCATIONS, load_rig
from bev.geometry import CAMERA_NAMES, ego_to_image, quaternion_to_matrix
from bev.synthetic import raycast
from bev.synthetic import world as world_model
from bev.synthetic.writer import MANIFEST, TABLES, VERSION, make_synthetic, scene_names
from helpers.cli import default_signals
from helpers.synthetic import RENDER_SCALE, SAMPLES, SCENES, SEED

QUICK = {"progress": False, "render_scale": 4}  # the coarse render, where a test checks files, not pixels


def _ego_from_global(nusc, sample):
    """(R, t) of the LIDAR_TOP ego pose: p_ego = R^T (p_global - t)."""
    pose = nusc.get("ego_pose", nusc.get("sample_data", sample["data"]["LIDAR_TOP"])["ego_pose_token"])
    return quaternion_to_matrix(pose["rotation"]), np.array(pose["translation"])


def _box_corners(ann) -> np.ndarray:
    """(8, 3) global corners of a sample_annotation box (size = w, l, h; x along l)."""
    w, l, h = ann["size"]
    signs = np.array([[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)], dtype=np.float64)
    return np.array(ann["translation"]) + (signs * [l / 2, w / 2, h / 2]) @ quaternion_to_matrix(ann["rotation"]).T


def _project(cam: raycast.Camera, pts_ego: np.ndarray):
    """Render-resolution (u, v) and depth through bev.geometry.ego_to_image with the rig calibration."""
    d = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.float64)  # noqa: E731
    uv, depth = ego_to_image(
        d(pts_ego), d(cam.intrinsic), d(cam.rotation), d(cam.translation), cam.post_rot.double(), cam.post_tran.double()
    )
    return uv.numpy(), depth.numpy()


@pytest.fixture(scope="module")
def worlds(nusc):
    """scene name -> (scene index, world, [sample tokens]) rebuilt with the generator."""
    names = scene_names(SCENES)
    out = {}
    for scene in nusc.scene:
        si = names.index(scene["name"])
        toks, tok = [], scene["first_sample_token"]
        while tok:
            toks.append(tok)
            tok = nusc.get("sample", tok)["next"]
        out[scene["name"]] = (si, world_model.build_world(SEED, si, SAMPLES, MINI_LOCATIONS[scene["name"]]), toks)
    return out


# ----------------------------------------------------------------------------- format and links


def test_devkit_loads_all_tables(nusc, synthetic_root):
    for name in TABLES:
        on_disk = json.loads((synthetic_root / VERSION / f"{name}.json").read_text())
        assert len(getattr(nusc, name)) == len(on_disk) > 0, name
    assert len(nusc.scene) == SCENES and len(nusc.sample) == SCENES * SAMPLES
    assert len(nusc.sample_data) == len(nusc.ego_pose) == SCENES * SAMPLES * 7
    assert {v["token"]: v["level"] for v in nusc.visibility} == {
        "1": "v0-40",
        "2": "v40-60",
        "3": "v60-80",
        "4": "v80-100",
    }
    assert {c["name"] for c in nusc.category} >= {
        "vehicle.car",
        "vehicle.truck",
        "vehicle.bus.rigid",
        "vehicle.trailer",
        "vehicle.motorcycle",
        "human.pedestrian.adult",
        "movable_object.barrier",
        "movable_object.trafficcone",
    }
    cats = {a["category_name"] for a in nusc.sample_annotation}
    assert any(c.startswith("vehicle.") for c in cats) and any(not c.startswith("vehicle.") for c in cats)


def test_files_exist_and_images_are_full_size(nusc, synthetic_root):
    from PIL import Image

    for sd in nusc.sample_data:
        path = synthetic_root / sd["filename"]
        assert path.is_file(), path
        if sd["sensor_modality"] == "camera":
            assert sd["fileformat"] == "jpg" and sd["filename"].startswith(f"samples/{sd['channel']}/")
            with Image.open(path) as im:
                assert im.size == (sd["width"], sd["height"]) == (1600, 900)
    for m in nusc.map:
        assert (synthetic_root / m["filename"]).is_file() and m["filename"].startswith("maps/")
        assert m["mask"].mask().max() == 255  # the devkit reads the PNG and finds drivable area


def test_ego_and_vehicles_drive_on_the_map(nusc):
    for sample in nusc.sample:
        scene = nusc.get("scene", sample["scene_token"])
        log = nusc.get("log", scene["log_token"])
        mask = nusc.get("map", log["map_token"])["mask"]
        ego = nusc.get("ego_pose", nusc.get("sample_data", sample["data"]["LIDAR_TOP"])["ego_pose_token"])
        assert mask.is_on_mask(ego["translation"][0], ego["translation"][1]).all()
        anns = [nusc.get("sample_annotation", a) for a in sample["anns"]]
        xy = np.array([a["translation"][:2] for a in anns if a["category_name"].startswith("vehicle.")])
        assert mask.is_on_mask(xy[:, 0], xy[:, 1]).all()  # the map covers every vehicle
        people = np.array([a["translation"][:2] for a in anns if a["category_name"].startswith("human.")])
        assert not mask.is_on_mask(people[:, 0], people[:, 1]).any()  # pedestrians stay on the sidewalks


def test_tokens_link(nusc):
    for scene in nusc.scene:
        chain, tok, prev = [], scene["first_sample_token"], ""
        while tok:
            s = nusc.get("sample", tok)
            assert s["prev"] == prev and s["scene_token"] == scene["token"]
            assert set(s["data"]) == set(CAMERA_NAMES) | {"LIDAR_TOP"}
            chain.append(tok)
            prev, tok = tok, s["next"]
        assert chain[-1] == scene["last_sample_token"] and len(chain) == scene["nbr_samples"] == SAMPLES
        times = [nusc.get("sample", t)["timestamp"] for t in chain]
        assert all(b - a == 500_000 for a, b in zip(times, times[1:]))
        nusc.get("log", scene["log_token"])
    for sd in nusc.sample_data:
        assert sd["is_key_frame"] and sd["timestamp"] == nusc.get("sample", sd["sample_token"])["timestamp"]
        nusc.get("ego_pose", sd["ego_pose_token"])
        for key in ("prev", "next"):
            if sd[key]:
                other = nusc.get("sample_data", sd[key])
                assert other["channel"] == sd["channel"]
                assert nusc.get("sample", sd["sample_token"])[key] == other["sample_token"]
    for inst in nusc.instance:
        chain, tok = [], inst["first_annotation_token"]
        while tok:
            ann = nusc.get("sample_annotation", tok)
            assert ann["instance_token"] == inst["token"]
            chain.append(ann)
            tok = ann["next"]
        assert chain[-1]["token"] == inst["last_annotation_token"] and len(chain) == inst["nbr_annotations"]
        times = [nusc.get("sample", a["sample_token"])["timestamp"] for a in chain]
        assert times == sorted(set(times))
    assert sum(i["nbr_annotations"] for i in nusc.instance) == len(nusc.sample_annotation)
    attrs = {a["token"] for a in nusc.attribute}
    assert all(set(a["attribute_tokens"]) <= attrs for a in nusc.sample_annotation)
    # Moving vehicles move between key frames; parked ones do not.
    moving = nusc.getind("attribute", "cb5118da1ab342aa947717dc53544259")
    for a in nusc.sample_annotation:
        if a["next"] and nusc.attribute[moving]["token"] in a["attribute_tokens"]:
            assert (
                np.linalg.norm(np.subtract(nusc.get("sample_annotation", a["next"])["translation"], a["translation"]))
                > 0.5
            )


def test_lidar_points_match_num_lidar_pts(nusc, synthetic_root):
    from nuscenes.utils.data_classes import LidarPointCloud
    from nuscenes.utils.geometry_utils import points_in_box

    sample = nusc.sample[1]
    sd = nusc.get("sample_data", sample["data"]["LIDAR_TOP"])
    pc = LidarPointCloud.from_file(str(synthetic_root / sd["filename"]))
    # lidar -> ego -> global
    cs = nusc.get("calibrated_sensor", sd["calibrated_sensor_token"])
    pose = nusc.get("ego_pose", sd["ego_pose_token"])
    pts = quaternion_to_matrix(cs["rotation"]) @ pc.points[:3] + np.array(cs["translation"])[:, None]
    pts = quaternion_to_matrix(pose["rotation"]) @ pts + np.array(pose["translation"])[:, None]
    assert np.abs(pts[2]).min() < 1e-3  # ground returns lie on z = 0
    with_pts = 0
    for tok in sample["anns"]:
        ann = nusc.get("sample_annotation", tok)
        assert points_in_box(nusc.get_box(tok), pts).sum() == ann["num_lidar_pts"]
        with_pts += ann["num_lidar_pts"] > 0
    assert with_pts > 0


# ----------------------------------------------------------------------------- splits and names


def test_mini_splits_have_the_expected_scenes(nusc):
    from nuscenes.utils.splits import create_splits_scenes

    splits = create_splits_scenes()
    names = {s["name"] for s in nusc.scene}
    assert names & set(splits["mini_train"]) == {"scene-0061"}
    assert names & set(splits["mini_val"]) == {"scene-0103"}


def test_scene_name_rule():
    from nuscenes.utils.splits import create_splits_scenes

    splits = create_splits_scenes()
    assert scene_names(1) == ["scene-0061"]
    for n in range(2, 11):
        names = scene_names(n)
        assert len(set(names)) == n
        train, val = set(names) & set(splits["mini_train"]), set(names) & set(splits["mini_val"])
        assert train and val and len(train) + len(val) == n, n
    assert set(scene_names(10)) == set(splits["mini_train"]) | set(splits["mini_val"])


# ----------------------------------------------------------------------------- geometry and visibility


def test_object_centres_lie_inside_their_rendered_shapes():
    # Why: the projection tests below rely on an annotation's centre being on the object's surface path.
    for seed in range(3):
        world = world_model.build_world(seed, 0, 4, "boston-seaport")
        for obj in world.objects:
            if obj.category:
                assert any(np.all(np.abs(c) < h) for c, h, *_ in obj.parts), obj.category


def _object_of(world, t):
    """Annotation translation -> generator object index (annotations store the object centre)."""
    by_centre = {tuple(np.round(world.object_global(o, t)[0], 6)): i for i, o in enumerate(world.objects)}
    return lambda ann: by_centre[tuple(np.round(ann["translation"], 6))]


def _id_bboxes(ids: np.ndarray, n: int) -> np.ndarray:
    """(n + 1, 4) [row_min, row_max, col_min, col_max] of every id's pixels (min > max when absent)."""
    rows, cols = np.nonzero(ids)
    k = ids[rows, cols]
    out = np.tile(np.array([np.inf, -np.inf, np.inf, -np.inf]), (n + 1, 1))
    np.minimum.at(out[:, 0], k, rows), np.maximum.at(out[:, 1], k, rows)
    np.minimum.at(out[:, 2], k, cols), np.maximum.at(out[:, 3], k, cols)
    return out


def test_vehicles_never_intersect_other_objects():
    import shapely
    from shapely.geometry import Polygon

    def footprint(c, yaw, w, l):
        R = np.array([[math.cos(yaw), -math.sin(yaw)], [math.sin(yaw), math.cos(yaw)]])
        return Polygon(np.array([[l, w], [l, -w], [-l, -w], [-l, w]]) / 2 @ R.T + c[:2])

    for seed in range(3):
        world = world_model.build_world(
            seed, 0, 20, ("singapore-onenorth", "boston-seaport", "singapore-queenstown")[seed]
        )
        for t in (0.0, 4.5, 9.5):
            ego_xy, ego_yaw = world.ego_pose(t)
            boxes = [
                (o.category, world.object_global(o, t), o.size)
                for o in world.objects
                if o.category and not o.category.startswith("human.")
            ]
            boxes.append(("ego", (ego_xy, ego_yaw), (1.9, 4.6, 1.7)))
            cats = [cat for cat, _, _ in boxes]
            polys = [footprint(c, yaw, w, l) for _, (c, yaw), (w, l, _) in boxes]
            # Candidate pairs from a search tree (bounding boxes touch), then the exact overlap.
            for a, b in shapely.STRtree(polys).query(polys, predicate="intersects").T:
                if a < b and ("vehicle." in cats[a] + cats[b] or "ego" in (cats[a], cats[b])):
                    assert polys[a].intersection(polys[b]).area < 1e-6, (seed, t, cats[a], cats[b])


def test_projected_boxes_land_on_their_rendered_pixels(nusc, worlds):
    checked_centres = visible_centres = own_centres = checked_boxes = 0
    for name, (_si, world, tokens) in worlds.items():
        for k, tok in enumerate(tokens):
            sample = nusc.get("sample", tok)
            R, t = _ego_from_global(nusc, sample)  # global -> LIDAR_TOP ego frame
            anns = [nusc.get("sample_annotation", a) for a in sample["anns"]]
            index = _object_of(world, k * world_model.SAMPLE_DT)
            obj = np.array([index(a) for a in anns])
            centres = (np.array([a["translation"] for a in anns]) - t) @ R
            corners = (np.concatenate([_box_corners(a) for a in anns]) - t) @ R
            for cam_name in CAMERA_NAMES:
                cam = raycast.make_camera(cam_name, RENDER_SCALE)
                r = raycast.render_camera(world, k * world_model.SAMPLE_DT, cam)
                H, W = cam.shape
                uv, d = _project(cam, centres)
                row, col = np.round(uv[:, 1]).astype(int), np.round(uv[:, 0]).astype(int)
                seen = (d > 1.0) & (row >= 0) & (row < H) & (col >= 0) & (col < W)
                at = r.ids[row[seen], col[seen]]
                # The centre pixel shows this very object, or something nearer that hides it.
                mine = at == obj[seen] + 1
                assert (r.depth[row[seen], col[seen]][~mine] < d[seen][~mine]).all(), (name, cam_name)
                vis4 = np.array([a["visibility_token"] == "4" for a in anns])[seen]
                checked_centres += seen.sum()
                visible_centres += vis4.sum()
                own_centres += (mine & vis4).sum()
                # Every rendered pixel of an object lies within its projected 3D box.
                uvc, dc = _project(cam, corners)
                uvc, dc = uvc.reshape(-1, 8, 2), dc.reshape(-1, 8)
                bb = _id_bboxes(r.ids, len(world.objects))[obj + 1]
                check = (dc.min(1) > raycast.NEAR) & (bb[:, 0] <= bb[:, 1])
                checked_boxes += check.sum()
                lo, hi = uvc.min(1)[check] - 1, uvc.max(1)[check] + 1
                assert (bb[check, 2] >= lo[:, 0]).all() and (bb[check, 3] <= hi[:, 0]).all(), (name, cam_name)
                assert (bb[check, 0] >= lo[:, 1]).all() and (bb[check, 1] <= hi[:, 1]).all(), (name, cam_name)
    assert checked_centres > 50 and checked_boxes > 50
    # Mostly visible objects (visibility "4") show their own centre pixel almost always.
    assert visible_centres > 20 and own_centres > 0.8 * visible_centres


def test_visibility_matches_the_id_buffers(nusc, worlds):
    levels = defaultdict(int)
    for _name, (_si, world, tokens) in worlds.items():
        for k, tok in enumerate(tokens):
            t = k * world_model.SAMPLE_DT
            renders, counts = raycast.render_sample(world, t, RENDER_SCALE)
            index = _object_of(world, t)
            for a in nusc.get("sample", tok)["anns"]:
                ann = nusc.get("sample_annotation", a)
                i = index(ann)
                visible = sum(int((r.ids == i + 1).sum()) for r in renders.values())
                unoccluded = sum(r.coverage.get(i, 0) for r in renders.values())
                assert counts.get(i, (0, 0)) == (visible, unoccluded)
                frac = visible / unoccluded if unoccluded else 0.0
                expected = "1" if frac < 0.4 else "2" if frac < 0.6 else "3" if frac < 0.8 else "4"
                assert ann["visibility_token"] == expected, (ann["category_name"], visible, unoccluded)
                levels[expected] += 1
    assert levels["4"] > 0 and levels["1"] > 0  # both unoccluded and hidden objects occur


def test_coverage_is_the_object_rendered_alone():
    world = world_model.build_world(SEED, 0, 2, "singapore-onenorth")
    objects = world_model.visible_objects(world, 0.0, world_model.RENDER_RANGE)
    full = raycast.render_camera(world, 0.0, "CAM_FRONT", objects)
    occluded = [i for i, n in full.coverage.items() if (full.ids == i + 1).sum() < n]
    assert occluded, "expected some occlusion in front of the ego"
    for i in occluded[:5]:
        alone = raycast.render_camera(world, 0.0, "CAM_FRONT", [i])
        assert (alone.ids == i + 1).sum() == full.coverage[i] == alone.coverage[i]


def _render_part_by_part(world, t, cam):
    """Reference for render_camera's batched slab tests and scatter-min z-buffer: each part in turn on
    its own rectangle, drawn where it is hit strictly nearer than what is drawn so far."""
    parts = raycast._object_parts_ego(world, t, world_model.visible_objects(world, t, world_model.RENDER_RANGE))
    rects, (o, _) = raycast._part_rects(cam, parts), raycast._part_frames(cam, parts)
    base = raycast.render_camera(world, t, cam, [])  # sky and ground
    assert not base.coverage and not base.ids.any()
    img, ids, depth, own = base.image.copy(), base.ids.copy(), base.depth.copy(), {}
    for j, (r0, r1, c0, c1) in enumerate(rects.tolist()):
        if r1 <= r0 or c1 <= c0:
            continue
        R, half, box = parts.R[j], parts.half[j], (slice(r0, r1), slice(c0, c1))
        rx, ry, rz = (cam.rays[..., k][box] for k in range(3))
        d = [rx * np.float32(R[0, k]) + ry * np.float32(R[1, k]) for k in (0, 1)] + [rz]  # parts only yaw
        with np.errstate(divide="ignore", invalid="ignore"):
            inv = [np.float32(1) / dk for dk in d]
            ts = [(np.float32(-half[k] - o[j, k]) * inv[k], np.float32(half[k] - o[j, k]) * inv[k]) for k in range(3)]
        lo, hi = [np.fmin(*x) for x in ts], [np.fmax(*x) for x in ts]
        tnear = np.fmax(np.fmax(lo[0], lo[1]), lo[2])
        hit = (tnear <= np.fmin(np.fmin(hi[0], hi[1]), hi[2])) & (tnear > raycast.NEAR)
        if parts.label[j]:
            own.setdefault(int(parts.obj[j]), np.zeros(ids.shape, bool))[box] |= hit
        front = hit & (tnear < depth[box])
        face = np.zeros(front.sum(), np.int64)
        for k in range(3):
            on = lo[k][front] == tnear[front]
            face[on] = 2 * k + (d[k][front][on] < 0)
        if parts.kind[j] in (world_model.CABIN, world_model.WINDOWS):
            at = [o[j, k].astype(np.float32) + tnear[front] * d[k][front] for k in range(3)]  # hit points, part frame
            face += 6 * raycast._glass(face, at, np.tile(half, (len(face), 1)), np.full(len(face), parts.kind[j]))
        depth[box][front], ids[box][front], img[box][front] = tnear[front], parts.label[j], parts.cols[j][face]
    return img, ids, depth, {i: int(m.sum()) for i, m in own.items()}


def test_batched_render_equals_part_by_part():
    for location, t in (("singapore-onenorth", 0.0), ("boston-seaport", 2.5)):
        world = world_model.build_world(SEED, 0, 6, location)
        for name in CAMERA_NAMES:
            cam = raycast.make_camera(name)
            r = raycast.render_camera(world, t, cam)
            img, ids, depth, coverage = _render_part_by_part(world, t, cam)
            assert ids.any() and coverage
            assert (r.ids == ids).all() and (r.depth == depth).all() and (r.image == img).all(), name
            assert r.coverage == coverage, name


def test_enough_vehicles_near_the_ego(nusc):
    counts = []
    for sample in nusc.sample:
        R, t = _ego_from_global(nusc, sample)
        n = 0
        for a in sample["anns"]:
            ann = nusc.get("sample_annotation", a)
            xy = ((np.array(ann["translation"]) - t) @ R)[:2]
            n += ann["category_name"].startswith("vehicle.") and np.abs(xy).max() < 50
        counts.append(n)
    assert 10 <= np.mean(counts) <= 60, counts


def test_image_shows_vehicles_in_colour(nusc, synthetic_root, worlds):
    """Vehicle pixels are saturated paint or dark glass/tyres, the road is grey: learnable contrast."""
    from PIL import Image

    (si, world, tokens) = worlds["scene-0061"]
    r = raycast.render_camera(world, 0.0, "CAM_FRONT", scale=RENDER_SCALE)
    img = np.asarray(
        Image.open(
            synthetic_root / nusc.get("sample_data", nusc.get("sample", tokens[0])["data"]["CAM_FRONT"])["filename"]
        )
    )
    small = img[::RENDER_SCALE, ::RENDER_SCALE].astype(np.float64) / 255.0  # render resolution
    sat = small.max(-1) - small.min(-1)
    vehicle = np.isin(r.ids - 1, [i for i, o in enumerate(world.objects) if o.category.startswith("vehicle.")])
    road = (r.ids == 0) & np.isfinite(r.depth) & (np.arange(r.ids.shape[0])[:, None] > r.ids.shape[0] * 0.7)
    assert min(vehicle.sum(), road.sum()) > 0.01 * r.ids.size
    assert sat[road].mean() < 0.08
    assert sat[vehicle].mean() > sat[road].mean() + 0.1


# ----------------------------------------------------------------------------- determinism and errors


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_deterministic_per_seed(tmp_path):
    # numpy integers are accepted like ints (e.g. from a config or a sweep)
    a = _tree(
        make_synthetic(
            tmp_path / "a",
            scenes=np.int64(1),
            samples_per_scene=np.int64(2),
            seed=np.int64(3),
            progress=False,
            workers=2,
            render_scale=4,
        )
    )
    kw = dict(scenes=1, samples_per_scene=2, workers=1, **QUICK)
    b = _tree(make_synthetic(tmp_path / "b", seed=3, **kw))
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)
    c = _tree(make_synthetic(tmp_path / "c", seed=4, **kw))
    assert c[f"{VERSION}/sample_annotation.json"] != a[f"{VERSION}/sample_annotation.json"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="worlds are built in forked processes only")
def test_worlds_built_in_worker_processes_write_the_same_dataset(tmp_path, monkeypatch):
    # With workers > 1 the scenes' worlds are built in forked processes and sent back (none in this one):
    # the dataset is the same bytes as with the worlds built here.
    from bev.synthetic import pool

    built_here = []
    build = pool.build_world
    monkeypatch.setattr(pool, "build_world", lambda *key: built_here.append(key) or build(*key))
    kw = dict(scenes=2, samples_per_scene=2, seed=5, **QUICK)
    monkeypatch.setattr(pool, "_WORLDS", {})
    a = _tree(make_synthetic(tmp_path / "a", workers=2, **kw))
    assert built_here == []
    monkeypatch.setattr(pool, "_WORLDS", {})
    b = _tree(make_synthetic(tmp_path / "b", workers=1, **kw))
    assert len(built_here) == 2 and a.keys() == b.keys() and all(a[k] == b[k] for k in a)


def test_render_scale_changes_detail_not_content(tmp_path):
    """A coarser render writes the same scene: same files and tables, full-size JPEGs that agree
    with the default render up to resampling, and the same LiDAR (its own sensor, not the cameras')."""
    kw = dict(scenes=1, samples_per_scene=2, seed=3, progress=False, workers=1)
    a = _tree(make_synthetic(tmp_path / "a", **kw))
    b = _tree(make_synthetic(tmp_path / "b", render_scale=4, **kw))
    assert a.keys() == b.keys()
    for k in a:
        if k.endswith(".json") and not k.endswith(("sample_annotation.json", MANIFEST)):
            assert a[k] == b[k], k
    man_a, man_b = (json.loads(t[MANIFEST]) for t in (a, b))  # the same files; the render scale recorded
    assert man_a["parameters"].pop("render_scale") == 2 and man_b["parameters"].pop("render_scale") == 4
    assert man_a == man_b
    ann_a, ann_b = (json.loads(t[f"{VERSION}/sample_annotation.json"]) for t in (a, b))
    assert [(r["token"], r["translation"], r["size"]) for r in ann_a] == [
        (r["token"], r["translation"], r["size"]) for r in ann_b
    ]
    assert [r["num_lidar_pts"] for r in ann_a] == [r["num_lidar_pts"] for r in ann_b]
    assert all(a[k] == b[k] for k in a if k.endswith(".pcd.bin"))
    jpgs = [k for k in a if k.endswith(".jpg")]
    diffs = []
    for k in jpgs:
        ia, ib = (np.asarray(Image.open(io.BytesIO(t[k])).convert("L"), np.float32) for t in (a, b))
        assert ia.shape == ib.shape == (900, 1600)
        diffs.append(np.abs(ia - ib).mean())
    assert max(diffs) < 2.5, (
        diffs
    )  # grey levels (measured <= 1.7; an 8-pixel shift gives 3.2): edges blur, nothing moves


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"scenes": 0}, ValueError, "scenes must be in 1..10"),
        ({"scenes": 11}, ValueError, "samples_per_scene"),
        ({"samples_per_scene": 0}, ValueError, "samples_per_scene must be >= 1"),
        ({"scenes": 1.5}, TypeError, "scenes must be an integer"),
        ({"workers": 0}, ValueError, "workers must be >= 1"),
        ({"render_scale": 3}, ValueError, "render_scale must be one of 1, 2, 4"),
        ({"image_size": "half"}, ValueError, "image_size must be one of 'full', 'render'"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        make_synthetic(tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()  # nothing written on a bad call


def test_existing_dataset_needs_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user file")
    with pytest.raises(FileExistsError, match="not empty.*overwrite"):
        make_synthetic(out, scenes=1, samples_per_scene=1, **QUICK)
    make_synthetic(out, scenes=1, samples_per_scene=2, overwrite=True, **QUICK)
    with pytest.raises(FileExistsError, match="not empty.*overwrite"):
        make_synthetic(out, scenes=1, samples_per_scene=1, **QUICK)
    first = set(json.loads((out / MANIFEST).read_text())["files"])
    make_synthetic(out, scenes=1, samples_per_scene=1, overwrite=True, **QUICK)
    second = set(json.loads((out / MANIFEST).read_text())["files"])
    assert second < first and all((out / f).is_file() for f in second)
    assert not any((out / f).exists() for f in first - second)  # the old dataset's own files were replaced
    assert (out / "keep.txt").read_text() == "user file"  # other files are left alone


def test_overwrite_keeps_files_it_did_not_write(tmp_path):
    """--overwrite removes only the files its manifest lists (it once deleted a user's samples/MYCAM/mine.jpg)."""
    out = make_synthetic(tmp_path / "out", scenes=1, samples_per_scene=1, **QUICK)
    mine = out / "samples" / "MYCAM" / "mine.jpg"
    mine.parent.mkdir()
    mine.write_bytes(b"user image")
    (out / "samples" / "CAM_FRONT" / "extra.jpg").write_bytes(b"also the user's")
    make_synthetic(out, scenes=1, samples_per_scene=1, seed=5, overwrite=True, **QUICK)
    assert mine.read_bytes() == b"user image" and (out / "samples" / "CAM_FRONT" / "extra.jpg").exists()
    assert json.loads((out / MANIFEST).read_text())["files"]  # the new dataset is recorded


def test_refuses_a_dataset_it_did_not_write(tmp_path):
    out = tmp_path / "real"
    (out / VERSION).mkdir(parents=True)
    (out / VERSION / "scene.json").write_text("[]")
    (out / "samples" / "CAM_FRONT").mkdir(parents=True)
    (out / "samples" / "CAM_FRONT" / "a.jpg").write_bytes(b"real image")
    before = _tree(out)
    with pytest.raises(FileExistsError, match="did not write"):
        make_synthetic(out, scenes=1, samples_per_scene=1, overwrite=True, **QUICK)
    assert _tree(out) == before  # nothing deleted, nothing written
    # A manifest pointing outside --out is refused too, before anything is deleted.
    other = make_synthetic(tmp_path / "syn", scenes=1, samples_per_scene=1, progress=False)
    (other / MANIFEST).write_text(json.dumps({"files": ["../real/samples/CAM_FRONT/a.jpg"], "dirs": []}))
    with pytest.raises(ValueError, match="not inside"):
        make_synthetic(other, scenes=1, samples_per_scene=1, progress=False, overwrite=True)
    assert _tree(out) == before


def test_cli_read_only_out(tmp_path, capsys, monkeypatch):
    import bev.utils.io
    from bev.synthetic import writer

    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    if os.geteuid() == 0:  # root writes through permission bits: make the first write fail as it would

        def denied(*args, dir=None, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied", str(dir))

        monkeypatch.setattr(bev.utils.io, "_new_temporary", lambda path: denied(dir=path.parent))
        monkeypatch.setattr(Path, "mkdir", lambda self, *a, **k: denied(dir=self))
    try:
        assert writer.main(["--out", str(out), "--scenes", "1", "--samples-per-scene", "1", "--workers", "1"]) == 1
    finally:
        out.chmod(0o755)
    err = capsys.readouterr().err
    assert "cannot write the dataset" in err and "Permission denied" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_cli(tmp_path, capsys):
    from bev.synthetic.writer import main

    out = tmp_path / "cli"
    args = ["--out", str(out), "--scenes", "2", "--samples-per-scene", "1", "--seed", "1", "--render-scale", "4"]
    assert main(args) == 0
    assert len(json.loads((out / VERSION / "scene.json").read_text())) == 2
    with pytest.raises(SystemExit) as e:
        main(["--out", str(out), "--scenes", "1", "--samples-per-scene", "1"])
    assert e.value.code == 2 and "not empty" in capsys.readouterr().err


def test_bundled_rig_is_the_real_rig():
    rig = load_rig()
    assert rig["image_size"] == {"width": 1600, "height": 900}
    assert list(rig["camera_order"]) == list(CAMERA_NAMES)
    front = rig["cameras"]["CAM_FRONT"]
    assert front["camera_intrinsic"][0][0] == pytest.approx(1266.417203046554)
    # CAM_FRONT looks along ego +x: the camera z axis in the ego frame.
    assert quaternion_to_matrix(front["rotation"])[:, 2] @ [1, 0, 0] > 0.99


@pytest.mark.slow
def test_default_dataset_is_the_mini_split(tmp_path):
    from nuscenes.nuscenes import NuScenes
    from nuscenes.utils.splits import create_splits_scenes

    from bev.synthetic.writer import DEFAULT_SAMPLES

    root = make_synthetic(tmp_path / "default", progress=False)
    nusc = NuScenes(version=VERSION, dataroot=str(root), verbose=False)
    splits = create_splits_scenes()
    names = sorted(s["name"] for s in nusc.scene)
    assert names == sorted(splits["mini_train"] + splits["mini_val"])
    assert len(nusc.sample) == 10 * DEFAULT_SAMPLES >= 200


def test_every_sample_has_its_occ3d_labels(synthetic_root):
    """bev-make-synthetic writes Occ3D-format occupancy for every sample (gts/<scene>/<token>/labels.npz), which
    the checked reader takes, with roads, objects and free space in the camera-visible voxels."""
    import json

    from bev.tasks.occupancy.grid import CLASS_ID
    from bev.tasks.occupancy.io import read_labels

    scenes = {s["token"]: s["name"] for s in json.loads((synthetic_root / VERSION / "scene.json").read_text())}
    samples = json.loads((synthetic_root / VERSION / "sample.json").read_text())
    seen = set()
    for s in samples:
        labels = read_labels(synthetic_root / "gts" / scenes[s["scene_token"]] / s["token"] / "labels.npz")
        seen |= set(np.unique(labels.semantics[labels.mask_camera.astype(bool)]).tolist())
    assert {CLASS_ID[c] for c in ("driveable_surface", "car", "free")} <= seen


# ----------------------------------------------------------------------------- image size


@pytest.fixture(scope="module")
def sized_sets(tmp_path_factory) -> dict[str, Path]:
    """One scene x 2 samples at render scale 4, the JPEGs at 1600x900 ("full") and at 400x225 ("render")."""
    root = tmp_path_factory.mktemp("sized")
    kw = dict(scenes=1, samples_per_scene=2, seed=3, workers=1, **QUICK)
    return {size: make_synthetic(root / size, image_size=size, **kw) for size in ("full", "render")}


def test_render_size_images_are_the_renders_with_their_intrinsics(sized_sets):
    """image_size="render": the same files and annotations, the intrinsics and sizes of 400x225 images, which hold
    the full-size JPEGs' pixels at a quarter of the resolution; the devkit projects a box to the same place."""
    full, small = (_tree(sized_sets[k]) for k in ("full", "render"))
    assert full.keys() == small.keys()
    differ = {k for k in full if full[k] != small[k]}
    jpgs = {k for k in full if k.endswith(".jpg")}
    assert differ == jpgs | {f"{VERSION}/calibrated_sensor.json", f"{VERSION}/sample_data.json", MANIFEST}
    man_full, man_small = (json.loads(t[MANIFEST]) for t in (full, small))
    assert man_full["parameters"].pop("image_size") == "full" and man_small["parameters"].pop("image_size") == "render"
    assert man_full == man_small
    for k in jpgs:
        big = np.asarray(Image.open(io.BytesIO(full[k])).convert("L"), np.float32)
        im = np.asarray(Image.open(io.BytesIO(small[k])).convert("L"), np.float32)
        assert im.shape == (225, 400)
        assert np.abs(big.reshape(225, 4, 400, 4).mean((1, 3)) - im).mean() < 2.5  # grey levels: resampling only
    from nuscenes.nuscenes import NuScenes
    from nuscenes.utils.geometry_utils import view_points

    nusc = {k: NuScenes(VERSION, dataroot=str(sized_sets[k]), verbose=False) for k in sized_sets}
    checked = 0
    for sd_full in nusc["full"].sample_data:
        if sd_full["sensor_modality"] != "camera":
            continue
        sd_small = nusc["render"].get("sample_data", sd_full["token"])
        assert (sd_small["width"], sd_small["height"]) == (400, 225)
        assert (sd_full["width"], sd_full["height"]) == (1600, 900)
        _, boxes, K_full = nusc["full"].get_sample_data(sd_full["token"])
        _, _, K_small = nusc["render"].get_sample_data(sd_full["token"])
        for box in boxes:
            if box.center[2] > 1.0:
                uv_full = view_points(box.center[:, None], K_full, normalize=True)[:2, 0]
                uv_small = view_points(box.center[:, None], K_small, normalize=True)[:2, 0]
                np.testing.assert_allclose(uv_small, (uv_full + 0.5) / 4 - 0.5, atol=1e-9)
                checked += 1
    assert checked > 10


def test_the_loader_sees_the_same_scene_in_either_image_size(sized_sets):
    """NuScenesBEVDataset on the two sets, the same augmentation drawn: the model's inputs agree (pixels up to
    resampling, every ego point projected to the same crop pixel up to the crop's rounding)."""
    from bev.data.nuscenes import NuScenesBEVDataset

    items = {}
    for size, root in sized_sets.items():
        ds = NuScenesBEVDataset(root, split="mini_train", augment=True, verbose=False, cache_dir=root / "cache")
        torch.manual_seed(0)
        items[size] = [ds[i] for i in range(len(ds))]
    pts = torch.tensor([[x, y, z] for x in (-30.0, -8.0, 8.0, 30.0) for y in (-20.0, 0.0, 20.0) for z in (0.0, 2.0)])
    for a, b in zip(items["full"], items["render"]):
        assert a["images"].shape == b["images"].shape
        assert (a["images"] - b["images"]).abs().mean() < 0.1  # normalised units (~6 grey levels of 255)
        geo = [[x[k].double() for k in ("intrinsics", "rots", "trans", "post_rots", "post_trans")] for x in (a, b)]
        (uv_a, d_a), (uv_b, d_b) = (ego_to_image(pts.double()[None].expand(len(g[0]), -1, -1), *g) for g in geo)
        torch.testing.assert_close(d_a, d_b)
        front = d_a > 1.0
        assert front.sum() > 10 and (uv_a - uv_b)[front].abs().max() <= 1.0  # pixels (measured 0.35)


def test_cli_refuses_samples_per_scene_past_the_bound_before_building_anything(tmp_path, capsys):
    from bev.synthetic.writer import MAX_SAMPLES_PER_SCENE, main

    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "set"), "--samples-per-scene", "1000000000"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"samples_per_scene must be >= 1 and <= {MAX_SAMPLES_PER_SCENE}, got 1000000000" in err
    assert "nuScenes trainval" in err and "Traceback" not in err
    assert not (tmp_path / "set").exists()


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if x.startswith("bev-make-synthetic: error:")]
    return line


def test_cli_under_a_file_size_limit_names_the_cause(tmp_path):
    import resource
    import subprocess
    import sys

    out = tmp_path / "set"
    limit = 64 * 1024  # above the manifest, below a map PNG and a JPEG
    done = subprocess.run(
        [sys.executable, "-m", "bev.synthetic.writer", "--out", str(out), "--scenes", "1", "--samples-per-scene", "1"]
        + ["--render-scale", "4", "--workers", "1"],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    line = _one_error_line(done.stderr)
    assert "File too large" in line and "ulimit -f" in line and str(out) in line
    assert (out / MANIFEST).is_file() and not (out / VERSION / "scene.json").exists()  # incomplete, and says so


def test_cli_ctrl_c_ends_in_one_line_with_status_130(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "set"
    # Enough samples that the rest outlasts the wait below by seconds, however loaded the machine.
    args = ["--out", str(out), "--scenes", "2", "--samples-per-scene", "64", "--render-scale", "4", "--workers", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "bev.synthetic.writer", *args],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the Ctrl-C of a terminal reaches the workers too
        preexec_fn=default_signals,
    )
    deadline = time.monotonic() + 120

    def rendering() -> bool:  # the workers have written a sample's first image
        return (out / MANIFEST).exists() and any((out / "samples").rglob("*.jpg"))

    while not rendering() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the writer ended before it could be interrupted"
    os.killpg(proc.pid, signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130
    line = _one_error_line(err)
    assert "interrupted" in line and "incomplete" in line and "--overwrite" in line
    assert not (out / VERSION / "scene.json").exists()


def test_the_tables_end_with_scene_json_so_a_set_cut_short_never_looks_whole(tmp_path, monkeypatch, capsys):
    from bev.synthetic import writer

    real = writer._write_atomic

    def interrupted_at_sensor(path, data):
        if Path(path).name == "sensor.json":
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(writer, "_write_atomic", interrupted_at_sensor)
    out = tmp_path / "set"
    args = ["--out", str(out), "--scenes", "1", "--samples-per-scene", "1", "--render-scale", "4", "--workers", "1"]
    assert writer.main(args) == 130
    assert "incomplete" in _one_error_line(capsys.readouterr().err)
    assert (out / VERSION / "sample.json").is_file() and not (out / VERSION / "scene.json").exists()


def test_overwrite_removes_scene_json_first_and_keeps_its_manifest(tmp_path, monkeypatch, capsys):
    from bev.synthetic import writer

    out = make_synthetic(tmp_path / "set", scenes=1, samples_per_scene=1, **QUICK)
    real, calls = Path.unlink, []

    def interrupted_second(self, *args, **kwargs):
        calls.append(self)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", interrupted_second)
    args = ["--out", str(out), "--scenes", "1", "--samples-per-scene", "1", "--render-scale", "4", "--workers", "1"]
    assert writer.main([*args, "--overwrite", "--seed", "3"]) == 130
    monkeypatch.undo()
    assert "incomplete" in _one_error_line(capsys.readouterr().err)
    assert not (out / VERSION / "scene.json").exists() and (out / MANIFEST).is_file()
    assert writer.main([*args, "--overwrite"]) == 0  # the manifest still lets --overwrite replace it
    assert (out / VERSION / "scene.json").is_file()
