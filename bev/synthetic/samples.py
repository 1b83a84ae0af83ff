"""Each sample's files (its six camera JPEGs, its LIDAR_TOP cloud, its occupancy labels) and each location's map
files, each written whole, in the worker processes (bev.synthetic.pool) with a progress bar."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
from tqdm import tqdm

from bev.geometry import CAMERA_NAMES
from bev.synthetic import raycast
from bev.synthetic.lidar import key_frame as lidar_key_frame
from bev.synthetic.lidar import sweep as lidar_sweep
from bev.synthetic.mapjson import map_expansion
from bev.synthetic.occupancy import prepare as prepare_occupancy
from bev.synthetic.occupancy import write_sample_occupancy
from bev.synthetic.pool import WorkerError, _in_workers, _worker_init, _world
from bev.synthetic.raycast import visibility_level
from bev.synthetic.roads import fill, road_map
from bev.synthetic.sensors import camera_jpeg
from bev.synthetic.tables import _RenderTask, _token
from bev.synthetic.world import SAMPLE_DT
from bev.utils.io import atomic_write

MAP_RES = 0.1  # metres per pixel of the maps/<token>.png drivable-area masks (as in nuScenes)


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


def _render_task(task: _RenderTask):
    """Render and write one sample's files (its sweeps too); return per-object visibility and lidar counts."""
    files, vis, per_obj = _sample_files(task)
    for rel, data in files.items():
        with _naming(task.out / rel):
            (task.out / rel).write_bytes(data)
    return task.scene, task.sample, vis, per_obj


def _sample_files(task: _RenderTask) -> tuple[dict[str, bytes], dict, dict]:
    """Render one sample: ({file relative to out: its bytes} of the images, the lidar cloud and the sweeps after
    it, per-object visibility, per-object lidar counts); its occupancy labels are written here when task.occupancy."""
    (
        out,
        seed,
        scene,
        sample,
        samples,
        location,
        cam_files,
        lidar_file,
        annotated,
        scale,
        scene_name,
        occ,
        up,
        sweeps,
    ) = task
    world = _world(seed, scene, samples, location)
    t = sample * SAMPLE_DT
    parts = raycast.sample_parts(world, t)  # placed once for the cameras, the lidar and the occupancy labels
    images, counts = raycast.render_sample(world, t, scale, parts)
    lidar = lidar_key_frame(world, t, annotated, np.random.default_rng([seed, scene, sample, 7]), parts)
    if occ:
        token = _token(seed, "sample", scene, sample)
        write_sample_occupancy(out, scene_name, token, world, t, images, scale, parts, lidar.scan)
    files = {}
    for name in CAMERA_NAMES:
        files[cam_files[name]] = camera_jpeg(images[name].image, scale, up, cam_files[name])
    files[lidar_file] = lidar.cloud.tobytes()
    for j, (when, name) in enumerate(sweeps):
        files[name] = lidar_sweep(world, when, np.random.default_rng([seed, scene, sample, 8, j])).tobytes()
    vis = {i: visibility_level(*counts.get(i, (0, 0))) for i in annotated}
    return files, vis, lidar.num_points


def _occupancy_task(task: _RenderTask):
    """Write one sample's occupancy labels alone (under task.out): the six cameras' depths are all they need of
    the renders (raycast.render_depth, the same values as render_sample's)."""
    world = _world(task.seed, task.scene, task.samples, task.location)
    t = task.sample * SAMPLE_DT
    token = _token(task.seed, "sample", task.scene, task.sample)
    write_sample_occupancy(task.out, task.scene_name, token, world, t, None, task.scale, raycast.sample_parts(world, t))
    return task.scene, task.sample


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
