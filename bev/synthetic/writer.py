"""Synthetic dataset in the exact nuScenes v1.0-mini format (the embedded default).

`make_synthetic(out, scenes, samples_per_scene, seed)` / `bev-make-synthetic --out DIR` write

    DIR/v1.0-mini/{attribute,calibrated_sensor,category,ego_pose,instance,log,map,sample,
                   sample_annotation,sample_data,scene,sensor,visibility}.json
    DIR/samples/CAM_*/<logfile>__<CAM>__<timestamp>.jpg      1600x900 renders (bev.synthetic.raycast), or
                                                               at the render resolution (image_size="render")
    DIR/samples/LIDAR_TOP/<logfile>__LIDAR_TOP__<timestamp>.pcd.bin  ray-cast 32-beam LiDAR (bev.synthetic.lidar)
    DIR/sweeps/LIDAR_TOP/<logfile>__LIDAR_TOP__<timestamp>.pcd.bin   its sweeps between key frames (lidar_sweeps)
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
at 2 Hz; every sensor of a sample shares the sample's timestamp and ego pose, so the
ego frame of the LIDAR_TOP sample_data is exactly the frame the cameras were rendered in. With lidar_sweeps = n,
n LIDAR_TOP sweeps at 20 Hz precede each key frame but the first (non-key sample_data, is_key_frame false, each
with its own timestamp and ego pose, chained by prev / next through the key frames), as the devkit's
LidarPointCloud.from_file_multisweep reads them.

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
import errno
import sys
import time
from pathlib import Path

from bev.synthetic import raycast
from bev.synthetic.manifest import (
    COMPLETE_MARK,
    DEFAULT_SAMPLES,
    DEFAULT_SCENES,
    MANIFEST,
    MAX_SAMPLES_PER_SCENE,
    STAGING,
    NotTheSameSet,
    _begin,
    _check_lidar_sweeps,
    _check_out,
    _dataset_files,
    _parameters,
    _validate,
    add_occupancy,
)
from bev.synthetic.pool import WorkerError, default_workers
from bev.synthetic.samples import _render, _write_atomic
from bev.synthetic.sensors import IMAGE_SIZES, RENDER_SCALES, _check_image_size, _check_render_scale
from bev.synthetic.tables import (
    TABLES,
    VERSION,
    _add_annotations,
    _add_maps,
    _map_groups,
    _plan,
    _table_json,
    scene_names,
)

# The parts: tables (the nuScenes records), pool (worker processes, worlds), sensors (cameras, LIDAR_TOP),
# samples (each sample's files, the maps), manifest (what a set records; add_occupancy). This module writes a set
# with them (make_synthetic) and is bev-make-synthetic's command line.
__all__ = [
    "COMPLETE_MARK",
    "DEFAULT_SAMPLES",
    "DEFAULT_SCENES",
    "IMAGE_SIZES",
    "MANIFEST",
    "MAX_SAMPLES_PER_SCENE",
    "RENDER_SCALES",
    "STAGING",
    "TABLES",
    "VERSION",
    "NotTheSameSet",
    "WorkerError",
    "add_occupancy",
    "default_workers",
    "main",
    "make_synthetic",
    "scene_names",
]


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
    lidar_sweeps: int = 0,
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
    `lidar_sweeps` (0..9): LIDAR_TOP sweeps at 20 Hz before each key frame but the first, sweeps/LIDAR_TOP (each
    as large as a key frame's cloud and about half its LiDAR time; nuScenes has 9).
    """
    names = _validate(scenes, samples_per_scene, seed, workers)
    render_scale, image_size = _check_render_scale(render_scale), _check_image_size(image_size)
    lidar_sweeps = _check_lidar_sweeps(lidar_sweeps)
    samples_per_scene, seed, workers = int(samples_per_scene), int(seed), int(workers)  # numpy ints -> JSON-safe
    out = Path(out)
    _check_out(out, overwrite)
    params = _parameters(len(names), samples_per_scene, seed, render_scale, bool(occupancy), image_size, lidar_sweeps)
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
    p.add_argument(
        "--lidar-sweeps",
        type=int,
        help="LIDAR_TOP sweeps (20 Hz) between key frames, sweeps/LIDAR_TOP, 0..9 (default 0: none; nuScenes has 9; "
        "each costs about a key frame's cloud, ~0.6 MB; with --occupancy-only, default: the set's)",
    )
    args = p.parse_args(argv)
    start = time.time()
    if args.occupancy_only and (args.overwrite or not args.occupancy):
        p.error("--occupancy-only adds the labels to the set in --out: it takes neither --overwrite nor --no-occupancy")
    try:
        _validate(args.scenes, args.samples_per_scene, args.seed, args.workers)
        if args.lidar_sweeps is not None:
            _check_lidar_sweeps(args.lidar_sweeps)
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
            lidar_sweeps=args.lidar_sweeps or 0,
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
            lidar_sweeps=args.lidar_sweeps,
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
