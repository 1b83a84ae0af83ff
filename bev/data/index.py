"""The split index: every key frame of one split walked once through the devkit into flat arrays.

Image paths, camera->ego calibrations, ego poses, target boxes and detection boxes, all already in the
ego frame; cached (bev.data.cache), so DataLoader workers never touch the devkit tables and, with a valid
cache, the devkit is not even constructed.

Ego frame = the ego pose of the sample's LIDAR_TOP sample_data (as in lift-splat-shoot). Each camera
image is taken at its own timestamp and ego pose, so camera->ego composes camera -> ego(at camera time)
-> global -> ego(at LIDAR_TOP time); lift-splat-shoot drops the middle hop and is off by the ego motion
between the two timestamps (up to ~0.5 m). With map layers the index also holds the map geometry of the
split's locations (bev.data.maps).
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bev.classes import DETECTION_CLASSES, normalize_categories, normalize_map_layers
from bev.data.cache import cache_file, cache_key, cache_root, read_cache, save_npz
from bev.data.maps import load_map_geometry
from bev.data.rasterize import box_footprints
from bev.data.tables import (
    HOWTO,
    box_problem,
    check_dataroot,
    image_hw,
    intrinsics,
    open_tables,
    pose,
    relative_filename,
)
from bev.geometry import CAMERA_NAMES, quaternion_to_matrix

_FIX_LINKS = "Fix the prev/next links of sample.json (or scene.json), or re-download or regenerate the set."


def split_scenes() -> dict[str, list[str]]:
    """Scene names per split: the devkit's own lists (mini_train, mini_val, train, val, test, ...)."""
    from nuscenes.utils.splits import create_splits_scenes

    return create_splits_scenes(verbose=False)


def _label(name: str, groups: tuple[tuple[str, ...], ...]) -> int:
    for k, prefixes in enumerate(groups):
        if any(name.startswith(p) for p in prefixes):
            return k
    return -1


def load_index(
    dataroot: str | os.PathLike,
    version: str,
    split: str,
    categories: Any = ("vehicle.",),
    cache_dir: str | os.PathLike | None = None,
    verbose: bool = True,
    map_layers: Any = None,
) -> dict:
    """The split index: from the cache when its key matches, else built from the devkit and cached."""
    return load_indexes(dataroot, version, [split], categories, cache_dir, verbose, map_layers)[split]


def load_indexes(
    dataroot: str | os.PathLike,
    version: str,
    splits: Sequence[str],
    categories: Any = ("vehicle.",),
    cache_dir: str | os.PathLike | None = None,
    verbose: bool = True,
    map_layers: Any = None,
) -> dict[str, dict]:
    """load_index of several splits; the devkit's tables are read (and checked) once for all those not cached."""
    table_root = check_dataroot(dataroot, version)
    known = split_scenes()
    unknown = [s for s in splits if s not in known]
    if unknown:
        raise ValueError(f"unknown nuScenes split {unknown[0]!r}; choose one of {sorted(known)} (mini_* for v1.0-mini)")
    groups = normalize_categories(categories)
    layers = normalize_map_layers(map_layers)
    out: dict[str, dict] = {}
    nusc = None
    for split in dict.fromkeys(splits):
        key = cache_key(dataroot, table_root, version, split, groups, layers, cache_root(dataroot, cache_dir))
        path = cache_file(dataroot, cache_dir, key)
        cached = read_cache(path, key)
        if cached is None:
            nusc = nusc or open_tables(Path(dataroot), version, "/".join(splits), verbose)
            cached = _build_and_cache(dataroot, version, split, groups, layers, nusc, key, path, known[split], verbose)
        out[split] = cached
    return out


def _build_and_cache(
    dataroot, version: str, split: str, groups, layers, nusc, key: dict, path: Path, scenes: list[str], verbose: bool
) -> dict:
    index = build_index(dataroot, version, split, groups, verbose=verbose, map_layers=layers, nusc=nusc)
    _check_built(index, dataroot, Path(dataroot) / version, version, split, scenes)
    try:
        save_npz(index, key, path)
    except OSError as e:  # read-only dataset mounts still work, just without a cache
        warnings.warn(f"could not write the index cache {path} ({e}); pass cache_dir=<writable dir>", stacklevel=2)
    return index


def _check_built(
    index: dict, dataroot: str | os.PathLike, table_root: Path, version: str, split: str, scenes: list[str]
) -> None:
    """Refuse a fresh index with no samples or with camera images missing on disk (before it is cached)."""
    if len(index["sample_token"]) == 0:
        raise ValueError(
            f"split {split!r} is empty in {str(table_root)!r}: none of its {len(scenes)} scenes "
            f"(e.g. {scenes[:3]}) are in this {version} release. Use mini_train/mini_val with v1.0-mini "
            f"and train/val with v1.0-trainval. {HOWTO}"
        )
    missing = [p.decode() for p in index["image_path"].ravel() if not (Path(dataroot) / p.decode()).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} camera image(s) of split {split!r} are missing, e.g. {str(Path(dataroot) / missing[0])!r}. "
            f"{HOWTO}"
        )


def build_index(
    dataroot: str | os.PathLike,
    version: str,
    split: str,
    groups,
    verbose: bool = True,
    map_layers: tuple[str, ...] = (),
    nusc=None,
) -> dict:
    """Walk the devkit tables once and return the flat index of one split (see module doc); `nusc`: the
    tables already opened (bev.data.tables.open_tables), for several splits at once."""
    root = Path(dataroot)
    scenes_of_split = set(split_scenes()[split])
    nusc = nusc or open_tables(root, version, split, verbose)
    scenes = sorted((s for s in nusc.scene if s["name"] in scenes_of_split), key=lambda s: s["name"])
    cols = _walk_scenes(nusc, scenes, groups, f"indexing {version}/{split}", verbose)
    _warn_skipped_boxes(cols.pop("skipped_boxes", []), split)
    n = len(cols["sample_token"])
    locations = sorted(set(cols["location"]))
    maps = load_map_geometry(root, locations, map_layers, verbose) if map_layers and n else {}
    return {**maps, **_sample_arrays(cols, n), **_box_arrays(cols)}


def _warn_skipped_boxes(skipped: list[str], split: str) -> None:
    if skipped:
        shown = "; ".join(skipped[:5]) + (f"; and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        warnings.warn(
            f"split {split!r}: skipped {len(skipped)} sample_annotation box(es) that cannot be drawn: {shown}. "
            "Their objects are missing from the targets; fix those records of sample_annotation.json.",
            stacklevel=2,
        )


def _visibility_levels(nusc) -> dict[str, int]:
    """visibility token -> level: the token itself when it is a number (nuScenes' "1".."4"), else its rank."""
    levels = {}
    for i, v in enumerate(sorted(nusc.visibility, key=lambda r: r["token"])):
        levels[v["token"]] = int(v["token"]) if str(v["token"]).isdigit() else i + 1
    return levels


def _walk_scenes(nusc, scenes: list[dict], groups, desc: str, verbose: bool) -> dict[str, list]:
    """The index columns as lists, named as the index's arrays: every key frame of `scenes`, in order."""
    from tqdm import tqdm

    vis_level = _visibility_levels(nusc)
    cols: dict[str, list] = defaultdict(list)
    cols["box_offsets"].append(0)  # sample i's boxes are rows box_offsets[i]:box_offsets[i + 1]
    bar = tqdm(total=sum(s["nbr_samples"] for s in scenes), desc=desc, unit="sample", disable=not verbose)
    for scene in scenes:
        for token, sample in _scene_samples(nusc, scene):
            _add_sample(nusc, scene, token, sample, groups, vis_level, cols)
            bar.update(1)
    bar.close()
    return cols


def _scene_samples(nusc, scene: dict) -> Iterator[tuple[str, dict]]:
    """(token, record) of the scene's key frames in time order, following `next` from its first sample. A walk
    that comes back to a sample (a cycle), leaves the scene, outgrows its nbr_samples, goes back in time (the
    index order is time order: temporal windows, bev-predict's scenes) or ends before the scene's
    last_sample_token is an error, not a hang or a silently shorter scene."""
    seen: set[str] = set()
    token, last, time = scene["first_sample_token"], None, -1
    while token:
        where = f"scene {scene['name']} ({scene['token']}): its sample chain reaches sample {token!r}"
        if token in seen:
            raise ValueError(f"{where} a second time: sample.json's next links form a cycle. {_FIX_LINKS}")
        sample = nusc.get("sample", token)
        if sample["scene_token"] != scene["token"]:
            raise ValueError(f"{where}, which belongs to scene {sample['scene_token']!r}. {_FIX_LINKS}")
        seen.add(token)
        if len(seen) > scene["nbr_samples"]:
            raise ValueError(
                f"{where}, its sample number {len(seen)}, but the scene has nbr_samples={scene['nbr_samples']}. "
                f"{_FIX_LINKS}"
            )
        if sample["timestamp"] <= time:
            raise ValueError(
                f"{where}, whose timestamp {sample['timestamp']} is not after the previous one's ({time}): the "
                f"next links or the timestamps are wrong. {_FIX_LINKS}"
            )
        yield token, sample
        token, last, time = sample["next"], token, sample["timestamp"]
    if last != scene["last_sample_token"] or len(seen) != scene["nbr_samples"]:
        raise ValueError(
            f"scene {scene['name']} ({scene['token']}): its sample chain ends at sample {last!r} after {len(seen)} "
            f"samples, not at its last_sample_token {scene['last_sample_token']!r} after nbr_samples="
            f"{scene['nbr_samples']}: a next link is cut, or nbr_samples or last_sample_token is wrong. {_FIX_LINKS}"
        )


def _append(cols: dict[str, list], **values) -> None:
    """Append one row's values to the columns of the same names."""
    for name, value in values.items():
        cols[name].append(value)


def _add_sample(
    nusc, scene: dict, token: str, sample: dict, groups, vis_level: dict[str, int], cols: dict[str, list]
) -> None:
    """Append one key frame: its LIDAR_TOP, its cameras and its target boxes, all in its ego frame."""
    where = f"sample {token} of {scene['name']}"
    for channel in ("LIDAR_TOP", *CAMERA_NAMES):  # LIDAR_TOP defines the ego frame
        if channel not in sample["data"]:
            raise ValueError(
                f"{where} has no {channel} sample_data (a key frame, is_key_frame true, whose calibrated_sensor's "
                f"sensor has channel {channel}). Fix sample_data.json (or sensor.json), or re-download or "
                "regenerate the set."
            )
    lidar = nusc.get("sample_data", sample["data"]["LIDAR_TOP"])
    Re, te = pose(nusc, "ego_pose", lidar["ego_pose_token"])
    Rl, tl = pose(nusc, "calibrated_sensor", lidar["calibrated_sensor_token"])
    _append(cols, lidar_path=relative_filename(lidar), lidar_rotation=Rl, lidar_translation=tl)
    for cam in CAMERA_NAMES:
        _add_camera(nusc, nusc.get("sample_data", sample["data"][cam]), Re, te, cols)
    detections = 0
    for ann_token in sample["anns"]:
        ann = nusc.get("sample_annotation", ann_token)
        problem = box_problem(ann)  # checked once for both kinds of box
        if problem:  # one broken annotation should not stop a dataset: skipped, counted, named (build_index)
            if _label(ann["category_name"], groups) >= 0 or _detection_name(ann) is not None:
                cols["skipped_boxes"].append(f"{ann['token']} ({problem})")
            continue
        Rb = quaternion_to_matrix(ann["rotation"])
        _add_box(ann, Rb, groups, vis_level, Re, te, cols)
        detections += _add_detection_box(nusc, ann, Rb, Re, te, cols)
    cols["box_offsets"].append(len(cols["box_label"]))
    cols["det_count"].append(detections)
    _append(
        cols,
        sample_token=token,
        scene=scene["name"],
        location=nusc.get("log", scene["log_token"])["location"],
        timestamp=sample["timestamp"],
        ego_rotation=Re,
        ego_translation=te,
    )


def _add_camera(nusc, sd: dict, Re: np.ndarray, te: np.ndarray, cols: dict[str, list]) -> None:
    """Append one camera image: its file, size, intrinsics and camera -> ego pose (Re, te)."""
    calib = nusc.get("calibrated_sensor", sd["calibrated_sensor_token"])
    Rc, tc = pose(nusc, "calibrated_sensor", sd["calibrated_sensor_token"])
    Rce, tce = pose(nusc, "ego_pose", sd["ego_pose_token"])
    # camera -> ego(camera time) -> global -> ego(LIDAR_TOP time)
    _append(
        cols,
        rots=Re.T @ Rce @ Rc,
        trans=Re.T @ (Rce @ tc + tce - te),
        intrinsics=intrinsics(calib),
        image_path=relative_filename(sd),
        image_hw=image_hw(sd),
    )


def _add_box(
    ann: dict, Rb: np.ndarray, groups, vis_level: dict[str, int], Re: np.ndarray, te: np.ndarray, cols: dict[str, list]
) -> None:
    """Append one (checked) annotation, box -> global rotation Rb, as a target box in the ego frame (Re, te),
    unless no category group has it."""
    k = _label(ann["category_name"], groups)
    if k < 0:
        return
    tb = np.asarray(ann["translation"], dtype=np.float64)
    _append(
        cols,
        box_center=Re.T @ (tb - te),
        box_rotation=Re.T @ Rb,
        box_size=ann["size"],
        box_label=k,
        box_visibility=vis_level.get(ann["visibility_token"], 0),
        box_category=ann["category_name"],
        box_instance=ann["instance_token"],
    )


@functools.lru_cache(maxsize=1)
def _detection_ranges() -> dict[str, float]:
    """The devkit's class ranges of detection_cvpr_2019 (metres, xy distance from the LIDAR_TOP ego pose)."""
    from nuscenes.eval.common.config import config_factory

    return dict(config_factory("detection_cvpr_2019").class_range)


def box_yaw(R: np.ndarray) -> float:
    """Yaw of a box -> ego rotation in [-pi, pi): the heading of its length axis (bev.geometry.BOX_FIELDS)."""
    yaw = math.atan2(R[1, 0], R[0, 0])
    return yaw if yaw < math.pi else -math.pi


def _detection_name(ann: dict) -> str | None:
    from nuscenes.eval.detection.utils import category_to_detection_name

    return category_to_detection_name(ann["category_name"])


def _add_detection_box(nusc, ann: dict, Rb: np.ndarray, Re: np.ndarray, te: np.ndarray, cols: dict[str, list]) -> bool:
    """Append one (checked) annotation, box -> global rotation Rb, as a detection box (det_* columns, ego frame
    (Re, te)) when the devkit's category_to_detection_name maps it to a class of DETECTION_CLASSES; whether it did.

    valid is the devkit's own ground-truth filter: num_lidar_pts + num_radar_pts > 0 and the xy
    distance from the ego under the class range; boxes not valid are not trained on."""
    name = _detection_name(ann)
    if name is None:
        return False
    if len(ann["attribute_tokens"]) > 1:
        raise ValueError(
            f"sample_annotation {ann['token']} has {len(ann['attribute_tokens'])} attributes; the devkit's "
            "DetectionEval allows at most one: fix that record of sample_annotation.json"
        )
    attribute = nusc.get("attribute", ann["attribute_tokens"][0])["name"] if ann["attribute_tokens"] else ""
    tb = np.asarray(ann["translation"], dtype=np.float64)
    points = int(ann["num_lidar_pts"]) + int(ann["num_radar_pts"])
    # The devkit's box_velocity[:2] (global; NaN without a neighbour, and stays NaN) in ego axes.
    velocity = Re.T @ np.append(nusc.box_velocity(ann["token"])[:2], 0.0)
    _append(
        cols,
        det_label=DETECTION_CLASSES.index(name),
        det_center=Re.T @ (tb - te),
        det_size=ann["size"],
        det_yaw=box_yaw(Re.T @ Rb),
        det_velocity=velocity[:2],
        det_attribute=attribute,
        det_points=points,
        det_valid=points > 0 and float(np.linalg.norm((tb - te)[:2])) < _detection_ranges()[name],
        det_token=ann["token"],
    )
    return True


def _sample_arrays(cols: dict[str, list], n: int) -> dict[str, np.ndarray]:
    """The n key frames' columns as arrays; per-camera ones are (n, len(CAMERA_NAMES), ...)."""
    ncam, f32 = len(CAMERA_NAMES), np.float32
    return {
        "sample_token": np.asarray(cols["sample_token"], dtype=str),
        "scene": np.asarray(cols["scene"], dtype=str),
        "location": np.asarray(cols["location"], dtype=str),
        "timestamp": np.asarray(cols["timestamp"], dtype=np.int64),
        # bytes, not str: NumPy str is 4 bytes a character (~80 MB of paths for trainval)
        "image_path": np.asarray([p.encode() for p in cols["image_path"]], dtype=bytes).reshape(n, ncam),
        "image_hw": np.asarray(cols["image_hw"], dtype=np.int64).reshape(n, ncam, 2),
        "intrinsics": np.asarray(cols["intrinsics"], dtype=f32).reshape(n, ncam, 3, 3),
        "rots": np.asarray(cols["rots"], dtype=f32).reshape(n, ncam, 3, 3),
        "trans": np.asarray(cols["trans"], dtype=f32).reshape(n, ncam, 3),
        "ego_rotation": np.asarray(cols["ego_rotation"], dtype=np.float64).reshape(n, 3, 3),
        "ego_translation": np.asarray(cols["ego_translation"], dtype=np.float64).reshape(n, 3),
        "lidar_path": np.asarray([p.encode() for p in cols["lidar_path"]], dtype=bytes),
        "lidar_rotation": np.asarray(cols["lidar_rotation"], dtype=np.float64).reshape(n, 3, 3),  # LIDAR_TOP -> ego
        "lidar_translation": np.asarray(cols["lidar_translation"], dtype=np.float64).reshape(n, 3),
    }


def _box_arrays(cols: dict[str, list]) -> dict[str, np.ndarray]:
    """The target boxes' columns as arrays, with their footprints and category names."""
    cat_names = sorted(set(cols["box_category"]))
    cat_code = {c: k for k, c in enumerate(cat_names)}
    centers = np.asarray(cols["box_center"], dtype=np.float64).reshape(-1, 3)
    sizes = np.asarray(cols["box_size"], dtype=np.float64).reshape(-1, 3)
    rots = np.asarray(cols["box_rotation"], dtype=np.float64).reshape(-1, 3, 3)
    return {
        "box_offsets": np.asarray(cols["box_offsets"], dtype=np.int64),
        "box_center": centers,
        "box_size": sizes,  # nuScenes (w, l, h)
        "box_rotation": rots,  # box -> ego
        "box_footprint": box_footprints(centers, sizes, rots),
        "box_label": np.asarray(cols["box_label"], dtype=np.int64),
        "box_visibility": np.asarray(cols["box_visibility"], dtype=np.uint8),
        "box_category": np.asarray([cat_code[c] for c in cols["box_category"]], dtype=np.int64),  # into category_names
        "category_names": np.asarray(cat_names, dtype=str),
        "box_instance": np.asarray([t.encode() for t in cols["box_instance"]], dtype=bytes),
        **_detection_arrays(cols),
    }


def _detection_arrays(cols: dict[str, list]) -> dict[str, np.ndarray]:
    """The detection boxes' columns (_add_detection_box) as arrays: sample i's are rows det_offsets[i]:det_offsets[i + 1]."""
    attr_names = sorted(set(cols["det_attribute"]) | {""})
    attr_code = {a: k for k, a in enumerate(attr_names)}
    velocity = np.asarray(cols["det_velocity"], dtype=np.float64).reshape(-1, 2)
    return {
        "det_offsets": np.concatenate([[0], np.cumsum(cols["det_count"], dtype=np.int64)]).astype(np.int64),
        "det_label": np.asarray(cols["det_label"], dtype=np.int64),  # into DETECTION_CLASSES
        "det_center": np.asarray(cols["det_center"], dtype=np.float64).reshape(-1, 3),
        "det_size": np.asarray(cols["det_size"], dtype=np.float64).reshape(-1, 3),  # (w, l, h)
        "det_yaw": np.asarray(cols["det_yaw"], dtype=np.float64),
        # m/s in ego axes; 0 where the devkit has none (det_velocity_known False): no NaN in the cached index.
        "det_velocity": np.nan_to_num(velocity, nan=0.0),
        "det_velocity_known": np.isfinite(velocity).all(1),
        "det_attribute": np.asarray([attr_code[a] for a in cols["det_attribute"]], dtype=np.int64),
        "det_attribute_names": np.asarray(attr_names, dtype=str),  # "" = no attribute
        "det_points": np.asarray(cols["det_points"], dtype=np.int64),  # num_lidar_pts + num_radar_pts
        "det_valid": np.asarray(cols["det_valid"], dtype=bool),
        "det_token": np.asarray([t.encode() for t in cols["det_token"]], dtype=bytes),  # sample_annotation
    }
