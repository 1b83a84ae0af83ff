"""Synthetic dataset in the exact nuScenes v1.0-mini format (the embedded default).

`make_synthetic(out, scenes, samples_per_scene, seed)` / `bev-make-synthetic --out DIR` write

    DIR/v1.0-mini/{attribute,calibrated_sensor,category,ego_pose,instance,log,map,sample,
                   sample_annotation,sample_data,scene,sensor,visibility}.json
    DIR/samples/CAM_*/<logfile>__<CAM>__<timestamp>.jpg      1600x900 renders (bev.synthetic.raycast), or
                                                               at the render resolution (image_size="render")
    DIR/samples/LIDAR_TOP/<logfile>__LIDAR_TOP__<timestamp>.pcd.bin
    DIR/maps/<token>.png                                       drivable-area mask, 0.1 m/pixel
    DIR/maps/expansion/<location>.json                         HD map, map expansion v1.3 (bev.synthetic.mapjson)
    DIR/gts/<scene name>/<sample token>/labels.npz             Occ3D-format occupancy (bev.synthetic.occupancy)
    DIR/.bev_synthetic_manifest.json                           what this writer wrote (all --overwrite deletes)
                                                               and with which parameters

The occupancy labels cost about a quarter of the writing; `occupancy=False` (--no-occupancy) leaves gts/ out
and writes every other file the same, and `add_occupancy` (--occupancy-only) adds it later to a set written
so: the files a full write gives, byte for byte, its manifest included.

which the unmodified devkit loads with `NuScenes("v1.0-mini", dataroot=DIR)` and
`NuScenesMap(DIR, log["location"])`. Each scene drives through the road network of its real
mini scene's location (bev.synthetic.roads); scenes at one location share its map. Key frames
only (2 Hz); every sensor of a sample shares the sample's timestamp and ego pose, so the
ego frame of the LIDAR_TOP sample_data is exactly the frame the cameras were rendered in.

Images are ray-cast at 1600x900 / render_scale (default bev.synthetic.raycast.RENDER_SCALE = 2:
800x450) and upscaled bilinearly to 1600x900 JPEGs (image_size="render": written as they are, with the
intrinsics of that size); visibility tokens come from the render-resolution instance-id buffers (visible
pixels of an object over the pixels it covers with nothing in front, summed over the six cameras). Objects
within 60 m of the ego are annotated, with what the devkit's DetectionEval reads: a category of each of its 10
detection classes, at most one attribute (vehicle.moving/parked/stopped, cycle.with_rider/without_rider,
pedestrian.moving/standing; none for barriers and cones), num_lidar_pts counted in the LIDAR_TOP cloud written
with the images, num_radar_pts 0 (no radar is written), and prev/next links along each
object's track, so that `nusc.box_velocity` gives its velocity.

Scene names (so `create_splits_scenes()["mini_train"/"mini_val"]` work unchanged): the
first n - k scenes take the mini_train names in order, the last k = max(1, floor(n / 5 + 0.5))
the mini_val names (n >= 2); n = 10 is exactly the real mini split, n = 2 gives
scene-0061 (train) + scene-0103 (val), n = 1 only scene-0061. More than 10 scenes is an
error: v1.0-mini has 10 scene names, so ask for more samples per scene instead.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import gc
import hashlib
import json
import math
import multiprocessing as mp
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import cv2
import numpy as np
from tqdm import tqdm

from bev.data.rig import IMAGE_H, IMAGE_W, MINI_LOCATIONS, load_rig, mini_splits
from bev.geometry import CAMERA_NAMES, quaternion_to_matrix, yaw_to_quaternion
from bev.synthetic import raycast
from bev.synthetic.mapjson import map_expansion
from bev.synthetic.occupancy import labels_path, write_sample_occupancy
from bev.synthetic.occupancy import prepare as prepare_occupancy
from bev.synthetic.raycast import visibility_level
from bev.synthetic.roads import fill, road_map
from bev.synthetic.world import SAMPLE_DT, World, annotated_objects, build_world
from bev.utils.io import atomic_write

VERSION = "v1.0-mini"
DEFAULT_SCENES = 10
DEFAULT_SAMPLES = 24
# 10 scenes x 5000 key frames are more than nuScenes trainval's 34,149, and a world's building time grows faster
# than its drive (one scene on one core: 2000 samples 10 s, 5000 37 s, 10000 102 s).
MAX_SAMPLES_PER_SCENE = 5000
JPEG_QUALITY = 90
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
# LIDAR_TOP mount: the real position (m) and a -90 degree yaw (lidar x points to the ego's right).
LIDAR_TRANSLATION = [0.943713, 0.0, 1.84023]
LIDAR_ROTATION = yaw_to_quaternion(-math.pi / 2)
LIDAR_PX_PER_POINT = 100  # one lidar point inside an object's box per 100 visible full-resolution pixels (max 200)
MANIFEST = ".bev_synthetic_manifest.json"  # what this writer wrote in --out: all it ever deletes
# Written last and removed first: a set that has it is whole (`make train` tests it before writing a set).
COMPLETE_MARK = f"{VERSION}/scene.json"
MAP_RES = 0.1  # metres per pixel of the maps/<token>.png drivable-area masks (as in nuScenes)


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


# ----------------------------------------------------------------------------- rendering worker


_WORLDS: dict[tuple, World] = {}  # (seed, scene, samples, location) -> its world, the last WORLDS_KEPT built
WORLDS_KEPT = 16


def _world(seed: int, scene: int, samples: int, location: str) -> World:
    """build_world, cached: the tables, the renders and the annotations all read the same world."""
    key = (seed, scene, samples, location)
    if key not in _WORLDS:
        _keep_world(key, build_world(*key))
    return _WORLDS[key]


def _keep_world(key: tuple, world: World) -> None:
    _WORLDS[key] = world
    while len(_WORLDS) > WORLDS_KEPT:
        del _WORLDS[next(iter(_WORLDS))]  # the oldest


def _build_worlds(keys: list[tuple], workers: int) -> None:
    """Build the worlds of `keys` (_world) in `workers` forked processes when there are several: a scene's
    world takes 1-2 s of one core, and the tables need them all before the renders start."""
    todo = [k for k in dict.fromkeys(keys) if k not in _WORLDS]
    if workers < 2 or len(todo) < 2 or "fork" not in mp.get_all_start_methods():
        for key in todo:
            _world(*key)
        return
    for seed, location in sorted({(k[0], k[3]) for k in todo}):
        road_map(seed, location)  # once, before the fork: every worker (and the render workers later) shares them
    built = dict(_in_workers(_build_world_task, todo, workers))
    for key in todo:  # in the order asked (the cache keeps the last WORLDS_KEPT)
        built[key].road = road_map(key[0], key[3])
        _keep_world(key, built[key])


def _build_world_task(key: tuple) -> tuple[tuple, World]:
    """A world without its road map, which the parent has: one copy per location, as if built there (a copy per
    world would multiply the objects every forked render worker's garbage collections go through)."""
    world = build_world(*key)
    world.road = None
    return key, world


class WorkerError(RuntimeError):
    """A worker process failed or died: the message says which and what to do."""


def _in_workers(fn, jobs: list, workers: int, initializer=None):
    """fn(job) for every job in `workers` processes (forked: they share what this one built; spawned where fork
    does not exist), each result yielded as it comes, in any order. A job's exception is raised here as soon as it
    comes, and a worker that dies (killed, out of memory) raises WorkerError: the other jobs are cancelled and
    the workers stopped, never waited for."""
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    start = functools.partial(_start_worker, initializer)
    pool = ProcessPoolExecutor(min(workers, len(jobs)), mp_context=ctx, initializer=start)
    done = False
    try:
        for future in as_completed([pool.submit(fn, job) for job in jobs]):
            yield future.result()
        done = True
    except BrokenProcessPool:
        raise WorkerError(
            "a bev-make-synthetic worker process died (killed, or out of memory?); run it again, "
            "with fewer --workers if memory is short"
        ) from None
    finally:
        if not done:  # an error, or the caller stopped early: stop the workers now
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.terminate()
        pool.shutdown(wait=True, cancel_futures=True)


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


def _start_worker(initializer=None) -> None:
    """A worker leaves Ctrl-C to the parent, which stops it: no traceback per worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if initializer is not None:
        initializer()


def _worker_init() -> None:
    """Set up a render worker process."""
    import torch

    torch.set_num_threads(1)  # one process per core; torch threads would only contend
    cv2.setNumThreads(0)  # the same for OpenCV's resize threads (0: none, the caller's thread only)
    # What the parent built (worlds, tables) stays out of this process's garbage collections: they would go
    # through it all again and again, copying each page they touch from the parent.
    gc.freeze()


def lidar_points(
    world: World,
    t: float,
    annotated: list[int],
    counts: dict,
    rng: np.random.Generator,
    scale: int = raycast.RENDER_SCALE,
):
    """A small LIDAR_TOP cloud (N, 5: x, y, z, intensity, ring) in the lidar frame, and points per object.

    Ground rings (minus the ground under objects) plus, for each annotated object, points
    inside its box in proportion to its visible pixels (counts at render scale `scale`, so any
    scale gives the same density); num_lidar_pts is then the true count of cloud points in each box.
    """
    ground = _ground_rings()
    boxes, pts = _object_points(world, t, annotated, counts, rng, scale)
    cloud = np.concatenate([ground] + pts)
    under, inside = _points_in_boxes(cloud, boxes)
    under[len(ground) :] = False  # only ground points are dropped: the lidar cannot see the ground under an object
    per_obj = {i: int(np.count_nonzero(~under[idx])) for i, idx in inside}
    cloud = cloud[~under]
    R_l = quaternion_to_matrix(LIDAR_ROTATION)
    cloud[:, :3] = (cloud[:, :3] - np.array(LIDAR_TRANSLATION)) @ R_l  # ego -> lidar: R^T (p - t)
    return cloud.astype(np.float32), per_obj


def _ground_rings() -> np.ndarray:
    """The ground points (N, 5) of the lidar's 32 rings in the ego frame, 64 azimuths each."""
    rings = np.arange(32)
    r = 3.0 * 1.09**rings  # 3 m .. ~45 m
    az = np.linspace(-math.pi, math.pi, 64, endpoint=False)
    return np.stack(
        [
            np.outer(r, np.cos(az)).ravel(),
            np.outer(r, np.sin(az)).ravel(),
            np.zeros(r.size * az.size),
            np.full(r.size * az.size, 10.0),
            np.repeat(rings, az.size).astype(np.float64),
        ],
        -1,
    )


def _object_points(
    world: World, t: float, annotated: list[int], counts: dict, rng: np.random.Generator, scale: int
) -> tuple[list[tuple], list[np.ndarray]]:
    """Each annotated object's box in the ego frame (index, rotation object -> ego, centre, half size) and its
    points (n, 5), n in proportion to its visible pixels."""
    ego_t, ego_yaw = world.ego_pose(t)
    c, s = math.cos(ego_yaw), math.sin(ego_yaw)
    R_ge = np.array([[c, -s, 0], [s, c, 0], [0, 0, 1.0]])  # ego -> global
    boxes, pts = [], []
    for i in annotated:
        obj = world.objects[i]
        centre, yaw = world.object_pose(i, t)
        a = yaw - ego_yaw
        R = np.array([[math.cos(a), -math.sin(a), 0], [math.sin(a), math.cos(a), 0], [0, 0, 1.0]])  # object -> ego
        c_ego = R_ge.T @ (centre - ego_t)
        half = np.array([obj.size[1], obj.size[0], obj.size[2]]) / 2
        boxes.append((i, R, c_ego, half))
        n = int(min(200, counts.get(i, (0, 0))[0] * scale * scale // LIDAR_PX_PER_POINT))
        local = rng.uniform(-0.9, 0.9, (n, 3)) * half  # strictly inside the box
        pts.append(np.concatenate([local @ R.T + c_ego, np.full((n, 1), 60.0), rng.integers(0, 32, (n, 1))], 1))
    return boxes, pts


def _points_in_boxes(cloud: np.ndarray, boxes: list[tuple]) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
    """A mask of the cloud points within 0.05 m of any box, and per box (index, the points inside it)."""
    # Points in each box, in its own frame; a box only tests the points within its reach in x
    # (points sorted by x; the reach covers the 0.05 m margin below).
    order = np.argsort(cloud[:, 0], kind="stable")
    xs, under, inside = cloud[order, 0], np.zeros(len(cloud), bool), []
    for i, R, c_ego, half in boxes:
        reach = math.hypot(half[0], half[1]) + 0.1
        near = order[np.searchsorted(xs, c_ego[0] - reach) : np.searchsorted(xs, c_ego[0] + reach, "right")]
        local = np.abs((cloud[near, :3] - c_ego) @ R)  # rows: R^T (p - c)
        under[near[np.all(local <= half + 0.05, axis=1)]] = True
        inside.append((i, near[np.all(local <= half, axis=1)]))
    return under, inside


def _render_task(task: _RenderTask):
    """Render and write one sample's files; return per-object visibility and lidar counts."""
    files, vis, per_obj = _sample_files(task)
    for rel, data in files.items():
        with _naming(task.out / rel):
            (task.out / rel).write_bytes(data)
    return task.scene, task.sample, vis, per_obj


def _sample_files(task: _RenderTask) -> tuple[dict[str, bytes], dict, dict]:
    """Render one sample: ({file relative to out: its bytes} of the images and the lidar cloud, per-object
    visibility, per-object lidar counts); its occupancy labels are written here when task.occupancy."""
    out, seed, scene, sample, samples, location, cam_files, lidar_file, annotated, scale, scene_name, occ, up = task
    world = _world(seed, scene, samples, location)
    t = sample * SAMPLE_DT
    parts = raycast.sample_parts(world, t)  # placed once for the cameras, the occupancy labels and its lidar views
    images, counts = raycast.render_sample(world, t, scale, parts)
    if occ:
        write_sample_occupancy(out, scene_name, _token(seed, "sample", scene, sample), world, t, images, scale, parts)
    files = {}
    for name in CAMERA_NAMES:
        img = (images[name].image * 255.0 + 0.5).clip(0, 255).astype(np.uint8)
        # RGB -> BGR before upscaling (same pixels): a contiguous array encodes ~3x faster than a flipped view.
        img = cv2.cvtColor(img, cv2.COLOR_RGB2BGR)
        if up and scale > 1:
            img = cv2.resize(img, (IMAGE_W, IMAGE_H), interpolation=cv2.INTER_LINEAR)
        ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
        if not ok:
            raise RuntimeError(f"JPEG encoding failed for {cam_files[name]}")
        files[cam_files[name]] = buf.tobytes()
    rng = np.random.default_rng([seed, scene, sample, 7])
    cloud, per_obj = lidar_points(world, t, annotated, counts, rng, scale)
    files[lidar_file] = cloud.tobytes()
    vis = {i: visibility_level(*counts.get(i, (0, 0))) for i in annotated}
    return files, vis, per_obj


def _occupancy_task(task: _RenderTask):
    """Write one sample's occupancy labels alone (under task.out): the six cameras' depths are all they need of
    the renders (raycast.render_depth, the same values as render_sample's)."""
    world = _world(task.seed, task.scene, task.samples, task.location)
    t = task.sample * SAMPLE_DT
    token = _token(task.seed, "sample", task.scene, task.sample)
    write_sample_occupancy(task.out, task.scene_name, token, world, t, None, task.scale, raycast.sample_parts(world, t))
    return task.scene, task.sample


# ----------------------------------------------------------------------------- tables


def _write_atomic(path: Path, data: bytes | str) -> None:
    """Write a file whole or not at all (bev.utils.io.atomic_write: the umask applies)."""
    with _naming(path):
        atomic_write(path, data.encode() if isinstance(data, str) else data)


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An OSError of a write names the file (a failed write() does not)."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e


def _read_manifest(out: Path) -> dict:
    """The manifest of the dataset this writer left in `out`, checked (every path inside `out`): files, dirs and
    parameters (None in a manifest of a writer that did not record them)."""
    path = out / MANIFEST
    try:
        m = json.loads(path.read_text())
        files, dirs, params = list(m["files"]), list(m["dirs"]), m.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise TypeError(f"parameters is {params!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"{path} is not a bev-make-synthetic manifest ({e}); remove the dataset by hand or choose another --out"
        ) from None
    root = out.resolve()
    for rel in files + dirs:
        if not isinstance(rel, str) or not (out / rel).resolve().is_relative_to(root) or (out / rel).resolve() == root:
            raise ValueError(
                f"{path} lists {rel!r}, which is not inside {out}; remove the dataset by hand or choose another --out"
            )
    return {"files": files, "dirs": dirs, "parameters": params}


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse (nothing deleted) an --out that is a file, holds data this writer did not write, or needs overwrite."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} exists and is not a directory")
    if not out.exists() or not any(out.iterdir()):
        return
    if (out / MANIFEST).is_file():
        _read_manifest(out)
        if not overwrite:
            raise FileExistsError(
                f"--out {out} exists and is not empty (a synthetic dataset); choose a new directory or "
                "pass overwrite=True (--overwrite) to replace the dataset in it"
            )
        return
    foreign = [name for name in (VERSION, "samples", "sweeps", "maps") if (out / name).exists()]
    if foreign:
        raise FileExistsError(
            f"--out {out} holds a nuScenes dataset that bev-make-synthetic did not write "
            f"({', '.join(foreign)} but no {MANIFEST}); it never deletes what it did not write: "
            "choose another directory"
        )
    if not overwrite:
        raise FileExistsError(
            f"--out {out} exists and is not empty; choose a new directory or pass "
            "overwrite=True (--overwrite) to write the dataset next to the files in it"
        )


def _begin(out: Path, files: list[str], parameters: dict) -> None:
    """Remove the previous dataset this writer recorded in `out` (only its files, and its directories left
    empty), create the directories of `files` and record them all in the manifest, with the parameters that
    write them, before writing any."""
    if (out / MANIFEST).is_file():
        shutil.rmtree(out / STAGING, ignore_errors=True)  # an interrupted add_occupancy's labels
        old = _read_manifest(out)
        if COMPLETE_MARK in old["files"]:  # first: a set cut short from here on is not taken for a whole one
            (out / COMPLETE_MARK).unlink(missing_ok=True)
        for rel in old["files"]:
            (out / rel).unlink(missing_ok=True)
        for rel in sorted(old["dirs"], key=lambda d: -len(Path(d).parts)):
            try:
                (out / rel).rmdir()
            except OSError:  # not empty (someone else's files) or already gone
                pass
        # The old manifest stays until the new one replaces it: a set cut short meanwhile is still this writer's.
    # Sorted by name: the manifest is the same bytes every run, and a parent (a prefix) is created before its children.
    dirs = sorted({str(p) for f in files for p in Path(f).parents if str(p) != "."})
    created = [d for d in dirs if not (out / d).exists()]
    out.mkdir(parents=True, exist_ok=True)
    for d in created:
        (out / d).mkdir(exist_ok=True)
    _write_manifest(out, files, created, parameters)


def _write_manifest(out: Path, files: list[str], dirs: list[str], parameters: dict) -> None:
    """out/MANIFEST: the same bytes for the same dataset (sorted lists, parameters in _parameters' order)."""
    record = {
        "written_by": "bev-make-synthetic",
        "parameters": parameters,
        "files": sorted(files),
        "dirs": sorted(dirs),
    }
    _write_atomic(out / MANIFEST, json.dumps(record, indent=0))


def _parameters(
    scenes: int, samples_per_scene: int, seed: int, render_scale: int, occupancy: bool, image_size: str
) -> dict:
    """What decides a dataset's bytes, as the manifest records it (workers do not)."""
    return {
        "scenes": scenes,
        "samples_per_scene": samples_per_scene,
        "seed": seed,
        "render_scale": render_scale,
        "occupancy": occupancy,
        "image_size": image_size,
    }


STAGING = ".bev_synthetic_gts.partial"  # add_occupancy writes gts/ here, then moves it into place whole


RENDER_SCALES = (1, 2, 4)  # divisors of 1600x900 that keep whole pixels
# The JPEGs' size: "full" 1600x900 as nuScenes' cameras (the renders upscaled), or "render" the render resolution
# itself, with the intrinsics of that size (the same scene, no pixels made up: a 1/scale**2 of the JPEG work).
IMAGE_SIZES = ("full", "render")


def _check_image_size(image_size) -> str:
    if image_size not in IMAGE_SIZES:
        raise ValueError(f"image_size must be one of {', '.join(map(repr, IMAGE_SIZES))}, got {image_size!r}")
    return image_size


def image_scale(render_scale: int, image_size: str) -> int:
    """How many times smaller than 1600x900 the written JPEGs are."""
    return render_scale if image_size == "render" else 1


def scaled_intrinsic(K, scale: int) -> list[list[float]]:
    """A 1600x900 camera matrix for its image 1/scale the size: pixel centres map by u' + 0.5 = (u + 0.5) / scale,
    as raycast.downscale's post_rot / post_tran."""
    post_rot, post_tran = raycast.downscale(scale)
    P = post_rot.double().numpy()
    P[:2, 2] = post_tran[:2].double().numpy()
    return (P @ np.asarray(K, np.float64)).tolist()


def _check_render_scale(scale) -> int:
    """`scale` as an int if it is one of RENDER_SCALES, else a ValueError."""
    if isinstance(scale, bool) or not isinstance(scale, (int, np.integer)) or int(scale) not in RENDER_SCALES:
        raise ValueError(
            f"render_scale must be one of {', '.join(map(str, RENDER_SCALES))} "
            f"(ray-cast at 1600x900 / render_scale), got {scale!r}"
        )
    return int(scale)


def _validate(scenes, samples_per_scene, seed, workers) -> list[str]:
    """Check the arguments (clear errors, nothing written); return the scene names."""
    for name, v in (("scenes", scenes), ("samples_per_scene", samples_per_scene), ("seed", seed), ("workers", workers)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name} must be an integer, got {v!r}")
    if not 1 <= samples_per_scene <= MAX_SAMPLES_PER_SCENE:
        raise ValueError(
            f"samples_per_scene must be >= 1 and <= {MAX_SAMPLES_PER_SCENE}, got {samples_per_scene}: 10 scenes x "
            f"{MAX_SAMPLES_PER_SCENE} are more key frames than nuScenes trainval, and a scene's world takes longer to "
            "build than its drive grows (5000: ~40 s)"
        )
    if seed < 0:  # NumPy seeds are non-negative
        raise ValueError(f"seed must be >= 0, got {seed}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return scene_names(int(scenes))


def make_synthetic(
    out,
    scenes: int = DEFAULT_SCENES,
    samples_per_scene: int = DEFAULT_SAMPLES,
    seed: int = 0,
    overwrite: bool = False,
    workers: int = 2,
    progress: bool = True,
    render_scale: int = raycast.RENDER_SCALE,
    occupancy: bool = True,
    image_size: str = "full",
) -> Path:
    """Write the synthetic nuScenes-format dataset to `out` and return its path (the dataroot).

    `out` must not exist or be empty unless overwrite=True, which first removes the files a
    previous run recorded in `out`/MANIFEST (and its directories left empty) and nothing else;
    a directory holding a nuScenes dataset without that manifest is refused. `workers` render processes
    share the samples; the result is identical for any number of workers. `render_scale` (one of
    RENDER_SCALES) ray-casts at 1600x900 / render_scale: 4 (400x225) is 3-4x faster to write and
    still above the 352x128 input of the embedded default (an LSS resize of ~0.22). `occupancy=False` leaves the
    Occ3D labels (gts/, about a quarter of the work) out; add_occupancy adds them later. `image_size` (IMAGE_SIZES):
    "render" writes the JPEGs at the render resolution with their intrinsics, not upscaled to 1600x900.
    """
    names = _validate(scenes, samples_per_scene, seed, workers)
    render_scale, image_size = _check_render_scale(render_scale), _check_image_size(image_size)
    samples_per_scene, seed, workers = int(samples_per_scene), int(seed), int(workers)  # numpy ints -> JSON-safe
    out = Path(out)
    _check_out(out, overwrite)
    params = _parameters(len(names), samples_per_scene, seed, render_scale, bool(occupancy), image_size)
    T, scene_tasks = _plan(out, names, workers, params)
    tasks = [task for scene in scene_tasks for task in scene]
    map_tasks = _add_maps(T, out, seed, names)
    _begin(out, _dataset_files(tasks, T["map"], names, bool(occupancy)), params)
    map_tasks += [("expansion", out, seed, loc) for loc in _map_groups(names)]  # HD maps, written alongside too
    results = _render(tasks, map_tasks, workers, render_scale, samples_per_scene, progress)
    for scene in scene_tasks:
        _add_annotations(T, scene, results)
    for name in sorted(TABLES, key=lambda n: f"{VERSION}/{n}.json" == COMPLETE_MARK):  # the mark last
        _write_atomic(out / VERSION / f"{name}.json", _table_json(T[name]))
    return out


class NotTheSameSet(ValueError):
    """add_occupancy's --out was not written by this bev-make-synthetic with these parameters: the message says
    what differs and what to do."""


def add_occupancy(
    out,
    scenes: int = DEFAULT_SCENES,
    samples_per_scene: int = DEFAULT_SAMPLES,
    seed: int = 0,
    workers: int = 2,
    progress: bool = True,
    render_scale: int = raycast.RENDER_SCALE,
    image_size: str | None = None,
) -> int:
    """Add the Occ3D labels (gts/) to a set make_synthetic(occupancy=False) wrote in `out` with the same
    parameters; return how many label files were written (0: the set has them all already).

    Nothing else is rewritten: the result, manifest included, is byte for byte what make_synthetic with the
    labels writes. The set is checked first, and refused (NotTheSameSet, nothing written) unless its manifest
    records these parameters (or, from a writer that did not record them, lists the files they give), its tables
    that do not depend on the renders (scenes, samples, sample_data, ego poses, sensors, maps) are the bytes these
    parameters give, and the first sample of its first and last scenes renders to its images and LiDAR cloud
    (which catches another render scale or another version of the renderer). `image_size` None: the one the
    manifest records ("full" if it records none). The labels are written to
    out/STAGING and moved to gts/ when all are there, so a gts/ folder is always complete.
    """
    names = _validate(scenes, samples_per_scene, seed, workers)
    render_scale = _check_render_scale(render_scale)
    if image_size is not None:
        _check_image_size(image_size)
    samples_per_scene, seed, workers = int(samples_per_scene), int(seed), int(workers)
    out = Path(out)
    again = f"write it with bev-make-synthetic --out {out} (--overwrite replaces a set it wrote)"
    if not out.is_dir():
        raise NotTheSameSet(
            f"--out {out} holds no set to add occupancy labels to: write it with bev-make-synthetic --out {out}"
        )
    if not (out / MANIFEST).is_file():
        raise NotTheSameSet(
            f"--out {out} holds no set written by bev-make-synthetic (no {MANIFEST}), and --occupancy-only adds labels "
            "only to its own sets: write one, with its labels, with bev-make-synthetic --out <an empty directory>"
        )
    manifest = _read_manifest(out)
    recorded = manifest["parameters"]
    if recorded is not None:
        recorded = {"image_size": "full", **recorded}  # a writer from before image_size wrote full-size JPEGs
    if image_size is None:
        image_size = _check_image_size(recorded["image_size"] if recorded is not None else "full")
    params = _parameters(len(names), samples_per_scene, seed, render_scale, True, image_size)
    if recorded is not None:
        differ = [k for k in params if k != "occupancy" and recorded.get(k) != params[k]]
        if differ:
            had = " ".join(f"--{k.replace('_', '-')} {recorded.get(k)}" for k in differ)
            asked = " ".join(f"--{k.replace('_', '-')} {params[k]}" for k in differ)
            raise NotTheSameSet(
                f"--out {out} was written with {had} (its {MANIFEST}), not {asked}: pass the same parameters to "
                f"add its occupancy labels, or {again}"
            )
    T, scene_tasks = _plan(out, names, workers, params)
    tasks = [task for scene in scene_tasks for task in scene]
    _add_maps(T, out, seed, names)
    labels = _label_files(tasks)
    others = set(_dataset_files(tasks, T["map"], names, occupancy=False))
    listed = set(manifest["files"])
    if listed - set(labels) != others:
        raise NotTheSameSet(
            f"--out {out} does not hold the files bev-make-synthetic writes with --scenes {len(names)} "
            f"--samples-per-scene {samples_per_scene} --seed {seed} (its {MANIFEST} lists others): pass the "
            f"parameters it was written with, or {again}"
        )
    if set(labels) <= listed and (out / "gts").is_dir() and all((out / f).is_file() for f in labels):
        return 0  # a full write, or added before
    _check_written_alike(out, T, scene_tasks, params, again)
    # Recorded before any label is written (so --overwrite removes them even after an interruption).
    gts_dirs = sorted({str(q) for f in labels for q in Path(f).parents if str(q) != "."})
    created = [d for d in gts_dirs if not (out / d).exists()]
    _write_manifest(out, sorted(listed | set(labels)), sorted(set(manifest["dirs"]) | set(created)), params)
    shutil.rmtree(out / STAGING, ignore_errors=True)
    in_place = (out / "gts").exists()  # an older set's partial gts/: rewritten where it is
    root = out if in_place else out / STAGING
    _render([t._replace(out=root) for t in tasks], [], workers, render_scale, samples_per_scene, progress, "occupancy")
    if not in_place:
        (out / STAGING / "gts").rename(out / "gts")
        (out / STAGING).rmdir()
    return len(labels)


def _check_written_alike(out: Path, T: dict, scene_tasks: list[list[_RenderTask]], params: dict, again: str) -> None:
    """add_occupancy's checks of the set against what these parameters write: the tables that do not depend on
    the renders, and the images and cloud of the first sample of the first and last scenes."""
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in params.items() if k != "occupancy")
    for name in TABLES:
        if name in ("sample_annotation", "instance"):  # these need every render
            continue
        path = out / VERSION / f"{name}.json"
        if not path.is_file() or path.read_text() != _table_json(T[name]):
            raise NotTheSameSet(
                f"{path} is not what this bev-make-synthetic writes with {flags}: the set was written with other "
                f"parameters or by another version; {again}"
            )
    for task in [scene_tasks[0][0]] + ([scene_tasks[-1][0]] if len(scene_tasks) > 1 else []):
        files, _, _ = _sample_files(task._replace(occupancy=False))
        for rel, data in files.items():
            path = out / rel
            if not path.is_file() or path.read_bytes() != data:
                raise NotTheSameSet(
                    f"{path} is not what this bev-make-synthetic renders with {flags} (another --render-scale, or "
                    f"another version of the writer); {again}"
                )


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
        files = _add_sample_data(T, world, seed, si, k, samples, tok, ts, logfile, shrink)
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
    T: dict, world: World, seed: int, si: int, k: int, samples: int, sample_tok: str, ts: int, logfile: str, shrink: int
) -> dict[str, str]:
    """Append sample k's ego_pose and sample_data rows, one per channel; return channel -> file (relative to out)."""
    ego_t, ego_yaw = world.ego_pose(k * SAMPLE_DT)
    files = {}
    for ch in CHANNELS:
        # As in nuScenes, an ego_pose shares its token with its sample_data.
        sd_tok = _token(seed, "sample_data", si, k, ch)
        cam = ch != "LIDAR_TOP"
        files[ch] = f"samples/{ch}/{logfile}__{ch}__{ts}.{'jpg' if cam else 'pcd.bin'}"
        T["ego_pose"].append(
            {"token": sd_tok, "timestamp": ts, "rotation": yaw_to_quaternion(ego_yaw), "translation": ego_t.tolist()}
        )
        T["sample_data"].append(
            {
                "token": sd_tok,
                "sample_token": sample_tok,
                "ego_pose_token": sd_tok,
                "calibrated_sensor_token": _token(seed, "calibrated_sensor", si, ch),
                "timestamp": ts,
                "fileformat": "jpg" if cam else "pcd",
                "is_key_frame": True,
                "height": IMAGE_H // shrink if cam else 0,
                "width": IMAGE_W // shrink if cam else 0,
                "filename": files[ch],
                "prev": _token(seed, "sample_data", si, k - 1, ch) if k else "",
                "next": _token(seed, "sample_data", si, k + 1, ch) if k + 1 < samples else "",
            }
        )
    return files


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


def _dataset_files(tasks: list[_RenderTask], maps: list[dict], names: list[str], occupancy: bool = True) -> list[str]:
    """Every file of the dataset, relative to out (what the manifest records); the occupancy labels if `occupancy`."""
    files = [f for task in tasks for f in (*task.cam_files.values(), task.lidar_file)] + [m["filename"] for m in maps]
    if occupancy:
        files += _label_files(tasks)
    return (
        files + [f"maps/expansion/{loc}.json" for loc in _map_groups(names)] + [f"{VERSION}/{n}.json" for n in TABLES]
    )


def _label_files(tasks: list[_RenderTask]) -> list[str]:
    """The occupancy labels of the tasks' samples, relative to out."""
    return [labels_path("", t.scene_name, _token(t.seed, "sample", t.scene, t.sample)).as_posix() for t in tasks]


def _table_json(rows: list[dict]) -> str:
    """A table's text, as the devkit's files have it (one item per line)."""
    return json.dumps(rows, indent=0)


def _render(
    tasks: list[_RenderTask],
    map_tasks: list[tuple],
    workers: int,
    render_scale: int,
    samples_per_scene: int,
    progress: bool,
    kind: str = "render",
) -> dict:
    """Write every sample's images and lidar cloud (and its occupancy labels when its task says so) and the map
    PNGs; return (scene, sample) -> (visibility, lidar counts). kind="occupancy": the labels alone (_occupancy_task),
    (scene, sample) -> ()."""
    for ch in CAMERA_NAMES:  # per-camera rays, computed once and inherited by forked workers
        raycast.make_camera(ch, render_scale)
    if any(t.occupancy for t in tasks):
        prepare_occupancy(render_scale)  # the occupancy masks' voxel -> pixel tables, likewise
    results = {}
    # Runs of consecutive frames per job: a worker reuses the ground tiles it built (longer runs rebuild fewer,
    # shorter ones balance the workers' last jobs better and show progress more often).
    with tqdm(total=len(tasks), desc="bev-make-synthetic", unit="sample", disable=not progress) as bar:
        for r in _run_tasks(tasks, map_tasks, workers, chunksize=max(1, min(samples_per_scene // 4, CHUNK)), kind=kind):
            results[r[0], r[1]] = r[2:]
            bar.update()
    return results


CHUNK = 16  # samples per render job at most


def _run_tasks(tasks: list[_RenderTask], map_tasks: list[tuple], workers: int, chunksize: int, kind: str = "render"):
    """Run the map and the `kind` ("render" or "occupancy") tasks (in `workers` processes when there are several);
    yield the sample tasks' results."""
    if workers > 1 and len(tasks) > 1:
        # The maps are written alongside the renders; runs of `chunksize` samples per job.
        jobs = [("map", [t]) for t in map_tasks]
        jobs += [(kind, tasks[i : i + chunksize]) for i in range(0, len(tasks), chunksize)]
        for done, results in _in_workers(_run_job, jobs, workers, _worker_init):
            if done != "map":
                yield from results
    else:
        for task in map_tasks:
            _map_task(task)
        yield from map(_sample_job(kind), tasks)


def _run_job(job: tuple[str, list]) -> tuple[str, list]:
    """A worker's job: ("map", [map task]) or ("render", [render tasks]); a sample that fails is named in the
    error (a WorkerError, or its OSError as it is: bev-make-synthetic reports those as a dataset it cannot write)."""
    kind, items = job
    if kind == "map":
        return kind, [_map_task(t) for t in items]
    results = []
    for task in items:
        try:
            results.append(_sample_job(kind)(task))
        except OSError:
            raise
        except Exception as e:
            raise WorkerError(
                f"writing sample {task.sample} of scene {task.scene_name} failed: {type(e).__name__}: {e} "
                "(--workers 1 shows where)"
            ) from e
    return kind, results


def _sample_job(kind: str):
    """The function of a sample job of this kind, looked up when called (a profiler may have wrapped it)."""
    return globals()[{"render": "_render_task", "occupancy": "_occupancy_task"}[kind]]


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


def _map_groups(names: list[str]) -> dict[str, list[int]]:
    """Location -> indices of its scenes (one map per location, as in nuScenes)."""
    by_loc: dict[str, list[int]] = {}
    for si, name in enumerate(names):
        by_loc.setdefault(MINI_LOCATIONS[name], []).append(si)
    return dict(sorted(by_loc.items()))


def _map_task(task) -> None:
    """Write one location's drivable-area PNG (MAP_RES m/pixel over the map canvas, global frame), or for
    ("expansion", out, seed, location) its HD map (maps/expansion/<location>.json)."""
    if task[0] == "expansion":
        _, out, seed, loc = task
        _write_atomic(out / "maps" / "expansion" / f"{loc}.json", json.dumps(map_expansion(road_map(seed, loc), seed)))
        return
    path, seed, location = task
    road = road_map(seed, location)
    w, h = (int(math.ceil(c / MAP_RES)) for c in road.canvas)
    # Map pixel (col, row) = (x / res, height - y / res), as nuscenes.utils.map_mask expects.
    mask = fill(
        np.zeros((h, w), np.uint8),
        road.layers["drivable_area"][0]["geom"],
        lambda xy: np.stack([xy[:, 0] / MAP_RES, h - xy[:, 1] / MAP_RES], -1),
        255,
    )
    ok, png = cv2.imencode(".png", mask, [cv2.IMWRITE_PNG_COMPRESSION, 1])
    if not ok:
        raise RuntimeError(f"PNG encoding failed for map {path}")
    _write_atomic(Path(path), png.tobytes())  # a failed write raises its OSError (File too large, ...)


MAX_WORKERS = 8  # each render process keeps its own ground tiles (up to ~150 MB)


def default_workers() -> int:
    """The CPUs this process may run on, at most MAX_WORKERS (the command line's default --workers)."""
    from bev.utils.threads import available_cpus

    return max(1, min(available_cpus(), MAX_WORKERS))


def main(argv: list[str] | None = None) -> int:
    """bev-make-synthetic: the command line of make_synthetic (exit status 1 when --out cannot be written)."""
    p = argparse.ArgumentParser(prog="bev-make-synthetic", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="dataroot to create (load it with NuScenes('v1.0-mini', dataroot=OUT))")
    p.add_argument("--scenes", type=int, default=DEFAULT_SCENES, help="1..10 (default %(default)s = the mini split)")
    p.add_argument(
        "--samples-per-scene",
        type=int,
        default=DEFAULT_SAMPLES,
        help="key frames per scene, 2 Hz (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help="processes that build the worlds and render, the same files for any number "
        "(default: the CPUs available here, at most 8: %(default)s)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already in --out")
    p.add_argument(
        "--occupancy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write the Occ3D occupancy labels, gts/<scene>/<sample token>/labels.npz (default; about a quarter of "
        "the work: --no-occupancy leaves them out, --occupancy-only adds them later)",
    )
    p.add_argument(
        "--occupancy-only",
        action="store_true",
        help="add the occupancy labels to a set written in --out with --no-occupancy and the same --scenes, "
        "--samples-per-scene, --seed, --render-scale and --image-size, rewriting nothing else (the same bytes as a "
        "full write)",
    )
    p.add_argument(
        "--render-scale",
        type=int,
        default=raycast.RENDER_SCALE,
        choices=RENDER_SCALES,
        help="ray-cast at 1600x900 / this, then upscale (default %(default)s; 4 writes 3-4x faster, "
        "enough for inputs up to ~400x225)",
    )
    p.add_argument(
        "--image-size",
        choices=IMAGE_SIZES,
        help="the JPEGs' size: full (default) 1600x900 as nuScenes' cameras, the renders upscaled; render: the "
        "render resolution itself with its intrinsics, the same scene in a 1/scale^2 of the JPEG work and disk "
        "(with --occupancy-only, default: the size the set was written in)",
    )
    args = p.parse_args(argv)
    start = time.time()
    if args.occupancy_only and (args.overwrite or not args.occupancy):
        p.error("--occupancy-only adds the labels to the set in --out: it takes neither --overwrite nor --no-occupancy")
    try:
        _validate(args.scenes, args.samples_per_scene, args.seed, args.workers)
        if not args.occupancy_only:
            _check_out(Path(args.out), args.overwrite)
    except (ValueError, TypeError, FileExistsError) as e:
        p.error(str(e))
    if args.occupancy_only:
        return _main_occupancy_only(p, args, start)
    try:
        out = make_synthetic(
            args.out,
            args.scenes,
            args.samples_per_scene,
            args.seed,
            overwrite=args.overwrite,
            workers=args.workers,
            render_scale=args.render_scale,
            occupancy=args.occupancy,
            image_size=args.image_size or "full",
        )
    except OSError as e:  # e.g. a read-only or full --out: one line, no traceback
        return _error(f"cannot write the dataset to {args.out}: {_os_error(e)}")
    except WorkerError as e:  # one line, not a worker's traceback
        return _error(str(e))
    except KeyboardInterrupt:
        return _error(_interrupted(Path(args.out)), INTERRUPTED)
    print(
        f"wrote {args.scenes} scenes x {args.samples_per_scene} samples to {out}"
        f"{'' if args.occupancy else ' without occupancy labels'} in {time.time() - start:.1f} s",
        file=sys.stderr,
    )
    return 0


def _main_occupancy_only(p: argparse.ArgumentParser, args, start: float) -> int:
    """bev-make-synthetic --occupancy-only: add_occupancy from the command line."""
    try:
        n = add_occupancy(
            args.out,
            args.scenes,
            args.samples_per_scene,
            args.seed,
            args.workers,
            render_scale=args.render_scale,
            image_size=args.image_size,
        )
    except NotTheSameSet as e:  # the set in --out is not one these parameters write: nothing written
        return _error(str(e), 2)
    except (ValueError, TypeError) as e:
        p.error(str(e))
    except OSError as e:
        return _error(f"cannot write the occupancy labels to {args.out}: {_os_error(e)}")
    except WorkerError as e:
        return _error(str(e))
    except KeyboardInterrupt:
        return _error(
            f"interrupted: the occupancy labels of {args.out} are not all written (the rest of the set is as it "
            "was); run the same command again to add them",
            INTERRUPTED,
        )
    if n:
        print(
            f"added the occupancy labels of {n} samples to {args.out} in {time.time() - start:.1f} s", file=sys.stderr
        )
    else:
        print(f"{args.out} has its occupancy labels already: nothing written", file=sys.stderr)
    return 0


INTERRUPTED = 130  # the shell's status for a command ended by Ctrl-C (128 + SIGINT)


def _error(message: str, status: int = 1) -> int:
    """Print bev-make-synthetic's one-line error; return the exit status."""
    print(f"bev-make-synthetic: error: {message}", file=sys.stderr)
    return status


def _os_error(e: OSError) -> str:
    """An OSError in words, with the fix where the cause is a limit of this process."""
    if e.errno == errno.EFBIG:
        return f"{e} (a file-size limit, ulimit -f, stops the writes: raise it or lift it)"
    return str(e)


def _interrupted(out: Path) -> str:
    """What a Ctrl-C of make_synthetic left in `out`."""
    if (out / MANIFEST).is_file() and not (out / COMPLETE_MARK).is_file():
        return (
            f"interrupted: the set in {out} is incomplete (no {COMPLETE_MARK}: loaders do not take it for a dataset); "
            "run the command again with --overwrite to write it anew"
        )
    if (out / COMPLETE_MARK).is_file():
        return f"interrupted before the set in {out} was touched: it is as it was"
    return f"interrupted before anything was written to {out}"


if __name__ == "__main__":
    sys.exit(main())
