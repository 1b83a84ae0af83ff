"""nuScenes reader: multi-camera images + BEV targets for Lift-Splat training.

The devkit is used once per split to build a compact index (image paths, camera->ego
calibrations, ego poses, target boxes already in the ego frame). The index is cached under
<dataroot>/.bev_cache (or cache_dir), keyed by version, split, categories and the table
files' sizes/mtimes, so DataLoader workers never touch the devkit tables; with a valid cache
the devkit is not even constructed.

Ego frame = the ego pose of the sample's LIDAR_TOP sample_data (as in lift-splat-shoot).
Each camera image is taken at its own timestamp and ego pose, so camera->ego composes
camera -> ego(at camera time) -> global -> ego(at LIDAR_TOP time); lift-splat-shoot drops
the middle hop and is off by the ego motion between the two timestamps (up to ~0.5 m).

Target channels (`class_names`): the object classes (one per category group, see
normalize_categories) then the map classes of `map_layers` (bev.data.maps), all on the same
grid and ego frame. With map layers the index also caches the map geometry of the split's
locations (key: map classes + the map expansion files' sizes/mtimes).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from bev.classes import DETECTION_CLASSES, class_names, normalize_categories, normalize_map_layers, object_class_names  # noqa: F401 (re-exported)
from bev.data import temporal
from bev.data.config import DatasetConfig
from bev.data.depth import depth_targets, load_lidar
from bev.data.maps import load_map_geometry, rasterize_map
from bev.data.rasterize import box_footprints, rasterize_boxes
from bev.data.transforms import (
    LSS_BOT_PCT_LIM,
    LSS_ROT_LIM,
    ImageAug,
    float_range,
    normalize_array,
    resize_range,
    sample_augmentation,
    warp_image,
)
from bev.detection.targets import encode_targets
from bev.geometry import BOX_FIELDS, CAMERA_GEOMETRY, CAMERA_NAMES, FEATURE_STRIDE, quaternion_to_matrix
from bev.utils.io import atomic_open, atomic_write

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
INDEX_FORMAT = 9  # 9: tables validated at build (types, intrinsics, sizes, time order): older caches are rebuilt
# Fixed number of detection boxes per item (CenterPoint's max_objs); a sample with more valid boxes keeps the
# MAX_BOXES nearest (pad_boxes).
MAX_BOXES = 500
# Per process, for NuScenesBEVDataset.targets: the synthetic set needs ~15 MB, trainval at 200x200 would
# need ~2 GB and keeps only its first samples.
TARGET_MEMO_BYTES = 256 * 2**20
# Sanity bounds of table values: JPEG's largest side; a box larger than any annotated object (nuScenes' longest,
# a bendy bus or a trailer, are under 20 m) would fill the whole grid.
MAX_IMAGE_SIDE = 65535
MAX_BOX_SIZE_M = 100.0

_HOWTO = (
    "Expected layout: DATAROOT/<version>/*.json (the 13 tables) and DATAROOT/samples/CAM_*/*.jpg. "
    "Download nuScenes (v1.0-mini is 4 GB) from https://www.nuscenes.org/download and unpack it "
    "into DATAROOT, or write a synthetic nuScenes-format set with `bev-make-synthetic --out DIR`."
)


_FIX_LINKS = "Fix the prev/next links of sample.json (or scene.json), or re-download or regenerate the set."


def _split_scenes() -> dict[str, list[str]]:
    """Scene names per split: the devkit's own lists (mini_train, mini_val, train, val, test, ...)."""
    from nuscenes.utils.splits import create_splits_scenes

    return create_splits_scenes(verbose=False)


def _label(name: str, groups: tuple[tuple[str, ...], ...]) -> int:
    for k, prefixes in enumerate(groups):
        if any(name.startswith(p) for p in prefixes):
            return k
    return -1


def check_dataroot(dataroot: str | os.PathLike, version: str) -> Path:
    """Validate the layout; return the table folder. Raises FileNotFoundError with a fix."""
    root = Path(dataroot).expanduser()
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise FileNotFoundError(f"nuScenes dataroot {str(root)!r} {what}. {_HOWTO}")
    table_root = root / version
    if not table_root.is_dir():
        found = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("v1.0"))
        raise FileNotFoundError(
            f"nuScenes version folder {str(table_root)!r} does not exist (versions found in {str(root)!r}: "
            f"{found or 'none'}). {_HOWTO}"
        )
    missing = [t for t in TABLES if not (table_root / f"{t}.json").is_file()]
    if missing:
        raise FileNotFoundError(
            f"nuScenes table(s) missing in {str(table_root)!r}: {', '.join(m + '.json' for m in missing)}. "
            f"The download may be incomplete. {_HOWTO}"
        )
    return table_root


def _damaged_table(table_root: Path) -> ValueError | None:
    """A clear error naming the first table that is not valid JSON (read again, on this failure path only)."""
    for t in TABLES:
        path = table_root / f"{t}.json"
        try:
            with open(path, encoding="utf-8") as f:
                json.load(f)
        except ValueError as e:
            return ValueError(
                f"nuScenes table {str(path)!r} is damaged ({type(e).__name__}: {e}); the download or unpacking was "
                "probably cut short: re-download it from https://www.nuscenes.org/download (or regenerate a synthetic "
                "set with `bev-make-synthetic --out DIR`)."
            )
    return None


def _content_signature(files: Sequence[Path], memo_dir: Path) -> dict[str, str]:
    """The content digest of each file, by name. Sizes and mtimes survive cp -a, tar and edits that restore
    them, so the key is the content; a digest is rehashed only when a file's size, mtime, ctime or inode
    changed (memo in memo_dir/table_digests.json; the kernel sets ctime, no copy can carry it over)."""
    memo_file = memo_dir / "table_digests.json"
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    sig, fresh = {}, {}
    for p in sorted(files):
        st = p.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        known = memo.get(str(p.resolve()))
        digest = known["digest"] if isinstance(known, dict) and known.get("stamp") == stamp else _file_digest(p)
        sig[p.name], fresh[str(p.resolve())] = digest, {"stamp": stamp, "digest": digest}
    if fresh != {k: memo.get(k) for k in fresh}:
        with contextlib.suppress(OSError):  # a read-only mount: hashed again next time
            atomic_write(memo_file, json.dumps({**memo, **fresh}))
    return sig


def _file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _arrays_digest(index: dict) -> str:
    """A checksum of the index arrays (names, dtypes, shapes, bytes): what a loaded cache must match."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(index):
        a = np.ascontiguousarray(index[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _relative_filename(sd: dict) -> str:
    """sd["filename"], refused when it leaves the dataroot (absolute or through ..): files are read as dataroot/filename."""
    name = sd["filename"]
    if os.path.isabs(name) or ".." in Path(name).parts:
        raise ValueError(
            f"sample_data {sd['token']}: filename {name!r} leaves the dataroot; nuScenes filenames are "
            f"relative to the dataroot (e.g. samples/CAM_FRONT/<name>.jpg): fix this table entry, or "
            f"re-download the tables"
        )
    return name


def _check_image_size(size: tuple[int, int], table_hw, path: str) -> None:
    """Refuse an image whose header size differs from its sample_data width/height before decoding it: the
    devkit lifts PIL's decompression-bomb limit for the whole process, so a huge image would be decoded."""
    (w, h), (th, tw) = size, (int(v) for v in table_hw)
    if (w, h) != (tw, th):
        raise ValueError(
            f"camera image {path!r} is {w}x{h} pixels but its sample_data lists {tw}x{th}: not decoded. "
            f"Replace the image, or fix width/height in the sample_data table"
        )


def _numbers(value: Any, n: int) -> np.ndarray | None:
    """value as n finite float64 numbers; None for anything else: a string, null, true/false, numbers written
    as strings (NumPy would convert those silently), another length, NaN or infinity."""
    if not isinstance(value, list) or len(value) != n:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return None
    try:
        a = np.asarray(value, dtype=np.float64)
    except OverflowError:  # an integer beyond float64
        return None
    return a if np.isfinite(a).all() else None


def _record_error(table: str, token: str, problem: str) -> ValueError:
    return ValueError(f"{table} {token}: {problem}. Fix or re-export that record of {table}.json.")


def _pose_problem(rec: dict) -> str | None:
    """What makes a record's rotation (w, x, y, z) / translation unusable; None when it is fine."""
    q, t = _numbers(rec.get("rotation"), 4), _numbers(rec.get("translation"), 3)
    if q is None or np.linalg.norm(q) < 1e-6:
        return f"rotation {rec.get('rotation')!r} is not a quaternion (w, x, y, z) of non-zero, finite norm"
    if t is None:
        return f"translation {rec.get('translation')!r} is not 3 finite numbers"
    return None


def _pose(nusc, table: str, token: str) -> tuple[np.ndarray, np.ndarray]:
    """(rotation matrix, translation) of a pose record (ego_pose, calibrated_sensor); a broken one is an
    error, not a skip: every sample that uses it would train on NaN geometry."""
    rec = nusc.get(table, token)
    problem = _pose_problem(rec)
    if problem:
        raise _record_error(table, token, problem)
    return quaternion_to_matrix(rec["rotation"]), np.asarray(rec["translation"], dtype=np.float64)


def _intrinsics(calib: dict) -> np.ndarray:
    """A camera's calibrated_sensor camera_intrinsic as a (3, 3) pinhole matrix [[fx, s, cx], [0, fy, cy],
    [0, 0, 1]] with fx, fy > 0; anything else (zeros, NaN, a string, another shape) is an error: the model
    inverts it, and a singular one puts NaN in every feature of that camera."""
    value = calib.get("camera_intrinsic")
    rows = [_numbers(r, 3) for r in value] if isinstance(value, list) and len(value) == 3 else [None]
    if any(r is None for r in rows):
        raise _record_error(
            "calibrated_sensor", calib["token"], f"camera_intrinsic {value!r} is not a 3x3 matrix of finite numbers"
        )
    K = np.stack(rows)
    if K[0, 0] <= 0 or K[1, 1] <= 0 or np.abs(K[[1, 2, 2, 2], [0, 0, 1, 2]] - (0, 0, 0, 1)).max() > 1e-6:
        raise _record_error(
            "calibrated_sensor",
            calib["token"],
            f"camera_intrinsic {value!r} is not a pinhole camera matrix [[fx, s, cx], [0, fy, cy], [0, 0, 1]] "
            "with fx, fy > 0",
        )
    return K


def _image_hw(sd: dict) -> tuple[int, int]:
    """A camera sample_data's (height, width): whole numbers of pixels up to MAX_IMAGE_SIDE, else an error."""
    hw = (sd.get("height"), sd.get("width"))
    if not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_IMAGE_SIDE for v in hw):
        raise _record_error(
            "sample_data",
            sd["token"],
            f"height {hw[0]!r} x width {hw[1]!r} is not a camera image size (whole pixels, 1 to {MAX_IMAGE_SIDE}); "
            "nuScenes camera images are 1600x900",
        )
    return hw  # type: ignore[return-value]


def _box_problem(ann: dict) -> str | None:
    """What makes an annotation's box unusable (then it is skipped, counted); None when it is fine."""
    size = _numbers(ann.get("size"), 3)
    if size is None or (size <= 0).any():
        return f"size {ann.get('size')!r} not 3 positive numbers"
    if (size > MAX_BOX_SIZE_M).any():
        return f"size {ann['size']!r} larger than {MAX_BOX_SIZE_M:g} m"
    return _pose_problem(ann)


def build_index(
    dataroot: str | os.PathLike,
    version: str,
    split: str,
    groups,
    verbose: bool = True,
    map_layers: tuple[str, ...] = (),
) -> dict:
    """Walk the devkit tables once and return the flat index of one split (see module doc)."""
    root = Path(dataroot)
    scenes_of_split = set(_split_scenes()[split])
    nusc = _open_tables(root, version, split, verbose)
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


def _open_tables(root: Path, version: str, split: str, verbose: bool):
    """The devkit's NuScenes of root/version; a table that is not valid JSON is named in the error."""
    from nuscenes.nuscenes import NuScenes  # the heavy import only where it is needed

    if verbose:  # stderr: stdout belongs to the caller (bev-gallery prints the PNG path there)
        print(
            f"loading nuScenes {version} tables from {root} to index split {split!r} (once, then cached)",
            file=sys.stderr,
            flush=True,
        )
    try:
        nusc = NuScenes(version=version, dataroot=str(root), verbose=False)
    except ValueError as e:  # JSONDecodeError / UnicodeDecodeError: the devkit's message names no file
        raise _damaged_table(root / version) or e from e
    except Exception as e:  # its reverse index met a record it cannot follow (KeyError, TypeError, ...): name it
        raise _table_problem(_read_tables(root / version), root / version) or e from e
    problem = _table_problem({t: getattr(nusc, t) for t in TABLES}, root / version)
    if problem:
        raise problem
    return nusc


def _table_problem(tables: dict[str, Any], table_root: Path) -> ValueError | None:
    """The first problem of the tables as a clear error (record shapes, duplicated tokens, links, plain
    fields), None when there is none."""
    return (
        _malformed_record(tables)
        or _duplicated_token(tables, table_root)
        or _dangling_link(tables)
        or _unmapped_log(tables)
        or _bad_field(tables)
    )


def _malformed_record(tables: dict[str, Any]) -> ValueError | None:
    """A clear error for a table that is not a list of records (JSON objects) with a string token each."""
    for table in TABLES:
        records = tables[table]
        if not isinstance(records, list):
            return ValueError(
                f"nuScenes table {table}.json holds a JSON {type(records).__name__}, not a list of records. "
                "Re-download or regenerate the set."
            )
        for k, record in enumerate(records):
            if not isinstance(record, dict) or not isinstance(record.get("token"), str):
                what = "has no string token" if isinstance(record, dict) else f"is {record!r}, not a JSON object"
                return ValueError(
                    f"nuScenes table {table}, record #{k} {what}. Fix that record of {table}.json, or "
                    "re-download or regenerate the set."
                )
    return None


# (table, field, the table its tokens name) of every link between the tables; "" ends a prev/next chain.
_LINKS = (
    ("scene", "log_token", "log"),
    ("scene", "first_sample_token", "sample"),
    ("scene", "last_sample_token", "sample"),
    ("sample", "scene_token", "scene"),
    ("sample", "prev", "sample"),
    ("sample", "next", "sample"),
    ("sample_data", "sample_token", "sample"),
    ("sample_data", "ego_pose_token", "ego_pose"),
    ("sample_data", "calibrated_sensor_token", "calibrated_sensor"),
    ("sample_data", "prev", "sample_data"),
    ("sample_data", "next", "sample_data"),
    ("sample_annotation", "sample_token", "sample"),
    ("sample_annotation", "instance_token", "instance"),
    ("sample_annotation", "attribute_tokens", "attribute"),
    ("sample_annotation", "visibility_token", "visibility"),
    ("sample_annotation", "prev", "sample_annotation"),
    ("sample_annotation", "next", "sample_annotation"),
    ("instance", "category_token", "category"),
    ("instance", "first_annotation_token", "sample_annotation"),
    ("instance", "last_annotation_token", "sample_annotation"),
    ("calibrated_sensor", "sensor_token", "sensor"),
    ("map", "log_tokens", "log"),
)


def _read_tables(table_root: Path) -> dict[str, list[dict]]:
    """The tables as JSON records (read again, on a failure path only)."""
    return {t: json.loads((table_root / f"{t}.json").read_text(encoding="utf-8")) for t in TABLES}


def _dangling_link(tables: dict[str, list[dict]]) -> ValueError | None:
    """A clear error naming the first record whose link names a token its table lacks (or that lacks the link)."""
    tokens = {t: {r.get("token") for r in tables[t]} for t in {target for _, _, target in _LINKS}}
    for table, field, target in _LINKS:
        ends = ("",) if field in ("prev", "next") else ()
        many = field.endswith("_tokens")  # a list of tokens (attribute_tokens, log_tokens), else one token
        for record in tables[table]:
            value = record.get(field)
            if many and not isinstance(value, list):
                return _link_error(table, record, field, target, value)
            for v in value if many else [value]:
                if not isinstance(v, str) or (v not in tokens[target] and v not in ends):
                    return _link_error(table, record, field, target, v)
    return None


def _unmapped_log(tables: dict[str, list[dict]]) -> ValueError | None:
    """A clear error for a log that no map record names in its log_tokens: the devkit gives each log its map."""
    named = {token for record in tables["map"] for token in record["log_tokens"]}
    for log in tables["log"]:
        if log["token"] not in named:
            return ValueError(
                f"nuScenes table log, record {log['token']!r}: no record of map.json names it in its log_tokens. "
                "Add its token to the log_tokens of its map in map.json, or re-download or regenerate the set."
            )
    return None


def _link_error(table: str, record: dict, field: str, target: str, bad: Any) -> ValueError:
    where = f"nuScenes table {table}, record {record.get('token')!r}"
    fix = f"Fix that record of {table}.json, or re-download or regenerate the set."
    if field not in record:
        return ValueError(f"{where}: it has no {field} field (its link to {target}). {fix}")
    if field.endswith("_tokens") and not isinstance(record[field], list):
        return ValueError(f"{where}: {field} is {bad!r}, not a list of {target} tokens. {fix}")
    if not isinstance(bad, str):
        return ValueError(f"{where}: {field} is {bad!r}, not a {target} token (a string). {fix}")
    return ValueError(f"{where}: {field} names {target} token {bad!r}, which {target}.json lacks. {fix}")


def _duplicated_token(tables: dict[str, list[dict]], table_root: Path) -> ValueError | None:
    """Refuse a table with two records of one token: the devkit silently keeps the last (a duplicated sample
    dropped samples of its scene, a duplicated scene was indexed twice)."""
    for table in TABLES:
        seen: set[str] = set()
        for record in tables[table]:
            token = record["token"]
            if token in seen:
                return ValueError(
                    f"nuScenes table {table} ({str(table_root / f'{table}.json')!r}) has more than one record with "
                    f"token {token!r}; tokens must be unique (the devkit would keep one and silently change the "
                    f"data). Remove the duplicate from {table}.json, or re-download or regenerate the set."
                )
            seen.add(token)
    return None


# (table, field, kind) of the plain fields the reader (or the devkit's reverse index) takes as they are.
_FIELDS = (
    ("scene", "name", "text"),
    ("scene", "nbr_samples", "count"),
    ("sample", "timestamp", "count"),
    ("log", "location", "text"),
    ("sensor", "channel", "text"),
    ("sensor", "modality", "text"),
    ("category", "name", "text"),
    ("attribute", "name", "text"),
    ("sample_data", "filename", "text"),
    ("sample_data", "is_key_frame", "flag"),
    ("sample_annotation", "num_lidar_pts", "count"),
    ("sample_annotation", "num_radar_pts", "count"),
)
_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "text": (lambda v: isinstance(v, str), "a string"),
    "count": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a whole number >= 0"),
    "flag": (lambda v: isinstance(v, bool), "true or false"),
}


def _bad_field(tables: dict[str, list[dict]]) -> ValueError | None:
    """A clear error naming the first record whose plain field (_FIELDS) is missing or of the wrong type."""
    for table, field, kind in _FIELDS:
        ok, expected = _KINDS[kind]
        for record in tables[table]:
            if field not in record or not ok(record[field]):
                value = f"is {record[field]!r}" if field in record else "is missing"
                return ValueError(
                    f"nuScenes table {table}, record {record['token']!r}: {field} {value}, not {expected}. Fix that "
                    f"record of {table}.json, or re-download or regenerate the set."
                )
    return None


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
    Re, te = _pose(nusc, "ego_pose", lidar["ego_pose_token"])
    Rl, tl = _pose(nusc, "calibrated_sensor", lidar["calibrated_sensor_token"])
    _append(cols, lidar_path=_relative_filename(lidar), lidar_rotation=Rl, lidar_translation=tl)
    for cam in CAMERA_NAMES:
        _add_camera(nusc, nusc.get("sample_data", sample["data"][cam]), Re, te, cols)
    detections = 0
    for ann_token in sample["anns"]:
        ann = nusc.get("sample_annotation", ann_token)
        _add_box(ann, groups, vis_level, Re, te, cols)
        detections += _add_detection_box(nusc, ann, Re, te, cols)
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
    Rc, tc = _pose(nusc, "calibrated_sensor", sd["calibrated_sensor_token"])
    Rce, tce = _pose(nusc, "ego_pose", sd["ego_pose_token"])
    # camera -> ego(camera time) -> global -> ego(LIDAR_TOP time)
    _append(
        cols,
        rots=Re.T @ Rce @ Rc,
        trans=Re.T @ (Rce @ tc + tce - te),
        intrinsics=_intrinsics(calib),
        image_path=_relative_filename(sd),
        image_hw=_image_hw(sd),
    )


def _add_box(
    ann: dict, groups, vis_level: dict[str, int], Re: np.ndarray, te: np.ndarray, cols: dict[str, list]
) -> None:
    """Append one annotation as a target box in the ego frame (Re, te), unless no category group has it."""
    k = _label(ann["category_name"], groups)
    if k < 0:
        return
    problem = _box_problem(ann)
    if problem:  # one broken annotation should not stop a dataset: skipped, counted, named (build_index)
        cols["skipped_boxes"].append(f"{ann['token']} ({problem})")
        return
    Rb, tb = quaternion_to_matrix(ann["rotation"]), np.asarray(ann["translation"], dtype=np.float64)
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


def _add_detection_box(nusc, ann: dict, Re: np.ndarray, te: np.ndarray, cols: dict[str, list]) -> bool:
    """Append one annotation as a detection box (det_* columns, ego frame (Re, te)) when the devkit's
    category_to_detection_name maps it to a class of DETECTION_CLASSES; whether it did.

    valid is the devkit's own ground-truth filter: num_lidar_pts + num_radar_pts > 0 and the xy
    distance from the ego under the class range; boxes not valid are not trained on."""
    from nuscenes.eval.detection.utils import category_to_detection_name

    name = category_to_detection_name(ann["category_name"])
    if name is None:
        return False
    problem = _box_problem(ann)
    if problem:  # counted once with the target boxes' (build_index names them)
        entry = f"{ann['token']} ({problem})"
        if entry not in cols["skipped_boxes"][-1:]:
            cols["skipped_boxes"].append(entry)
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
        det_yaw=box_yaw(Re.T @ quaternion_to_matrix(ann["rotation"])),
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


def _save_npz(index: dict, key: dict, path: Path) -> None:
    """Write the index atomically as .npz (no pickle: a cache file found in a downloaded dataroot
    must not be able to run code when loaded)."""
    with atomic_open(path, "wb") as f:
        np.savez(
            f,
            __key__=np.asarray(json.dumps(key, sort_keys=True)),
            __digest__=np.asarray(_arrays_digest(index)),
            **index,
        )


def _load_npz(path: Path, key: dict) -> dict | None:
    """The cached index, or None when its key differs (stale); ValueError when its arrays do not match
    the checksum written with them (edited, damaged, an array missing)."""
    with np.load(path, allow_pickle=False) as z:
        if str(z["__key__"]) != json.dumps(key, sort_keys=True):
            return None
        index = {k: z[k] for k in z.files if k not in ("__key__", "__digest__")}
        if "__digest__" not in z.files or str(z["__digest__"]) != _arrays_digest(index):
            raise ValueError("its arrays do not match the checksum written with them (edited or damaged)")
        return index


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
    table_root = check_dataroot(dataroot, version)
    splits = _split_scenes()
    if split not in splits:
        raise ValueError(f"unknown nuScenes split {split!r}; choose one of {sorted(splits)} (mini_* for v1.0-mini)")
    groups = normalize_categories(categories)
    layers = normalize_map_layers(map_layers)
    key = _cache_key(dataroot, table_root, version, split, groups, layers, _cache_root(dataroot, cache_dir))
    cache_file = _cache_file(dataroot, cache_dir, key)
    cached = _read_cache(cache_file, key)
    if cached is not None:
        return cached
    index = build_index(dataroot, version, split, groups, verbose=verbose, map_layers=layers)
    _check_built(index, dataroot, table_root, version, split, splits[split])
    try:
        _save_npz(index, key, cache_file)
    except OSError as e:  # read-only dataset mounts still work, just without a cache
        warnings.warn(
            f"could not write the index cache {cache_file} ({e}); pass cache_dir=<writable dir>", stacklevel=2
        )
    return index


def _cache_key(
    dataroot: str | os.PathLike,
    table_root: Path,
    version: str,
    split: str,
    groups,
    layers: tuple[str, ...],
    cache_root: Path,
) -> dict:
    """What a cached index must match: format, split, classes, the tables' and the map files' contents."""
    key = {
        "format": INDEX_FORMAT,
        "version": version,
        "split": split,
        "categories": [list(g) for g in groups],
        "tables": _content_signature(list(table_root.glob("*.json")), cache_root),
    }
    if layers:
        maps = list((Path(dataroot) / "maps" / "expansion").glob("*.json"))
        key.update(map_layers=list(layers), maps=_content_signature(maps, cache_root))
    return key


def _cache_file(dataroot: str | os.PathLike, cache_dir: str | os.PathLike | None, key: dict) -> Path:
    """Where the index of `key` is cached: one file per version, split and class list."""
    classes = [key["categories"], key.get("map_layers", [])]
    cat_hash = hashlib.sha1(json.dumps(classes).encode()).hexdigest()[:10]
    return _cache_root(dataroot, cache_dir) / f"{key['version']}__{key['split']}__{cat_hash}.npz"


def _cache_root(dataroot: str | os.PathLike, cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else Path(dataroot) / ".bev_cache"


def _read_cache(cache_file: Path, key: dict) -> dict | None:
    """The cached index when cache_file holds one of this key, else None."""
    if not cache_file.is_file():
        return None
    try:
        return _load_npz(cache_file, key)
    except Exception as e:  # a corrupt cache is rebuilt, never fatal
        warnings.warn(f"ignoring unreadable index cache {cache_file} (rebuilt from the tables): {e}", stacklevel=2)
        return None


def _check_built(
    index: dict, dataroot: str | os.PathLike, table_root: Path, version: str, split: str, split_scenes: list[str]
) -> None:
    """Refuse a fresh index with no samples or with camera images missing on disk (before it is cached)."""
    if len(index["sample_token"]) == 0:
        raise ValueError(
            f"split {split!r} is empty in {str(table_root)!r}: none of its {len(split_scenes)} scenes "
            f"(e.g. {split_scenes[:3]}) are in this {version} release. Use mini_train/mini_val with v1.0-mini "
            f"and train/val with v1.0-trainval. {_HOWTO}"
        )
    missing = [p.decode() for p in index["image_path"].ravel() if not (Path(dataroot) / p.decode()).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} camera image(s) of split {split!r} are missing, e.g. {str(Path(dataroot) / missing[0])!r}. "
            f"{_HOWTO}"
        )


class NuScenesBEVDataset(Dataset):
    """Six surround-camera images + BEV targets of the key-frame samples of one split.

    Arguments: the dataset's own `split`, `augment` (training augmentation) and `verbose`, and the
    settings every dataset of a run shares: a DatasetConfig (`config`) and/or its fields as keyword
    arguments (bev.data.config declares each with its default and meaning; unknown names are refused),
    e.g. NuScenesBEVDataset(root, split="mini_val", map_layers="lss").

    ds[i] is a dict:
      images (Ncam, 3, H, W) float32, ImageNet-normalised; intrinsics (Ncam, 3, 3);
      rots (Ncam, 3, 3), trans (Ncam, 3) camera->ego; post_rots (Ncam, 3, 3), post_trans
      (Ncam, 3) the image augmentation (bev.geometry convention); cam_ids (Ncam,) int64 indices
      into CAMERA_NAMES; bev (K, X, Y) float32 {0, 1} (K = 1 for a list of prefixes, K groups
      for a list of lists); visibility (X, Y) uint8, highest nuScenes visibility level (1-4)
      of the target boxes covering a cell, 0 where none; bev_bounds (2, 3) float64 the grid's
      x and y [lo, hi, step]; sample_token str.
    bev has len(class_names) channels: the object classes, then the map classes of map_layers
    (a preset name, a list of bev.data.maps.MAP_CLASSES names, or None).
    raster="center": a cell is filled when its centre lies in a box footprint; raster="lss":
    lift-splat-shoot's rounded-corner fill (bev.data.rasterize). Map channels follow the
    devkit's get_map_mask rule (bev.data.maps), which is the "lss" rule for polygons.
    depth_target=True adds depth (Ncam, H/16, W/16) int64: the depth bin of the nearest LIDAR_TOP
    point in each camera feature cell, -1 where none (bev.data.depth), for depth supervision.
    With augment=False images get the deterministic LSS resize + crop and all 6 cameras;
    with augment=True and ncams < 6 a random subset of ncams cameras (kept in camera order).
    resize_lim, bot_pct_lim, rot_lim: None gives Lift-Splat-Shoot's ranges (bev.data.transforms);
    resize_lim is absolute, and None scales the LSS range to final_dim.

    past_frames=P, future_frames=F (either > 0): ds[i] is window i, P + 1 + F consecutive key frames of
    one scene (bev.data.temporal; scenes too short are skipped and counted on stderr), T = P + 1 + F:
      sample_tokens list of T tokens, oldest first, the present at index P; images, intrinsics, rots,
      trans, post_rots, post_trans (and depth) of the P + 1 input frames with a leading time axis
      ((P + 1, Ncam, ...); in training each camera's augmentation is the same in every frame);
      future_egomotion (T, 4, 4) float32, entry t maps frame t's ego coordinates into frame t+1's
      (x, y, yaw only), the last the identity; labels of the present and F future frames in the
      present frame's grid: instance (F + 1, X, Y) int64 (0 background, ids over the whole window),
      segmentation (F + 1, X, Y) int64 (instance > 0), centerness (F + 1, 1, X, Y), offset and flow
      (F + 1, 2, X, Y) float32 in cells, temporal.IGNORE (255) where undefined (channel 0 along x, 1 along y);
      cam_ids, bev, visibility, bev_bounds and sample_token of the present frame, as for P = F = 0.
    Labels are FIERY's (bev.data.temporal): filter_invisible drops boxes of visibility level 1;
    label_warp="fiery" reproduces FIERY's label warp, lateral sign error included.
    """

    use_draft = True  # decode JPEGs at 1/2, 1/4, 1/8 DCT scale when the output allows (exact geometry)

    def __init__(
        self,
        dataroot: str | os.PathLike | None = None,
        *,
        split: str = "mini_train",
        augment: bool = False,
        verbose: bool = True,
        config: DatasetConfig | None = None,
        **options: Any,
    ) -> None:
        if dataroot is not None:
            options["dataroot"] = dataroot
        self.config = cfg = DatasetConfig.build(config, **options)
        self.dataroot, self.version, self.split = cfg.dataroot, cfg.version, split
        self.grid, self.final_dim = cfg.grid, cfg.final_dim
        self.augment = bool(augment)
        self.resize_lim = resize_range(cfg.resize_lim, self.final_dim, self.augment)
        self.bot_pct_lim = float_range(cfg.bot_pct_lim, LSS_BOT_PCT_LIM)
        self.rot_lim = float_range(cfg.rot_lim, LSS_ROT_LIM)
        self.rand_flip, self.ncams = cfg.rand_flip, cfg.ncams
        self.groups, self.map_layers = cfg.categories, cfg.map_layers
        self.raster, self.depth_target, self.detection = cfg.raster, cfg.depth_target, cfg.detection
        self.index = load_index(
            self.dataroot, self.version, split, self.groups, cfg.cache_dir, verbose=verbose, map_layers=self.map_layers
        )
        self._init_windows(cfg.past_frames, cfg.future_frames, cfg.filter_invisible, cfg.label_warp)
        self._memo: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # sample -> packed targets (targets())
        self._memo_bytes = 0
        self._inputs_limit = int(cfg.input_memo_mb * 2**20)
        self._inputs: dict[tuple[str, int, int], Any] = {}  # see remember_input()
        self._inputs_bytes = 0

    @property
    def class_names(self) -> tuple[str, ...]:
        """One name per target channel: object classes, then map classes."""
        return object_class_names(self.groups) + self.map_layers

    @property
    def num_object_classes(self) -> int:
        return len(self.groups)

    @property
    def num_classes(self) -> int:
        return len(self.groups) + len(self.map_layers)

    def map_target(self, i: int) -> np.ndarray:
        """(len(map_layers), X, Y) uint8 map channels of sample i (bev.data.maps.rasterize_map)."""
        return rasterize_map(
            self.index,
            str(self.index["location"][i]),
            self.index["ego_rotation"][i],
            self.index["ego_translation"][i],
            self.grid,
            len(self.map_layers),
        )

    def targets(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """bev (K, X, Y) float32 and visibility (X, Y) uint8 of sample i.

        Targets do not depend on the image augmentation, so each is rasterised once per process
        and kept bit-packed (about K * X * Y / 8 bytes) while the memo stays under TARGET_MEMO_BYTES:
        from the second epoch on, (persistent) workers only decode images.
        """
        if i in self._memo:
            bits, vis = self._memo[i]
            bev = np.unpackbits(bits, count=self.num_classes * self.grid.nx * self.grid.ny)
            return bev.reshape(self.num_classes, self.grid.nx, self.grid.ny).astype(np.float32), vis.copy()
        box = self.boxes(i)
        bev, vis = rasterize_boxes(
            box["footprint"], box["label"], box["visibility"], self.grid, self.num_object_classes, self.raster
        )
        if self.map_layers:
            bev = np.concatenate([bev, self.map_target(i).astype(np.float32)])
        entry = (np.packbits(bev.astype(bool)), vis.copy())  # callers may write into what they get
        size = entry[0].nbytes + vis.nbytes
        if self._memo_bytes + size <= TARGET_MEMO_BYTES:
            self._memo[i], self._memo_bytes = entry, self._memo_bytes + size
        return bev, vis

    def __len__(self) -> int:
        return len(self.windows) if self.temporal else len(self.index["sample_token"])

    def _init_windows(self, past_frames: int, future_frames: int, filter_invisible: bool, label_warp: str) -> None:
        """The window index (bev.data.temporal) when past_frames or future_frames > 0; scenes too short are counted."""
        self.past_frames, self.future_frames = temporal.check_frames(past_frames, future_frames)
        self.filter_invisible = bool(filter_invisible)
        self.label_warp = temporal.check_label_warp(label_warp)
        self.temporal = self.past_frames + self.future_frames > 0
        self.windows = np.zeros(0, np.int64)
        if self.temporal:
            self.windows, short = temporal.window_index(self.index["scene"], self.past_frames, self.future_frames)
            if short:
                print(
                    f"{self.split}: skipped {len(short)} of {len(short) + len(set(self.index['scene'][self.windows]))} "
                    f"scenes shorter than a window of {self.window_length} key frames",
                    file=sys.stderr,
                    flush=True,
                )

    @property
    def window_length(self) -> int:
        return self.past_frames + 1 + self.future_frames

    def window_frames(self, w: int) -> np.ndarray:
        """Sample (index row) numbers of window w, oldest first; the present is at position past_frames."""
        return self.windows[w] + np.arange(self.window_length)

    def choose_cams(self) -> np.ndarray:
        n = len(CAMERA_NAMES)
        if self.augment and self.ncams < n:
            return np.sort(torch.randperm(n)[: self.ncams].numpy())
        return np.arange(n)

    def boxes(self, i: int) -> dict[str, np.ndarray]:
        """Target boxes of sample i in the ego frame (centre, size wlh, rotation, footprint, label, ...)."""
        a, b = self.index["box_offsets"][i], self.index["box_offsets"][i + 1]
        out = {k[4:]: self.index[k][a:b] for k in self.index if k.startswith("box_") and k != "box_offsets"}
        out["category"] = self.index["category_names"][out["category"]] if len(out["category"]) else np.zeros(0, str)
        out["instance"] = np.asarray([t.decode() for t in out["instance"]], dtype=str)
        return out

    def detection_boxes(self, i: int) -> dict[str, np.ndarray]:
        """Sample i's detection boxes: boxes (M, 9) float32 rows of bev.geometry.BOX_FIELDS (ego frame;
        velocity NaN where the devkit has none), labels (M,) int64 into DETECTION_CLASSES, attributes (M,)
        str ("" for none), points (M,) int64 (lidar + radar), valid (M,) bool (the devkit's GT filter),
        tokens (M,) str (sample_annotation)."""
        a, b = self.index["det_offsets"][i], self.index["det_offsets"][i + 1]
        ix = self.index
        velocity = np.where(ix["det_velocity_known"][a:b, None], ix["det_velocity"][a:b], np.nan)
        boxes = np.concatenate([ix["det_center"][a:b], ix["det_size"][a:b], ix["det_yaw"][a:b, None], velocity], 1)
        return {
            "boxes": boxes.astype(np.float32).reshape(-1, len(BOX_FIELDS)),
            "labels": ix["det_label"][a:b].copy(),
            "attributes": ix["det_attribute_names"][ix["det_attribute"][a:b]].astype(str),
            "points": ix["det_points"][a:b].copy(),
            "valid": ix["det_valid"][a:b].copy(),
            "tokens": np.asarray([t.decode() for t in ix["det_token"][a:b]], dtype=str),
        }

    def image_path(self, i: int, cam: int) -> str:
        """Absolute path of sample i's image from camera CAMERA_NAMES[cam]."""
        return os.path.join(self.dataroot, self.index["image_path"][i, cam].decode())

    def remember_input(self, key: tuple[str, int, int], make: Callable[[], Any], nbytes: Callable[[Any], int]) -> Any:
        """make(), memoised under key while the memo stays under input_memo_mb, for inputs that
        never change: without augmentation a camera crop (uint8, 0.13 MB at 128x352) and a depth
        target are the same every epoch, and decoding the crops is most of a loader's time."""
        if key in self._inputs:
            return self._inputs[key]
        value = make()
        size = nbytes(value)
        if self._inputs_bytes + size <= self._inputs_limit:
            self._inputs[key], self._inputs_bytes = value, self._inputs_bytes + size
        return value

    def load_image(
        self, i: int, cam: int, train: bool, aug: ImageAug | None = None
    ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        if train:
            pixels, post_rot, post_tran = self.decode_image(i, cam, train, aug)
        else:
            pixels, post_rot, post_tran = self.remember_input(
                ("image", i, cam), lambda: self.decode_image(i, cam, train), lambda v: v[0].nbytes
            )
        return normalize_array(pixels), post_rot.clone(), post_tran.clone()

    def decode_image(
        self, i: int, cam: int, train: bool, aug: ImageAug | None = None
    ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """(H, W, 3) uint8 crop of sample i's camera `cam`, with its post_rot and post_tran (`aug`, or one drawn)."""
        path = self.image_path(i, cam)
        try:
            with Image.open(path) as img:  # reads the header only: the size is checked before any pixel is decoded
                _check_image_size(img.size, self.index["image_hw"][i, cam], path)
                if aug is None:
                    aug = self.draw_augmentation((img.size[1], img.size[0]), train)
                pixels = np.asarray(warp_image(img, aug, self.use_draft))
        except FileNotFoundError:
            raise FileNotFoundError(
                f"camera image {path!r} is missing (listed in {self.version} sample_data). {_HOWTO}"
            ) from None
        except OSError as e:  # truncated / corrupt JPEG: name the file
            raise OSError(f"cannot decode camera image {path!r} ({e}); re-download or regenerate it") from e
        post_rot, post_tran = aug.post_rot_tran()
        return pixels, post_rot, post_tran

    def draw_augmentation(self, raw_hw: tuple[int, int], train: bool) -> ImageAug:
        """A random training augmentation (train) or the deterministic validation one, for a raw (H, W) image."""
        return sample_augmentation(
            raw_hw, self.final_dim, train, self.resize_lim, self.bot_pct_lim, self.rot_lim, self.rand_flip
        )

    def lidar_points(self, i: int) -> torch.Tensor:
        """(P, 3) LIDAR_TOP points of sample i in the ego frame."""
        path = os.path.join(self.dataroot, self.index["lidar_path"][i].decode())
        R, t = self.index["lidar_rotation"][i], self.index["lidar_translation"][i]
        return torch.from_numpy((load_lidar(path) @ R.T + t).astype(np.float32))

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(
                f"{'window' if self.temporal else 'sample'} index {i} out of range for {len(self)} "
                f"{'windows' if self.temporal else 'samples'}"
            )
        i = i % len(self)
        if self.temporal:
            return temporal.window_item(self, i)
        return self.frame_item(i, self.choose_cams())

    @property
    def bev_bounds(self) -> torch.Tensor:
        """(2, 3) float64 [[xlo, xhi, xstep], [ylo, yhi, ystep]] of the grid: in every item, so that pictures
        need no grid plumbing."""
        return torch.tensor([self.grid.xbound, self.grid.ybound], dtype=torch.float64)

    def frame_item(
        self,
        i: int,
        cams: np.ndarray,
        input_frames: Sequence[int] | None = None,
        augs: Sequence[ImageAug] | None = None,
    ) -> dict[str, Any]:
        """The item of sample i (class doc): its cameras' inputs (frame_inputs) and its targets.

        input_frames: samples (oldest first, ending with i: a window's P + 1 input frames) whose inputs are
        stacked along a leading time axis instead of sample i's alone. augs: as frame_inputs."""
        if input_frames is None:
            inputs = self.frame_inputs(i, cams, augs)
        else:
            frames = [self.frame_inputs(int(j), cams, augs) for j in input_frames]
            inputs = {k: torch.stack([x[k] for x in frames]) for k in frames[0]}
        depth = inputs.pop("depth", None)
        bev, vis = self.targets(i)
        item = {
            **inputs,
            "cam_ids": torch.from_numpy(cams.astype(np.int64)),
            "bev": torch.from_numpy(bev),
            "visibility": torch.from_numpy(vis),
            "bev_bounds": self.bev_bounds,
            "sample_token": str(self.index["sample_token"][i]),
        }
        if depth is not None:
            item["depth"] = depth
        if self.detection:
            item.update(detection_item(self, i))
        return item

    def frame_inputs(self, i: int, cams: np.ndarray, augs: Sequence[ImageAug] | None = None) -> dict[str, torch.Tensor]:
        """Sample i's images and CAMERA_GEOMETRY tensors of cameras `cams`, and depth with depth_target.

        augs: one augmentation per camera (a training window uses the same ones for all its frames),
        None to draw one per image."""
        imgs, post_rots, post_trans = [], [], []
        for k, c in enumerate(cams):
            img, pr, pt = self.load_image(i, int(c), self.augment, None if augs is None else augs[k])
            imgs.append(img)
            post_rots.append(pr)
            post_trans.append(pt)
        out = {
            "images": torch.from_numpy(np.stack(imgs)),
            "intrinsics": torch.from_numpy(self.index["intrinsics"][i, cams]),
            "rots": torch.from_numpy(self.index["rots"][i, cams]),
            "trans": torch.from_numpy(self.index["trans"][i, cams]),
            "post_rots": torch.stack(post_rots),
            "post_trans": torch.stack(post_trans),
        }
        if self.depth_target:

            def depth():
                return depth_targets(
                    self.lidar_points(i),
                    *(out[k] for k in CAMERA_GEOMETRY),
                    self.final_dim,
                    FEATURE_STRIDE,
                    self.grid,
                    torch.from_numpy(self.index["image_hw"][i, cams]),
                )

            if self.augment:
                out["depth"] = depth()
            else:  # all cameras, fixed crops: the same target every epoch
                out["depth"] = self.remember_input(
                    ("depth", i, -1), depth, lambda t: t.numel() * t.element_size()
                ).clone()
        return out


def pad_boxes(
    boxes: np.ndarray, labels: np.ndarray, valid: np.ndarray, max_boxes: int = MAX_BOXES, where: str = "a sample"
) -> dict[str, np.ndarray]:
    """Fixed-size detection targets from one sample's boxes (detection_boxes): only valid boxes are kept.

    det_boxes (max_boxes, 9) float32 (BOX_FIELDS; padding and NaN velocities are 0), det_labels (max_boxes,)
    int64 (-1 for padding), det_velocity_valid (max_boxes,) bool (a real box whose velocity is known).
    More than max_boxes valid boxes: the max_boxes nearest the ego (xy) are kept, in their order, and
    the rest counted in a warning."""
    boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, len(BOX_FIELDS))
    keep = np.flatnonzero(np.asarray(valid, dtype=bool) & (np.asarray(labels) >= 0))
    if len(keep) > max_boxes:
        dist = np.hypot(boxes[keep, 0], boxes[keep, 1])
        warnings.warn(
            f"{where} has {len(keep)} valid detection boxes, more than max_boxes={max_boxes}: the "
            f"{len(keep) - max_boxes} farthest are not trained on",
            stacklevel=2,
        )
        keep = np.sort(keep[np.argsort(dist, kind="stable")[:max_boxes]])
    n = len(keep)
    out_boxes = np.zeros((max_boxes, len(BOX_FIELDS)), np.float32)
    out_boxes[:n] = boxes[keep]
    vel = out_boxes[:, 7:9]
    velocity_valid = np.isfinite(vel).all(1) & (np.arange(max_boxes) < n)
    vel[~np.isfinite(vel)] = 0.0
    out_labels = np.full(max_boxes, -1, np.int64)
    out_labels[:n] = np.asarray(labels, dtype=np.int64)[keep]
    return {"det_boxes": out_boxes, "det_labels": out_labels, "det_velocity_valid": velocity_valid}


def detection_item(ds: NuScenesBEVDataset, i: int) -> dict[str, torch.Tensor]:
    """The detection fields of sample i (index row) of ds as tensors: pad_boxes of ds.detection_boxes(i)
    (det_boxes, det_labels, det_velocity_valid: the ground truth for pictures) and the CenterPoint targets
    of those boxes on ds.grid (bev.detection.targets.encode_targets: det_heatmap, det_index, ...)."""
    det = ds.detection_boxes(i)
    where = f"sample {ds.index['sample_token'][i]}"
    padded = pad_boxes(det["boxes"], det["labels"], det["valid"], where=where)
    labels = np.where(det["valid"], det["labels"], -1)
    targets = encode_targets(det["boxes"], labels, ds.grid, max_objects=MAX_BOXES)
    return {k: torch.from_numpy(v) for k, v in {**padded, **targets}.items()}
