"""LIDAR_TOP points of a sample for the LiDAR branch: the key frame and up to `sweeps` earlier sweeps.

    sweeps    the key frame's LIDAR_TOP sample_data, then its `prev` chain (non-key sweeps, earlier key frames), as
              the devkit's LidarPointCloud.from_file_multisweep walks it (nsweeps = sweeps + 1); the chain ends at
              the scene's start. Each cloud's points within MIN_DISTANCE of its sensor in x and y (the ego's own
              roof) are dropped, as the devkit's remove_close does.
    frame     each sweep moved from its LIDAR_TOP to the key frame's ego frame through the ego poses at the two
              timestamps: key ego <- global <- ego at the sweep <- the sweep's LIDAR_TOP (the dataset's ego frame:
              the key frame's LIDAR_TOP ego pose, bev.data.index)
    columns   POINT_COLUMNS: x, y, z (m), intensity (as in the file, 0-255 on nuScenes), time lag (s, the key
              frame's timestamp minus the sweep's: 0 for the key frame)
    item      after the item's BEV augmentation (bev.data.bev_aug: p' = A p), points outside the grid dropped, at
              most max_points kept (a random subset: per item in training, fixed per sample otherwise)

The chain of every sample of a split is walked once through the devkit's tables and cached beside the split
index (bev.data.cache). Batches (collate_points) hold one (sum M, 6) tensor, rows (batch index, POINT_COLUMNS),
and num_points (B,): the flat form is what the pillar scatter takes (bev.ops.voxel_sum reads a batch column; no
padding to the largest cloud, whose size varies by 2x with the scene), as mmdet3d's and OpenPCDet's dynamic
voxelisation do.

Bad input: a point with a NaN, infinite or absurd coordinate is dropped, counted in one warning per file; a cloud
may have no points; a file whose size is not whole points is one error naming it; a missing sweep file is
skipped with one warning (fewer sweeps); a chain whose timestamps do not decrease, or that enters another scene,
is one error naming the file, when the dataset is built.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bev.data.cache import cache_key, cache_root, read_cache, save_npz
from bev.data.depth import LIDAR_COLUMNS, MAX_LIDAR_COORD_M
from bev.data.tables import check_dataroot, open_tables, pose, relative_filename
from bev.geometry import Grid

POINT_COLUMNS = ("x", "y", "z", "intensity", "time_lag")
MIN_DISTANCE = 1.0  # metres: the devkit's from_file_multisweep default (remove_close)
MAX_SWEEPS = 30  # 1.5 s of 20 Hz sweeps: past BEVFusion's 9 (+ the key frame) and the detection rules' 0.5 s
SWEEP_INDEX_FORMAT = 1
_FIX_CHAIN = "fix the prev/next links of sample_data.json, or re-download or regenerate the set"
_warned: set[str] = set()  # files already named in a warning by this process


@dataclass(frozen=True)
class LidarOptions:
    """data.lidar: enabled (items carry "points"), sweeps (earlier sweeps per key frame, 0..MAX_SWEEPS; nuScenes'
    usual 10-sweep clouds are sweeps=9), max_points (at most this many points per item)."""

    enabled: bool = False
    sweeps: int = 0
    max_points: int = 300_000

    @classmethod
    def from_any(cls, value: Any) -> LidarOptions:
        """None (off) or a mapping of the fields; anything else is one clear error naming data.lidar."""
        if value is None or isinstance(value, cls):
            return value or cls()
        fix = f"data.lidar must be null or {{enabled: true|false, sweeps: 0..{MAX_SWEEPS}, max_points: >= 1}}"
        if not isinstance(value, Mapping) or set(value) - {"enabled", "sweeps", "max_points"}:
            raise ValueError(f"{fix}, got {value!r}")
        opts = {**cls().__dict__, **dict(value)}
        if type(opts["enabled"]).__name__ not in ("bool", "bool_"):
            raise ValueError(f"data.lidar.enabled must be true or false, got {opts['enabled']!r}")
        for name, lo, hi in (("sweeps", 0, MAX_SWEEPS), ("max_points", 1, None)):
            v = opts[name]
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo or (hi is not None and v > hi):
                bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
                raise ValueError(f"data.lidar.{name} must be a whole number {bound}, got {v!r}")
        return cls(bool(opts["enabled"]), int(opts["sweeps"]), int(opts["max_points"]))


# ---------------------------------------------------------------- the sweep index (built once, cached)


def load_sweep_index(
    dataroot: str | os.PathLike,
    version: str,
    split: str,
    sample_tokens: Sequence[str],
    sweeps: int,
    cache_dir: str | os.PathLike | None = None,
    verbose: bool = True,
) -> dict[str, np.ndarray]:
    """Each sample's key frame and earlier sweeps (module doc), in the order of sample_tokens: offsets (n + 1,),
    path (S,) bytes, time_lag (S,) float64 s, transform (S, 4, 4) float64 sweep LIDAR_TOP -> key frame ego."""
    table_root = check_dataroot(dataroot, version)
    key = cache_key(dataroot, table_root, version, split, (), (), cache_root(dataroot, cache_dir))
    key.update(kind="lidar_sweeps", lidar_format=SWEEP_INDEX_FORMAT, sweeps=int(sweeps), samples=len(sample_tokens))
    path = cache_root(dataroot, cache_dir) / f"{version}__{split}__lidar{int(sweeps)}.npz"
    cached = read_cache(path, key)
    if cached is not None and len(cached["offsets"]) == len(sample_tokens) + 1:
        return cached
    index = build_sweep_index(open_tables(Path(dataroot), version, split, verbose), sample_tokens, sweeps)
    try:
        save_npz(index, key, path)
    except OSError as e:  # a read-only dataset mount still works, without the cache
        warnings.warn(f"could not write the LiDAR sweep cache {path} ({e}); pass data.cache_dir", stacklevel=2)
    return index


def build_sweep_index(nusc, sample_tokens: Sequence[str], sweeps: int) -> dict[str, np.ndarray]:
    """load_sweep_index's arrays from the devkit's tables (`nusc`)."""
    offsets, paths, lags, transforms = [0], [], [], []
    for token in sample_tokens:
        for sd, lag, T in _chain(nusc, str(token), sweeps):
            paths.append(relative_filename(sd).encode())
            lags.append(lag)
            transforms.append(T)
        offsets.append(len(paths))
    return {
        "offsets": np.asarray(offsets, np.int64),
        "path": np.asarray(paths, dtype=bytes) if paths else np.zeros(0, "S1"),
        "time_lag": np.asarray(lags, np.float64),
        "transform": np.asarray(transforms, np.float64).reshape(-1, 4, 4),
    }


def _pose4(nusc, table: str, token: str) -> np.ndarray:
    R, t = pose(nusc, table, token)
    T = np.eye(4)
    T[:3, :3], T[:3, 3] = R, t
    return T


def _chain(nusc, sample_token: str, sweeps: int):
    """(sample_data, time lag s, (4, 4) sweep LIDAR_TOP -> key ego) of the key frame and up to `sweeps` earlier."""
    sample = nusc.get("sample", sample_token)
    ref = nusc.get("sample_data", sample["data"]["LIDAR_TOP"])
    to_key = np.linalg.inv(_pose4(nusc, "ego_pose", ref["ego_pose_token"]))
    sd = ref
    for k in range(sweeps + 1):
        if k:
            if not sd["prev"]:
                return
            sd = _checked_prev(nusc, sd, sample)
        T = (
            to_key
            @ _pose4(nusc, "ego_pose", sd["ego_pose_token"])
            @ _pose4(nusc, "calibrated_sensor", sd["calibrated_sensor_token"])
        )
        yield sd, (ref["timestamp"] - sd["timestamp"]) * 1e-6, T


def _checked_prev(nusc, sd: dict, key_sample: dict) -> dict:
    """sd's prev sample_data; one clear error if it is not earlier, or lies in another scene than the key frame."""
    prev = nusc.get("sample_data", sd["prev"])
    name = relative_filename(prev)
    scene = nusc.get("sample", prev["sample_token"])["scene_token"]
    if scene != key_sample["scene_token"]:
        raise ValueError(
            f"LiDAR sweep {name!r} (sample_data {prev['token']}) is from scene {scene}, not from scene "
            f"{key_sample['scene_token']} of key frame sample {key_sample['token']} whose prev chain reaches it: {_FIX_CHAIN}"
        )
    stamps = (prev.get("timestamp"), sd.get("timestamp"))
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in stamps) or not stamps[0] < stamps[1]:
        raise ValueError(
            f"LiDAR sweep {name!r} (sample_data {prev['token']}) is out of order: timestamp {stamps[0]!r} is not "
            f"before {stamps[1]!r} of {relative_filename(sd)!r}, which names it as prev: {_FIX_CHAIN}"
        )
    return prev


# ---------------------------------------------------------------- reading a sample's points


def read_cloud(path: str, key_frame: bool) -> np.ndarray | None:
    """(N, 5) float32 rows of a .pcd.bin (x, y, z, intensity, ring; LIDAR_TOP frame), points with a NaN, infinite or
    absurd coordinate dropped and counted once per file; None for a missing sweep (a missing key frame is an error)."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        if key_frame:
            raise FileNotFoundError(
                f"LiDAR key frame {path!r} is missing (listed in sample_data; needed by data.lidar.enabled=true): "
                "re-download the samples/LIDAR_TOP files (or regenerate the synthetic set), or set "
                "data.lidar.enabled=false"
            ) from None
        _warn_once(path, f"LiDAR sweep {path!r} is missing: its sample uses fewer sweeps (re-download the sweeps)")
        return None
    row = 4 * LIDAR_COLUMNS
    if size % row:
        raise ValueError(
            f"LiDAR file {path!r} has {size} bytes, not a whole number of {row}-byte points (float32 x, y, z, "
            "intensity, ring): it is truncated or damaged; re-download it (or regenerate the synthetic set)"
        )
    cloud = np.fromfile(path, dtype=np.float32).reshape(-1, LIDAR_COLUMNS)
    with np.errstate(invalid="ignore"):  # NaN compares False: dropped
        ok = (np.abs(cloud[:, :4]) < MAX_LIDAR_COORD_M).all(1) & np.isfinite(cloud[:, 3])
    if not ok.all():
        _warn_once(
            path,
            f"LiDAR file {path!r}: dropped {int((~ok).sum())} of {len(cloud)} points with a NaN, infinite or absurd "
            f"(>= {MAX_LIDAR_COORD_M:g}) value; the file is damaged: re-download it (or regenerate the synthetic set)",
        )
        cloud = cloud[ok]
    return cloud


def _warn_once(path: str, message: str) -> None:
    if path not in _warned:
        _warned.add(path)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def sample_points(dataroot: str, index: Mapping[str, np.ndarray], i: int) -> np.ndarray:
    """(M, 5) float32 POINT_COLUMNS of sample i (row i of load_sweep_index) in its key frame's ego frame."""
    a, b = int(index["offsets"][i]), int(index["offsets"][i + 1])
    parts = [np.zeros((0, len(POINT_COLUMNS)), np.float32)]
    for s in range(a, b):
        cloud = read_cloud(os.path.join(dataroot, index["path"][s].decode()), key_frame=s == a)
        if cloud is None:
            continue
        far = ~((np.abs(cloud[:, 0]) < MIN_DISTANCE) & (np.abs(cloud[:, 1]) < MIN_DISTANCE))
        cloud, T = cloud[far], index["transform"][s]
        out = np.empty((len(cloud), len(POINT_COLUMNS)), np.float32)
        out[:, :3] = cloud[:, :3] @ T[:3, :3].T + T[:3, 3]
        out[:, 3], out[:, 4] = cloud[:, 3], index["time_lag"][s]
        parts.append(out)
    return np.concatenate(parts)


def in_grid(points: np.ndarray, grid: Grid) -> np.ndarray:
    """Whether each point lies in the grid's cells (lo <= p < hi on x, y and z: floor binning)."""
    ok = np.ones(len(points), bool)
    for axis, (lo, hi, _) in enumerate((grid.xbound, grid.ybound, grid.zbound)):
        ok &= (points[:, axis] >= lo) & (points[:, axis] < hi)
    return ok


def item_points(
    points: np.ndarray, grid: Grid, bev_aug: np.ndarray | None, max_points: int, seed: int | None
) -> torch.Tensor:
    """A sample's points as an item holds them: moved by the BEV augmentation A (p' = A p), cut to the grid, at
    most max_points (a subset drawn from torch's generator, or from `seed` when given), in their order."""
    if bev_aug is not None:
        points = points.copy()
        points[:, :3] = points[:, :3] @ bev_aug.T
    points = points[in_grid(points, grid)]
    if len(points) > max_points:
        # NumPy's sampler: torch.randperm of 300k points took 100+ ms here. Its seed from torch's generator
        # (seeded per loader worker), so runs repeat.
        rng = np.random.default_rng(int(torch.randint(2**62, ())) if seed is None else seed)
        points = points[_subset(rng, len(points), max_points)]
    return torch.from_numpy(np.ascontiguousarray(points, np.float32))


def _subset(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """k of range(n) in order, drawn without replacement; drawing the n - k left out when that is fewer (NumPy
    draws small samples from a hash set, large ones by a whole permutation)."""
    if 2 * k <= n:
        return np.sort(rng.choice(n, k, replace=False, shuffle=False))
    keep = np.ones(n, bool)
    keep[rng.choice(n, n - k, replace=False, shuffle=False)] = False
    return np.flatnonzero(keep)


def collate_points(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """bev.data.temporal.collate, with items' "points" (M_b, 5) as one (sum M_b, 6) tensor of rows (b, x, y, z,
    intensity, time lag) and "num_points" (B,) int64 (module doc: why flat)."""
    from bev.data.temporal import collate

    if not batch or "points" not in batch[0]:
        return collate(batch)
    clouds = [b["points"] for b in batch]
    out = collate([{k: v for k, v in b.items() if k != "points"} for b in batch])
    rows = [torch.cat([torch.full((len(p), 1), float(b)), p], 1) for b, p in enumerate(clouds)]
    out["points"] = torch.cat(rows)
    out["num_points"] = torch.tensor([len(p) for p in clouds], dtype=torch.int64)
    return out


__all__ = [
    "POINT_COLUMNS",
    "LidarOptions",
    "build_sweep_index",
    "collate_points",
    "item_points",
    "load_sweep_index",
    "read_cloud",
    "sample_points",
]
