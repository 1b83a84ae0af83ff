"""The 13 nuScenes tables of a synthetic set (the records of its logs, scenes, samples, sample_data, calibrated
sensors, ego poses, maps, annotations and instances), their tokens, and the render task of each sample they list."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

from bev.data.rig import IMAGE_H, IMAGE_W, MINI_LOCATIONS, load_rig, mini_splits
from bev.geometry import CAMERA_NAMES, yaw_to_quaternion
from bev.synthetic.lidar import SWEEP_DT
from bev.synthetic.pool import _build_worlds, _world
from bev.synthetic.sensors import LIDAR_ROTATION, LIDAR_TRANSLATION, image_scale, scaled_intrinsic
from bev.synthetic.world import SAMPLE_DT, World, annotated_objects

VERSION = "v1.0-mini"
TABLES = (
    "attribute",
    "calibrated_sensor",
    "category",
    "ego_pose",
    "instance",
    "log",
    "map",
    "sample",
    "sample_annotation",
    "sample_data",
    "scene",
    "sensor",
    "visibility",
)
CHANNELS = (*CAMERA_NAMES, "LIDAR_TOP")  # the sensors of every sample, in sensor/sample_data row order
# Real nuScenes v1.0 tokens and names (facts of the public schema).
VISIBILITY = [
    {"description": "visibility of whole object is between 0 and 40%", "token": "1", "level": "v0-40"},
    {"description": "visibility of whole object is between 40 and 60%", "token": "2", "level": "v40-60"},
    {"description": "visibility of whole object is between 60 and 80%", "token": "3", "level": "v60-80"},
    {"description": "visibility of whole object is between 80 and 100%", "token": "4", "level": "v80-100"},
]
ATTRIBUTES = {
    "vehicle.moving": ("cb5118da1ab342aa947717dc53544259", "Vehicle is moving."),
    "vehicle.stopped": (
        "c3246a1e22a14fcb878aa61e69ae3329",
        "Vehicle, with a driver/rider in/on it, is currently stationary but has an intent to move.",
    ),
    "vehicle.parked": (
        "58aa28b1c2a54dc88e169808c07331e3",
        "Vehicle is stationary (usually for longer duration) with no immediate intent to move.",
    ),
    "cycle.with_rider": ("a14936d865eb4216b396adae8cb3939c", "There is someone riding the bicycle or motorcycle."),
    "cycle.without_rider": ("5a655f9751944309a277276b8f473452", "There is NO rider on the bicycle or motorcycle."),
    "pedestrian.sitting_lying_down": ("03aa62109bf043afafdea7d875dd4f43", "The human is sitting or lying down."),
    "pedestrian.standing": ("4d8821270b4a47e3a8a300cbec48188e", "The human is standing."),
    "pedestrian.moving": ("ab83627ff28b465b85c427162dec722f", "The human is moving."),
}
CATEGORIES = {
    "human.pedestrian.adult": "1fa93b757fc74fb197cdd60001ad8abf",
    "human.pedestrian.child": "b1c6de4c57f14a5383d9f963fbdcb5cb",
    "human.pedestrian.wheelchair": "b2d7c6c701254928a9e4d6aac9446d79",
    "human.pedestrian.stroller": "6a5888777ca14867a8aee3fe539b56c4",
    "human.pedestrian.personal_mobility": "403fede16c88426885dd73366f16c34a",
    "human.pedestrian.police_officer": "bb867e2064014279863c71a29b1eb381",
    "human.pedestrian.construction_worker": "909f1237d34a49d6bdd27c2fe4581d79",
    "animal": "63a94dfa99bb47529567cd90d3b58384",
    "vehicle.car": "fd69059b62a3469fbaef25340c0eab7f",
    "vehicle.motorcycle": "dfd26f200ade4d24b540184e16050022",
    "vehicle.bicycle": "fc95c87b806f48f8a1faea2dcc2222a4",
    "vehicle.bus.bendy": "003edbfb9ca849ee8a7496e9af3025d4",
    "vehicle.bus.rigid": "fedb11688db84088883945752e480c2c",
    "vehicle.truck": "6021b5187b924d64be64a702e5570edf",
    "vehicle.construction": "5b3cd6f2bca64b83aa3d0008df87d0e4",
    "vehicle.emergency.ambulance": "732cce86872640628788ff1bb81006d4",
    "vehicle.emergency.police": "7b2ff083a64e4d53809ae5d9be563504",
    "vehicle.trailer": "90d0f6f8e7c749149b1b6c3a029841a8",
    "movable_object.barrier": "653f7efbb9514ce7b81d44070d6208c1",
    "movable_object.trafficcone": "85abebdccd4d46c7be428af5a6173947",
    "movable_object.pushable_pullable": "d772e4bae20f493f98e15a76518b31d7",
    "movable_object.debris": "063c5e7f638343d3a7230bc3641caf97",
    "static_object.bicycle_rack": "0a30519ee16a4619b4f4acfe2d78fb55",
}


def scene_names(n: int) -> list[str]:
    """Names of n synthetic scenes (see the module docstring for the rule)."""
    splits = mini_splits()
    mini_train, mini_val = splits["mini_train"], splits["mini_val"]
    if n < 1 or n > len(mini_train) + len(mini_val):
        raise ValueError(
            f"scenes must be in 1..{len(mini_train) + len(mini_val)} (the v1.0-mini scene names), got {n}; "
            "for more data raise samples_per_scene"
        )
    k = 0 if n == 1 else max(1, int(n / 5 + 0.5))
    return list(mini_train[: n - k]) + list(mini_val[:k])


def _token(seed: int, *key) -> str:
    """A deterministic 32-hex-digit token, nuScenes style."""
    return hashlib.md5("/".join(map(str, ("bev-synthetic", seed) + key)).encode()).hexdigest()


def _log_info(name: str, index: int) -> tuple[str, str, int]:
    """(logfile, date_captured, start timestamp in microseconds) of a scene's log."""
    boston = MINI_LOCATIONS[name].startswith("boston")
    vehicle, tz = ("n008", "-0400") if boston else ("n015", "+0800")
    start = datetime(2018, 7, 18 + index % 10, 9 + index % 8, 7 + 3 * index, 57, tzinfo=timezone.utc)
    logfile = f"{vehicle}-{start:%Y-%m-%d-%H-%M-%S}{tz}"
    return logfile, f"{start:%Y-%m-%d}", int(start.timestamp() * 1e6) + 449377


class _RenderTask(NamedTuple):
    """One sample for a render worker: its world, its files (relative to out) and the objects it annotates."""

    out: Path
    seed: int
    scene: int
    sample: int
    samples: int  # per scene (sizes the world)
    location: str
    cam_files: dict[str, str]  # camera -> JPEG
    lidar_file: str
    annotated: list[int]
    scale: int  # render_scale
    scene_name: str  # the occupancy labels' folder: gts/<scene name>/<sample token>
    occupancy: bool = True  # write the sample's occupancy labels too
    upscale: bool = True  # JPEGs at 1600x900 (image_size "full"), else at the render resolution
    sweeps: tuple = ()  # the LIDAR_TOP sweeps after this key frame: (time in the scene (s), file relative to out)


def _plan(out: Path, names: list[str], workers: int, params: dict) -> tuple[dict, list[list[_RenderTask]]]:
    """Build the scenes' worlds; return the tables that do not need the renders and each scene's sample tasks
    (params: _parameters)."""
    rig = load_rig()
    seed, samples = params["seed"], params["samples_per_scene"]
    _build_worlds([(seed, si, samples, MINI_LOCATIONS[name]) for si, name in enumerate(names)], workers)
    T = _fixed_tables(seed)
    scene_tasks = [_add_scene(T, rig, out, si, name, params) for si, name in enumerate(names)]
    return T, scene_tasks


def _fixed_tables(seed: int) -> dict[str, list[dict]]:
    """All TABLES, with the rows that do not depend on the scenes (visibility, attribute, category, sensor)."""
    T = {name: [] for name in TABLES}
    T["visibility"] = [dict(v) for v in VISIBILITY]
    T["attribute"] = [{"token": tok, "name": n, "description": d} for n, (tok, d) in ATTRIBUTES.items()]
    T["category"] = [
        {"token": tok, "name": n, "description": f"nuScenes category {n}."} for n, tok in CATEGORIES.items()
    ]
    T["sensor"] = [
        {"token": _token(seed, "sensor", ch), "channel": ch, "modality": "lidar" if ch == "LIDAR_TOP" else "camera"}
        for ch in CHANNELS
    ]
    return T


def _add_scene(T: dict, rig: dict, out: Path, si: int, name: str, params: dict) -> list[_RenderTask]:
    """Append scene `si`'s log, calibrated_sensor, scene and per-sample rows; return its samples' render tasks."""
    seed, samples, render_scale = params["seed"], params["samples_per_scene"], params["render_scale"]
    shrink = image_scale(render_scale, params["image_size"])
    location = MINI_LOCATIONS[name]
    world = _world(seed, si, samples, location)
    world.cache_poses([k * SAMPLE_DT for k in range(samples)])  # the render workers forked later inherit them
    logfile, date, t0 = _log_info(name, si)
    log_tok, scene_tok = _token(seed, "log", si), _token(seed, "scene", si)
    T["log"].append(
        {"token": log_tok, "logfile": logfile, "vehicle": logfile[:4], "date_captured": date, "location": location}
    )
    _add_calibrated_sensors(T, rig, seed, si, shrink)
    sample_toks = [_token(seed, "sample", si, k) for k in range(samples)]
    T["scene"].append(
        {
            "token": scene_tok,
            "log_token": log_tok,
            "nbr_samples": samples,
            "first_sample_token": sample_toks[0],
            "last_sample_token": sample_toks[-1],
            "name": name,
            "description": "Synthetic: drive through a road network with junctions, traffic, parked cars, pedestrians.",
        }
    )
    tasks = []
    for k, tok in enumerate(sample_toks):
        ts = t0 + int(round(k * SAMPLE_DT * 1e6))
        T["sample"].append(
            {
                "token": tok,
                "timestamp": ts,
                "prev": sample_toks[k - 1] if k else "",
                "next": sample_toks[k + 1] if k + 1 < samples else "",
                "scene_token": scene_tok,
            }
        )
        files = _add_sample_data(T, world, seed, si, k, samples, tok, ts, logfile, shrink, params["lidar_sweeps"])
        sweeps = _add_sweeps(T, world, seed, si, k, samples, t0, logfile, params["lidar_sweeps"])
        tasks.append(
            _RenderTask(
                out,
                seed,
                si,
                k,
                samples,
                location,
                {c: files[c] for c in CAMERA_NAMES},
                files["LIDAR_TOP"],
                annotated_objects(world, k * SAMPLE_DT),
                render_scale,
                name,
                params["occupancy"],
                shrink == 1,
                sweeps,
            )
        )
    return tasks


def _add_calibrated_sensors(T: dict, rig: dict, seed: int, si: int, shrink: int = 1) -> None:
    """Append scene `si`'s calibrated_sensor rows: the rig's six cameras (for images 1/shrink of 1600x900), then
    the lidar mount."""
    for ch in CAMERA_NAMES:
        cal = rig["cameras"][ch]
        T["calibrated_sensor"].append(
            {
                "token": _token(seed, "calibrated_sensor", si, ch),
                "sensor_token": _token(seed, "sensor", ch),
                "translation": cal["translation"],
                "rotation": cal["rotation"],
                "camera_intrinsic": scaled_intrinsic(cal["camera_intrinsic"], shrink)
                if shrink > 1
                else cal["camera_intrinsic"],
            }
        )
    T["calibrated_sensor"].append(
        {
            "token": _token(seed, "calibrated_sensor", si, "LIDAR_TOP"),
            "sensor_token": _token(seed, "sensor", "LIDAR_TOP"),
            "translation": LIDAR_TRANSLATION,
            "rotation": LIDAR_ROTATION,
            "camera_intrinsic": [],
        }
    )


def _add_sample_data(
    T: dict,
    world: World,
    seed: int,
    si: int,
    k: int,
    samples: int,
    sample_tok: str,
    ts: int,
    logfile: str,
    shrink: int,
    sweeps: int = 0,
) -> dict[str, str]:
    """Append sample k's ego_pose and sample_data rows, one per channel; return channel -> file (relative to out).
    LIDAR_TOP's prev / next are the `sweeps` sweeps between key frames where there are any (_add_sweeps)."""
    files = {}
    for ch in CHANNELS:
        cam = ch != "LIDAR_TOP"
        files[ch] = f"samples/{ch}/{logfile}__{ch}__{ts}.{'jpg' if cam else 'pcd.bin'}"
        chain = sweeps if ch == "LIDAR_TOP" else 0
        prev = (_sweep_token(seed, si, k - 1, chain) if chain else _key_token(seed, si, k - 1, ch)) if k else ""
        following = _sweep_token(seed, si, k, 1) if chain else _key_token(seed, si, k + 1, ch)
        size = (IMAGE_H // shrink, IMAGE_W // shrink) if cam else (0, 0)
        rec = _sensor_record(world, seed, si, ch, k * SAMPLE_DT, ts, files[ch], sample_tok, True, size)
        _append_record(T, {**rec, "token": _key_token(seed, si, k, ch)}, prev, following if k + 1 < samples else "")
    return files


def _key_token(seed: int, si: int, k: int, ch: str) -> str:
    return _token(seed, "sample_data", si, k, ch)


def _sweep_token(seed: int, si: int, k: int, j: int) -> str:
    """The token of LIDAR_TOP sweep j (1-based) after key frame k."""
    return _token(seed, "sample_data", si, k, "LIDAR_TOP", "sweep", j)


def _sweep_time(k: int, j: int, sweeps: int) -> float:
    """Scene time (s) of sweep j of `sweeps` after key frame k: 20 Hz, the last one SWEEP_DT before key frame
    k + 1 (the sweeps a multi-sweep loader takes with it)."""
    return (k + 1) * SAMPLE_DT - (sweeps + 1 - j) * SWEEP_DT


def _add_sweeps(
    T: dict, world: World, seed: int, si: int, k: int, samples: int, t0: int, logfile: str, sweeps: int
) -> tuple[tuple[float, str], ...]:
    """Append the ego_pose and sample_data rows of the LIDAR_TOP sweeps between key frames k and k + 1 (none after
    the last); return their (scene time, file)s. A sweep's sample is the key frame nearest in time (the next on a
    tie), as in nuScenes."""
    if k + 1 >= samples or not sweeps:
        return ()
    out = []
    for j in range(1, sweeps + 1):
        t = _sweep_time(k, j, sweeps)
        ts = t0 + int(round(t * 1e6))
        name = f"sweeps/LIDAR_TOP/{logfile}__LIDAR_TOP__{ts}.pcd.bin"
        nearest = k + 1 if (k + 1) * SAMPLE_DT - t <= t - k * SAMPLE_DT else k
        rec = _sensor_record(world, seed, si, "LIDAR_TOP", t, ts, name, _token(seed, "sample", si, nearest), False)
        prev = _sweep_token(seed, si, k, j - 1) if j > 1 else _key_token(seed, si, k, "LIDAR_TOP")
        following = _sweep_token(seed, si, k, j + 1) if j < sweeps else _key_token(seed, si, k + 1, "LIDAR_TOP")
        _append_record(T, {**rec, "token": _sweep_token(seed, si, k, j)}, prev, following)
        out.append((t, name))
    return tuple(out)


def _sensor_record(
    world: World,
    seed: int,
    si: int,
    ch: str,
    t: float,
    ts: int,
    filename: str,
    sample_tok: str,
    key: bool,
    size: tuple[int, int] = (0, 0),
) -> dict:
    """A sample_data row (without token, prev, next) of an image of `size` (height, width; (0, 0) for a cloud),
    with its ego pose at scene time t under "_pose"."""
    ego_t, ego_yaw = world.ego_pose(t)
    return {
        "sample_token": sample_tok,
        "calibrated_sensor_token": _token(seed, "calibrated_sensor", si, ch),
        "timestamp": ts,
        "fileformat": "pcd" if ch == "LIDAR_TOP" else "jpg",
        "is_key_frame": key,
        "height": size[0],
        "width": size[1],
        "filename": filename,
        "_pose": {"timestamp": ts, "rotation": yaw_to_quaternion(ego_yaw), "translation": ego_t.tolist()},
    }


def _append_record(T: dict, rec: dict, prev: str, following: str) -> None:
    """Append a sample_data row and its ego_pose, which shares its token (as in nuScenes)."""
    pose = rec.pop("_pose")
    T["ego_pose"].append({"token": rec["token"], **pose})
    T["sample_data"].append(
        {
            "token": rec["token"],
            "sample_token": rec["sample_token"],
            "ego_pose_token": rec["token"],
            **{k: v for k, v in rec.items() if k not in ("token", "sample_token")},
            "prev": prev,
            "next": following,
        }
    )


def _add_maps(T: dict, out: Path, seed: int, names: list[str]) -> list[tuple]:
    """Append one map row per location (after the logs it lists); return the tasks that write their PNGs."""
    map_tasks = []
    for loc, scenes_here in _map_groups(names).items():
        tok = _token(seed, "map", loc)
        T["map"].append(
            {
                "category": "semantic_prior",
                "token": tok,
                "filename": f"maps/{tok}.png",
                "log_tokens": [T["log"][si]["token"] for si in scenes_here],
            }
        )
        map_tasks.append((out / "maps" / f"{tok}.png", seed, loc))
    return map_tasks


def _map_groups(names: list[str]) -> dict[str, list[int]]:
    """Location -> indices of its scenes (one map per location, as in nuScenes)."""
    by_loc: dict[str, list[int]] = {}
    for si, name in enumerate(names):
        by_loc.setdefault(MINI_LOCATIONS[name], []).append(si)
    return dict(sorted(by_loc.items()))


def _add_annotations(T: dict, tasks: list[_RenderTask], results: dict) -> None:
    """Append one scene's sample_annotation and instance rows, each object's annotations linked in sample order."""
    first = tasks[0]
    world = _world(first.seed, first.scene, first.samples, first.location)
    tracks: dict[int, list[dict]] = {}
    for task in tasks:  # in sample order
        vis, lidar = results[task.scene, task.sample]
        for i in task.annotated:
            tracks.setdefault(i, []).append(_annotation(world, task, i, vis[i], lidar[i]))
    for i in sorted(tracks):
        recs = tracks[i]
        for a, b in zip(recs, recs[1:]):
            a["next"], b["prev"] = b["token"], a["token"]
        T["instance"].append(
            {
                "token": recs[0]["instance_token"],
                "category_token": CATEGORIES[world.objects[i].category],
                "nbr_annotations": len(recs),
                "first_annotation_token": recs[0]["token"],
                "last_annotation_token": recs[-1]["token"],
            }
        )
    T["sample_annotation"].extend(sorted((r for recs in tracks.values() for r in recs), key=lambda r: r["token"]))


def _annotation(world: World, task: _RenderTask, i: int, visibility: str, num_lidar_pts: int) -> dict:
    """The sample_annotation row of object i in the task's sample (prev/next are linked per track)."""
    seed, si, k = task.seed, task.scene, task.sample
    obj = world.objects[i]
    centre, yaw = world.object_pose(i, k * SAMPLE_DT)
    return {
        "token": _token(seed, "sample_annotation", si, k, i),
        "sample_token": _token(seed, "sample", si, k),
        "instance_token": _token(seed, "instance", si, i),
        "visibility_token": visibility,
        "attribute_tokens": [ATTRIBUTES[obj.attribute][0]] if obj.attribute else [],
        "translation": centre.tolist(),
        "size": list(obj.size),
        "rotation": yaw_to_quaternion(yaw),
        "prev": "",
        "next": "",
        "num_lidar_pts": num_lidar_pts,
        "num_radar_pts": 0,
    }


def _table_json(rows: list[dict]) -> str:
    """A table's text, as the devkit's files have it (one item per line)."""
    return json.dumps(rows, indent=0)
