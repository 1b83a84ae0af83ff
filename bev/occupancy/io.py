"""Occ3D-nuScenes files: ground truth `gts/<scene name>/<sample token>/labels.npz` (semantics, mask_lidar,
mask_camera, each (200, 200, 16) uint8, indexed [x, y, z] in the ego frame: bev.occupancy.grid) and
predictions in the challenge's format, `<sample token>.npz` holding one (200, 200, 16) uint8 array.

The challenge writes a prediction with `np.savez_compressed(path, pred)`, so its one array is stored under
numpy's default key "arr_0" (README "Submission format" and format_results in
projects/mmdet3d_plugin/datasets/nuscenes_occ.py of CVPR2023-3D-Occupancy-Prediction); we do the same.

Every bad file gets one OccupancyFileError naming the file, what is wrong and the fix; a missing file
gets a FileNotFoundError that says where the file was expected.
"""

from __future__ import annotations

import io
import os
import zipfile
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np

from bev.occupancy.grid import NUM_CLASSES, OCC_SHAPE
from bev.utils.io import atomic_write, safe_name

LABEL_KEYS = ("semantics", "mask_lidar", "mask_camera")
PREDICTION_KEY = "arr_0"  # np.savez's name for its first positional array, as the challenge saves it
LABELS_FIX = (
    "re-extract this file from the Occ3D-nuScenes download (gts/<scene>/<sample token>/labels.npz), "
    "or rewrite it with bev.occupancy.io.write_labels"
)
PREDICTION_FIX = "rewrite it with bev.occupancy.io.write_prediction"


class OccupancyFileError(ValueError):
    """An Occ3D labels or prediction file that cannot be used; the message names the file, the problem and the fix."""


class OccLabels(NamedTuple):
    """One sample's Occ3D ground truth, indexed [x, y, z]."""

    semantics: np.ndarray  # (200, 200, 16) uint8 class ids 0..17
    mask_lidar: np.ndarray  # (200, 200, 16) bool: observed by the (accumulated) lidar
    mask_camera: np.ndarray  # (200, 200, 16) bool: observed by the current cameras (what the metric scores)


def labels_path(root: str | os.PathLike, scene_name: str, sample_token: str) -> Path:
    """<root>/gts/<scene name>/<sample token>/labels.npz (names made safe as path components)."""
    return Path(root) / "gts" / safe_name(scene_name) / safe_name(sample_token) / "labels.npz"


def prediction_path(out_dir: str | os.PathLike, sample_token: str) -> Path:
    """<out_dir>/<sample token>.npz, the challenge's name for a prediction."""
    return Path(out_dir) / f"{safe_name(sample_token)}.npz"


# ----------------------------------------------------------------------------- checks


def check_semantics(semantics, source: str, fix: str = LABELS_FIX, name: str = "semantics") -> np.ndarray:
    """`semantics` as a (200, 200, 16) uint8 array of ids 0..17, or one OccupancyFileError about `source`."""
    a = np.asarray(semantics)
    _check_shape(a, source, name, fix)
    if a.dtype != np.uint8:
        raise OccupancyFileError(f"{source}: {name} has dtype {a.dtype}, expected uint8 class ids: {fix}")
    top = int(a.max())
    if top >= NUM_CLASSES:
        n = int(np.count_nonzero(a >= NUM_CLASSES))
        raise OccupancyFileError(
            f"{source}: {name} holds class id {top} ({n} voxels >= {NUM_CLASSES}); Occ3D ids are 0..{NUM_CLASSES - 1} "
            f"(17 = free): {fix}"
        )
    return a


def check_mask(mask, source: str, name: str, fix: str = LABELS_FIX) -> np.ndarray:
    """A (200, 200, 16) uint8 (or bool) 0/1 mask as bool, or one OccupancyFileError about `source`."""
    a = np.asarray(mask)
    _check_shape(a, source, name, fix)
    if a.dtype == np.bool_:
        return a
    if a.dtype != np.uint8:
        raise OccupancyFileError(f"{source}: {name} has dtype {a.dtype}, expected uint8 0/1: {fix}")
    if int(a.max()) > 1:
        bad = np.unique(a[a > 1])[:5].tolist()
        raise OccupancyFileError(f"{source}: {name} must hold only 0 and 1, found {bad}: {fix}")
    return a.astype(bool)


def _check_shape(a: np.ndarray, source: str, name: str, fix: str) -> None:
    if a.shape != OCC_SHAPE:
        raise OccupancyFileError(f"{source}: {name} has shape {a.shape}, expected {OCC_SHAPE} ([x, y, z]): {fix}")


# ----------------------------------------------------------------------------- reading


def _load_npz(path: Path, fix: str) -> dict[str, np.ndarray]:
    """Every array of an .npz file, read whole; one OccupancyFileError for anything but a readable npz."""
    if not path.exists():
        raise FileNotFoundError(f"no Occ3D file at {path}: {fix}")
    try:
        with open(path, "rb") as f:
            head = f.read(6)
        if head.startswith(b"\x93NUMPY"):
            raise OccupancyFileError(f"{path}: is a single .npy array, not an .npz archive of named arrays: {fix}")
        if not head.startswith(b"PK"):
            raise OccupancyFileError(f"{path}: is not an .npz file (a zip archive); it starts with {head!r}: {fix}")
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except OccupancyFileError:
        raise
    except (zipfile.BadZipFile, zlib.error, EOFError, KeyError) as e:
        raise OccupancyFileError(f"{path}: is a damaged .npz archive, truncated or corrupt ({e}): {fix}") from None
    except ValueError as e:  # object arrays need pickle, which could run code: never loaded
        raise OccupancyFileError(f"{path}: holds an array numpy cannot load without pickle ({e}): {fix}") from None
    except OSError as e:
        raise OccupancyFileError(f"{path}: cannot be read ({e.strerror or e}): {fix}") from None


def read_labels(path: str | os.PathLike) -> OccLabels:
    """One labels.npz, checked: the three arrays (200, 200, 16) uint8, ids 0..17, masks 0/1 (returned as bool)."""
    path = Path(path)
    arrays = _load_npz(path, LABELS_FIX)
    missing = [k for k in LABEL_KEYS if k not in arrays]
    if missing:
        raise OccupancyFileError(
            f"{path}: missing array(s) {missing} (has {sorted(arrays)}); an Occ3D labels.npz holds "
            f"{list(LABEL_KEYS)}: {LABELS_FIX}"
        )
    return OccLabels(
        check_semantics(arrays["semantics"], str(path)),
        check_mask(arrays["mask_lidar"], str(path), "mask_lidar"),
        check_mask(arrays["mask_camera"], str(path), "mask_camera"),
    )


def read_prediction(path: str | os.PathLike) -> np.ndarray:
    """One challenge-format prediction (one (200, 200, 16) uint8 array of ids 0..17), checked."""
    path = Path(path)
    arrays = _load_npz(path, PREDICTION_FIX)
    if len(arrays) != 1:
        raise OccupancyFileError(
            f"{path}: a prediction holds exactly one array ({PREDICTION_KEY!r}), found {sorted(arrays)}: {PREDICTION_FIX}"
        )
    return check_semantics(next(iter(arrays.values())), str(path), PREDICTION_FIX, "the prediction")


# ----------------------------------------------------------------------------- writing


def _npz_bytes(**arrays: np.ndarray) -> bytes:
    """An .npz archive (what np.savez_compressed writes: one deflated NAME.npy per array) at zlib level 1:
    occupancy volumes are mostly one value, and level 1 packs them nearly as small at a fraction of the time."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for name, a in arrays.items():
            with z.open(f"{name}.npy", "w") as f:
                np.lib.format.write_array(f, np.ascontiguousarray(a), allow_pickle=False)
    return buf.getvalue()


def write_labels(path: str | os.PathLike, semantics, mask_lidar, mask_camera) -> Path:
    """Write one labels.npz atomically (checked first: a bad array is refused, not written). Masks may be bool."""
    path = Path(path)
    src = f"labels for {path}"
    sem = check_semantics(semantics, src, "pass (200, 200, 16) uint8 ids 0..17")
    masks = {
        k: check_mask(m, src, k, "pass (200, 200, 16) bool or 0/1 uint8")
        for k, m in (("mask_lidar", mask_lidar), ("mask_camera", mask_camera))
    }
    data = _npz_bytes(semantics=sem, **{k: m.astype(np.uint8) for k, m in masks.items()})
    return atomic_write(path, data)


def write_prediction(out_dir: str | os.PathLike, sample_token: str, semantics) -> Path:
    """Write <out_dir>/<sample token>.npz in the challenge's format (one uint8 array, key "arr_0"), atomically."""
    path = prediction_path(out_dir, sample_token)
    src, fix = f"prediction for {path}", "pass (200, 200, 16) integer ids 0..17"
    a = np.asarray(semantics)
    if np.issubdtype(a.dtype, np.integer) and a.dtype != np.uint8 and a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi >= NUM_CLASSES:
            raise OccupancyFileError(f"{src}: the prediction holds class id {hi if hi >= NUM_CLASSES else lo}: {fix}")
        a = a.astype(np.uint8)  # e.g. an argmax's int64: the same ids
    sem = check_semantics(a, src, fix, "the prediction")
    return atomic_write(path, _npz_bytes(**{PREDICTION_KEY: sem}))
