"""nuScenes tables: where they live, and the checks that turn a broken table into one clear error.

The reader validates what the devkit takes on trust (record shapes, unique tokens, links between tables,
plain field types, poses, intrinsics, image sizes, box sizes) before anything is indexed: a broken table
names its file, record and field, never a deep KeyError from inside the devkit.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bev.geometry import quaternion_to_matrix

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

# Sanity bounds of table values: JPEG's largest side; a box larger than any annotated object (nuScenes' longest,
# a bendy bus or a trailer, are under 20 m) would fill the whole grid.
MAX_IMAGE_SIDE = 65535

MAX_BOX_SIZE_M = 100.0

HOWTO = (
    "Expected layout: DATAROOT/<version>/*.json (the 13 tables) and DATAROOT/samples/CAM_*/*.jpg. "
    "Download nuScenes (v1.0-mini is 4 GB) from https://www.nuscenes.org/download and unpack it "
    "into DATAROOT, or write a synthetic nuScenes-format set with `bev-make-synthetic --out DIR`."
)


def check_dataroot(dataroot: str | os.PathLike, version: str) -> Path:
    """Validate the layout; return the table folder. Raises FileNotFoundError with a fix."""
    root = Path(dataroot).expanduser()
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise FileNotFoundError(f"nuScenes dataroot {str(root)!r} {what}. {HOWTO}")
    table_root = root / version
    if not table_root.is_dir():
        found = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("v1.0"))
        raise FileNotFoundError(
            f"nuScenes version folder {str(table_root)!r} does not exist (versions found in {str(root)!r}: "
            f"{found or 'none'}). {HOWTO}"
        )
    missing = [t for t in TABLES if not (table_root / f"{t}.json").is_file()]
    if missing:
        raise FileNotFoundError(
            f"nuScenes table(s) missing in {str(table_root)!r}: {', '.join(m + '.json' for m in missing)}. "
            f"The download may be incomplete. {HOWTO}"
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


def relative_filename(sd: dict) -> str:
    """sd["filename"], refused when it leaves the dataroot (absolute or through ..): files are read as dataroot/filename."""
    name = sd["filename"]
    if os.path.isabs(name) or ".." in Path(name).parts:
        raise ValueError(
            f"sample_data {sd['token']}: filename {name!r} leaves the dataroot; nuScenes filenames are "
            f"relative to the dataroot (e.g. samples/CAM_FRONT/<name>.jpg): fix this table entry, or "
            f"re-download the tables"
        )
    return name


def check_image_size(size: tuple[int, int], table_hw, path: str) -> None:
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
    as strings (NumPy would convert those silently), another length, NaN or infinity. Checked element by
    element in Python: tables hold millions of these short lists, for which NumPy's per-call cost dominates."""
    if not isinstance(value, list) or len(value) != n:
        return None
    try:
        for v in value:
            if type(v) not in _REAL or not math.isfinite(v):  # type(): true/false are not numbers here
                return None
    except OverflowError:  # an integer beyond float64
        return None
    return np.array(value, dtype=np.float64)


_REAL = (int, float)


def _record_error(table: str, token: str, problem: str) -> ValueError:
    return ValueError(f"{table} {token}: {problem}. Fix or re-export that record of {table}.json.")


def _pose_problem(rec: dict) -> str | None:
    """What makes a record's rotation (w, x, y, z) / translation unusable; None when it is fine."""
    q, t = _numbers(rec.get("rotation"), 4), _numbers(rec.get("translation"), 3)
    if q is None or float(q @ q) < 1e-12:
        return f"rotation {rec.get('rotation')!r} is not a quaternion (w, x, y, z) of non-zero, finite norm"
    if t is None:
        return f"translation {rec.get('translation')!r} is not 3 finite numbers"
    return None


def pose(nusc, table: str, token: str) -> tuple[np.ndarray, np.ndarray]:
    """(rotation matrix, translation) of a pose record (ego_pose, calibrated_sensor); a broken one is an
    error, not a skip: every sample that uses it would train on NaN geometry."""
    rec = nusc.get(table, token)
    problem = _pose_problem(rec)
    if problem:
        raise _record_error(table, token, problem)
    return quaternion_to_matrix(rec["rotation"]), np.asarray(rec["translation"], dtype=np.float64)


def intrinsics(calib: dict) -> np.ndarray:
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


def image_hw(sd: dict) -> tuple[int, int]:
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


def box_problem(ann: dict) -> str | None:
    """What makes an annotation's box unusable (then it is skipped, counted); None when it is fine."""
    size = _numbers(ann.get("size"), 3)
    if size is None or (size <= 0).any():
        return f"size {ann.get('size')!r} not 3 positive numbers"
    if (size > MAX_BOX_SIZE_M).any():
        return f"size {ann['size']!r} larger than {MAX_BOX_SIZE_M:g} m"
    return _pose_problem(ann)


def open_tables(root: Path, version: str, split: str, verbose: bool):
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
