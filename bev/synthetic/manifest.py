"""What a synthetic set records, and how one written without its occupancy labels is completed: the parameters
that decide its bytes (checked), the manifest of the files this writer wrote in --out (all --overwrite ever
deletes), and add_occupancy, which stages the labels and moves them into place whole."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from bev.synthetic import raycast
from bev.synthetic.lidar import MAX_SWEEPS
from bev.synthetic.occupancy import labels_path
from bev.synthetic.samples import _render, _sample_files, _write_atomic
from bev.synthetic.sensors import _check_image_size, _check_render_scale
from bev.synthetic.tables import (
    TABLES,
    VERSION,
    _add_maps,
    _map_groups,
    _plan,
    _RenderTask,
    _table_json,
    _token,
    scene_names,
)

DEFAULT_SCENES = 10
DEFAULT_SAMPLES = 24
# 10 scenes x 5000 key frames are more than nuScenes trainval's 34,149, and a world's building time grows faster
# than its drive (one scene on one core: 2000 samples 10 s, 5000 37 s, 10000 102 s).
MAX_SAMPLES_PER_SCENE = 5000
MANIFEST = ".bev_synthetic_manifest.json"  # what this writer wrote in --out: all it ever deletes
# Written last and removed first: a set that has it is whole (`make train` tests it before writing a set).
COMPLETE_MARK = f"{VERSION}/scene.json"
STAGING = ".bev_synthetic_gts.partial"  # add_occupancy writes gts/ here, then moves it into place whole


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


def _parameters(
    scenes: int,
    samples_per_scene: int,
    seed: int,
    render_scale: int,
    occupancy: bool,
    image_size: str,
    lidar_sweeps: int = 0,
) -> dict:
    """What decides a dataset's bytes, as the manifest records it (workers do not)."""
    return {
        "scenes": scenes,
        "samples_per_scene": samples_per_scene,
        "seed": seed,
        "render_scale": render_scale,
        "occupancy": occupancy,
        "image_size": image_size,
        "lidar_sweeps": lidar_sweeps,
    }


def _check_lidar_sweeps(sweeps) -> int:
    """`sweeps` as an int if it is a whole number 0..MAX_SWEEPS, else one clear error."""
    if isinstance(sweeps, bool) or not isinstance(sweeps, (int, np.integer)) or not 0 <= sweeps <= MAX_SWEEPS:
        raise ValueError(
            f"lidar_sweeps must be a whole number 0..{MAX_SWEEPS} (LIDAR_TOP sweeps between key frames 0.5 s apart "
            f"at 20 Hz; 0 writes none), got {sweeps!r}"
        )
    return int(sweeps)


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


def _dataset_files(tasks: list[_RenderTask], maps: list[dict], names: list[str], occupancy: bool = True) -> list[str]:
    """Every file of the dataset, relative to out (what the manifest records); the occupancy labels if `occupancy`."""
    files = [f for task in tasks for f in (*task.cam_files.values(), task.lidar_file, *(n for _, n in task.sweeps))]
    files += [m["filename"] for m in maps]
    if occupancy:
        files += _label_files(tasks)
    return (
        files + [f"maps/expansion/{loc}.json" for loc in _map_groups(names)] + [f"{VERSION}/{n}.json" for n in TABLES]
    )


def _label_files(tasks: list[_RenderTask]) -> list[str]:
    """The occupancy labels of the tasks' samples, relative to out."""
    return [labels_path("", t.scene_name, _token(t.seed, "sample", t.scene, t.sample)).as_posix() for t in tasks]


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
    lidar_sweeps: int | None = None,
) -> int:
    """Add the Occ3D labels (gts/) to a set make_synthetic(occupancy=False) wrote in `out` with the same
    parameters; return how many label files were written (0: the set has them all already).

    Nothing else is rewritten: the result, manifest included, is byte for byte what make_synthetic with the
    labels writes. The set is checked first, and refused (NotTheSameSet, nothing written) unless its manifest
    records these parameters (or, from a writer that did not record them, lists the files they give), its tables
    that do not depend on the renders (scenes, samples, sample_data, ego poses, sensors, maps) are the bytes these
    parameters give, and the first sample of its first and last scenes renders to its images and LiDAR cloud
    (which catches another render scale or another version of the renderer). `image_size` None: the one the
    manifest records ("full" if it records none); `lidar_sweeps` None likewise (0 if it records none). The labels are written to
    out/STAGING and moved to gts/ when all are there, so a gts/ folder is always complete.
    """
    names = _validate(scenes, samples_per_scene, seed, workers)
    render_scale = _check_render_scale(render_scale)
    if image_size is not None:
        _check_image_size(image_size)
    if lidar_sweeps is not None:
        _check_lidar_sweeps(lidar_sweeps)
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
        # Writers from before these parameters wrote full-size JPEGs and no sweeps.
        recorded = {"image_size": "full", "lidar_sweeps": 0, **recorded}
    if image_size is None:
        image_size = _check_image_size(recorded["image_size"] if recorded is not None else "full")
    if lidar_sweeps is None:
        lidar_sweeps = _check_lidar_sweeps(recorded["lidar_sweeps"] if recorded is not None else 0)
    params = _parameters(len(names), samples_per_scene, seed, render_scale, True, image_size, lidar_sweeps)
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
