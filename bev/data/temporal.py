"""Sequence windows and FIERY-style instance / future labels (the temporal extension of bev.data).

Window: P + 1 + F consecutive key frames of one scene (P = past_frames, F = future_frames),
oldest first, the present frame at position P. Windows never cross scenes; a scene with fewer
than P + 1 + F key frames gives none. The split index (bev.data.index) already lists every
scene's key frames in time order, so windows are runs of consecutive index rows: the cached
index serves them and the devkit is never opened. With pad_past (scoring boxes: every sample of the
split needs its boxes) every key frame with F future frames is a present: past frames before the
scene's first key frame are that first frame again (BEVDet4D takes the present as its own past
when there is none), and a window is given by its start row, which may lie before the scene.

Ego motion (`future_egomotion`, as FIERY): entry t is the 4x4 transform that maps a point from
frame t's ego coordinates to frame t+1's, inv(pose_{t+1}) @ pose_t of the LIDAR_TOP ego poses,
reduced to x, y and yaw: [[cos a, -sin a, 0, x], [sin a, cos a, 0, y], [0, 0, 1, 0], [0, 0, 0, 1]]
(a = FIERY's rz = atan2(-M[0, 1], M[0, 0]); z, roll and pitch dropped); the last entry is the identity.

Labels (present frame and the F future frames, all in the present frame's grid):
- each frame's target boxes are rasterised in that frame's own yaw-only ("level") LIDAR_TOP ego
  frame with the `lss` rule (bottom corners rounded to cells, cv2.fillPoly: FIERY's labels);
  instance ids 1, 2, ... in order of first appearance over the whole window (past frames
  included, boxes in annotation order), so an object keeps its id in every frame;
- every future frame's instance map is moved into the present frame by a nearest-neighbour warp
  with the cumulative ego motion (FIERY's cumulative_warp_features_reverse);
- centerness and offset are then computed on the warped maps, in present-frame cells: centre =
  mean cell of an instance's mask, rounded (FIERY); centerness = max over instances of
  exp(-d^2 / sigma^2), sigma = 3 cells; offset = rounded centre - cell on the instance's cells;
- flow = the annotated box centre's motion t -> t+1, both centres in the present frame's level
  frame (so the ego motion is removed), in cells, on the instance's cells at t;
- offset and flow are IGNORE (255, FIERY's ignore value) off instances; flow also where the object has no
  box at t+1, and everywhere in the last frame. Channel 0 is along x (rows), 1 along y.

Differences from FIERY, on purpose:
- FIERY computes centerness, offset and flow in each frame's own axes and then moves those maps
  with the nearest warp: its vectors keep frame t's axes (not rotated by the ego yaw between t and
  the present) and its cells from outside the grid read 0. Here every vector is in the present
  frame's axes.
- FIERY's flow is the motion of the rounded mask centre (whole cells; a mask clipped by the grid's
  edge or changed by rounding moves its centre): here the annotated motion, to a fraction of a cell.
- FIERY's warp (warp_features) takes the cumulative translation (tx, ty) unrotated and with ty's
  sign flipped, so whenever the ego moves sideways between the present and a future frame (turns,
  lane changes) FIERY's future labels land 2 ty off the objects. The default warp is the exact
  transform; label_warp="fiery" reproduces FIERY's, for comparisons with its own labels.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np
import torch

from bev.data.bev_aug import warp_raster
from bev.data.maps import ego_yaw
from bev.data.rasterize import lss_fill
from bev.geometry import Grid
from bev.tasks.motion import IGNORE

CENTER_SIGMA = 3.0  # cells (FIERY)
# Beyond this many cells exp(-d^2 / sigma^2) is below float32's smallest subnormal, so a window of
# this radius gives the same float32 centerness as FIERY's whole-grid Gaussian, at a tenth of the cost.
CENTER_RADIUS = math.ceil(CENTER_SIGMA * math.sqrt(-math.log(np.finfo(np.float32).smallest_subnormal)))
LABEL_WARPS = ("exact", "fiery")


class WindowTooLongError(ValueError):
    """No scene of the split is as long as one temporal window; `window` says which (for callers' own hints)."""

    def __init__(self, past: int, future: int, longest: int):
        self.window = (
            f"a window of past_frames={past} + 1 + future_frames={future} = {past + 1 + future} key frames is longer "
            f"than every scene of the split (the longest has {longest})"
        )
        super().__init__(f"{self.window}: lower data.past_frames or data.future_frames")


def check_frames(past_frames: Any, future_frames: Any) -> tuple[int, int]:
    """(P, F) as ints; one clear error for negative or non-integer counts."""
    out = []
    for name, v in (("past_frames", past_frames), ("future_frames", future_frames)):
        try:
            n = operator.index(v)  # ints and NumPy ints, not 1.5 or "2"
        except TypeError:
            raise ValueError(f"data.{name} must be a whole number >= 0, got {v!r}") from None
        if n < 0:
            raise ValueError(f"data.{name} must be >= 0 (0 and 0 give single frames), got {n}")
        out.append(int(n))
    return out[0], out[1]


def check_label_warp(label_warp: str) -> str:
    if label_warp not in LABEL_WARPS:
        raise ValueError(f"unknown data.label_warp {label_warp!r}; choose one of {', '.join(LABEL_WARPS)}")
    return label_warp


def window_index(scenes: np.ndarray, past: int, future: int, pad_past: bool = False) -> tuple[np.ndarray, list[str]]:
    """(W,) int64 index row of the oldest frame of every window, and the scenes too short for one.

    scenes: (N,) scene name of every index row; a scene's key frames are consecutive rows in time order.
    pad_past: a window for every key frame with `future` frames after it, its start `past` rows before it even
    where that is before the scene (window_rows repeats the scene's first frame there).
    Raises ValueError when no scene is long enough for a single window.
    """
    length = past + 1 + future
    needed = 1 + future if pad_past else length
    scenes = np.asarray(scenes)
    cuts = np.flatnonzero(scenes[1:] != scenes[:-1]) + 1
    starts, short, longest = [], [], 0
    for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(scenes)]):
        longest = max(longest, b - a)
        if b - a < needed:
            short.append(str(scenes[a]))
        else:
            first = a - past if pad_past else a
            starts.extend(range(first, b - length + 1))
    if not starts:
        raise WindowTooLongError(past, future, longest)
    return np.asarray(starts, dtype=np.int64), short


def scene_first_rows(scenes: np.ndarray) -> np.ndarray:
    """(N,) int64: for every index row, the row of its scene's first key frame."""
    scenes = np.asarray(scenes)
    new = np.r_[True, scenes[1:] != scenes[:-1]] if len(scenes) else np.zeros(0, bool)
    return np.maximum.accumulate(np.where(new, np.arange(len(scenes)), 0)).astype(np.int64)


def window_rows(start: int, past: int, length: int, first_rows: np.ndarray) -> np.ndarray:
    """Index rows of the window starting at `start` (window_index), oldest first: rows before the present's
    scene are its first key frame (first_rows: scene_first_rows)."""
    rows = int(start) + np.arange(length)
    return np.maximum(rows, first_rows[int(start) + past])


def _yaw_matrix(a: float) -> np.ndarray:
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def future_egomotion(rotations: np.ndarray, translations: np.ndarray) -> np.ndarray:
    """(T, 4, 4) float32 ego motion t -> t+1 of T ego poses (ego -> global, (T, 3, 3) and (T, 3)); see module doc."""
    out = np.tile(np.eye(4), (len(rotations), 1, 1))
    for t in range(len(rotations) - 1):
        R1 = np.asarray(rotations[t + 1], dtype=np.float64)
        rot = R1.T @ rotations[t]
        shift = R1.T @ (np.asarray(translations[t], dtype=np.float64) - translations[t + 1])
        out[t, :3, :3] = _yaw_matrix(math.atan2(-rot[0, 1], rot[0, 0]))
        out[t, :2, 3] = shift[:2]
    return out.astype(np.float32)


def present_to_frames(egomotion: np.ndarray, present: int) -> np.ndarray:
    """(T - present, 3, 3) planar transforms taking present-frame (x, y, 1) to frame present + k's, k = 0, 1, ..."""
    planar = np.asarray(egomotion, dtype=np.float64)[:, [0, 1, 3]][:, :, [0, 1, 3]]
    out = [np.eye(3)]
    for t in range(present, len(planar) - 1):
        out.append(planar[t] @ out[-1])
    return np.stack(out)


def level_footprints(
    centers: np.ndarray, sizes: np.ndarray, rotations: np.ndarray, ego_rotation: np.ndarray
) -> np.ndarray:
    """(N, 4, 2) box bottom corners in the level (yaw-only) frame of an ego pose, as FIERY draws them.

    centers (N, 3), rotations (N, 3, 3) box -> ego, in the ego frame of `ego_rotation` (ego -> global);
    sizes (N, 3) nuScenes (w, l, h). The level frame shares the ego origin and heading, without roll/pitch.
    """
    sizes = np.asarray(sizes, dtype=np.float64).reshape(-1, 3)
    w, l, h = sizes[:, 0], sizes[:, 1], sizes[:, 2]
    sx, sy = np.array([1.0, -1.0, -1.0, 1.0]), np.array([1.0, 1.0, -1.0, -1.0])
    local = np.stack([sx * l[:, None] / 2, sy * w[:, None] / 2, np.repeat(-h[:, None] / 2, 4, 1)], axis=-1)
    ego = np.einsum("nij,nkj->nki", np.asarray(rotations, dtype=np.float64).reshape(-1, 3, 3), local)
    ego += np.asarray(centers, dtype=np.float64).reshape(-1, 1, 3)
    level = _yaw_matrix(ego_yaw(ego_rotation)).T @ np.asarray(ego_rotation, dtype=np.float64)
    return (ego @ level.T)[..., :2]


def frame_instances(footprints: np.ndarray, ids: np.ndarray, grid: Grid) -> np.ndarray:
    """(X, Y) int64 instance map of one frame: each footprint filled with its id by the lss rule, in order."""
    canvas = np.zeros(grid.bev_shape, dtype=np.int32)
    for poly, k in zip(footprints, ids):
        lss_fill(canvas, poly, int(k), grid)
    return canvas.astype(np.int64)


def warp_nearest(
    maps: np.ndarray, to_source: np.ndarray, grid: Grid, label_warp: str = "exact", fill: int = 0
) -> np.ndarray:
    """Resample (K, X, Y) maps drawn in K source frames onto the present frame's grid, nearest cell.

    to_source (K, 3, 3): present (x, y, 1) -> source frame (present_to_frames). A present cell takes
    the value of the source cell holding its centre's image (fill when that is off the grid).
    label_warp="fiery" samples where FIERY's warp_features does instead (see the module doc).
    """
    check_label_warp(label_warp)
    (xlo, _, xs), (ylo, _, ys) = grid.xbound, grid.ybound
    px = (xlo + (np.arange(grid.nx) + 0.5) * xs)[:, None]
    py = (ylo + (np.arange(grid.ny) + 0.5) * ys)[None, :]
    out = np.full(maps.shape, fill, dtype=maps.dtype)
    for k, A in enumerate(np.asarray(to_source, dtype=np.float64)):
        if np.array_equal(A, np.eye(3)):
            out[k] = maps[k]
            continue
        if label_warp == "fiery":
            A = _fiery_sampling(A)
        i = np.floor((A[0, 0] * px + A[0, 1] * py + (A[0, 2] - xlo)) / xs)  # the source cell, by floor
        j = np.floor((A[1, 0] * px + A[1, 1] * py + (A[1, 2] - ylo)) / ys)
        ok = (i >= 0) & (i < grid.nx) & (j >= 0) & (j < grid.ny)
        out[k][ok] = maps[k][i[ok].astype(np.intp), j[ok].astype(np.intp)]
    return out


def _fiery_sampling(present_to_source: np.ndarray) -> np.ndarray:
    """Where FIERY's warp_features samples: rotation by -a but translation (-tx, +ty), unrotated, for the
    source -> present transform (a, tx, ty) (its affine_grid theta read back in metres)."""
    M = np.linalg.inv(present_to_source)
    a = math.atan2(M[1, 0], M[0, 0])
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, s, -M[0, 2]], [-s, c, M[1, 2]], [0.0, 0.0, 1.0]])


def _centres(instance: np.ndarray, n_ids: int) -> tuple[np.ndarray, np.ndarray]:
    """(n_ids + 1, 2) mean (x, y) cell of each id's mask in one (X, Y) map, and (n_ids + 1,) its cell count."""
    flat = instance.reshape(-1)
    ii, jj = np.indices(instance.shape).reshape(2, -1)
    count = np.bincount(flat, minlength=n_ids + 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.stack([np.bincount(flat, ii, n_ids + 1), np.bincount(flat, jj, n_ids + 1)], 1) / count[:, None]
    return mean, count


def _gaussian(sigma: float) -> np.ndarray:
    """exp(-d^2 / sigma^2) on the (2R + 1, 2R + 1) integer offsets d of CENTER_RADIUS R (centres are whole cells)."""
    d = np.arange(-CENTER_RADIUS, CENTER_RADIUS + 1, dtype=np.float64)
    return np.exp(-(d[:, None] ** 2 + d[None, :] ** 2) / sigma**2)


def _centerness(centres: np.ndarray, ids: np.ndarray, shape: tuple[int, int], sigma: float) -> np.ndarray:
    """(X, Y) max over `ids` of exp(-d^2 / sigma^2) around their (integer) centres, within CENTER_RADIUS."""
    out = np.zeros(shape, dtype=np.float64)
    g, r = _gaussian(sigma), CENTER_RADIUS
    for k in ids:
        ci, cj = (int(v) for v in centres[k])
        i0, i1, j0, j1 = max(ci - r, 0), min(ci + r + 1, shape[0]), max(cj - r, 0), min(cj + r + 1, shape[1])
        if i0 < i1 and j0 < j1:
            np.maximum(
                out[i0:i1, j0:j1], g[i0 - ci + r : i1 - ci + r, j0 - cj + r : j1 - cj + r], out=out[i0:i1, j0:j1]
            )
    return out


def centre_targets(
    instance: np.ndarray, sigma: float = CENTER_SIGMA, ignore: int = IGNORE
) -> tuple[np.ndarray, np.ndarray]:
    """centerness (T, 1, X, Y) and offset (T, 2, X, Y) float32 of (T, X, Y) instance maps (module doc)."""
    T, X, Y = instance.shape
    n_ids = int(instance.max(initial=0))
    centerness = np.zeros((T, 1, X, Y), np.float32)
    offset = np.full((T, 2, X, Y), ignore, np.float32)
    cells = np.indices((X, Y)).astype(np.float64)
    for t in range(T):
        mean, count = _centres(instance[t], n_ids)
        centre = np.round(mean)  # half to even, as torch.round in FIERY
        centerness[t, 0] = _centerness(centre, np.flatnonzero(count[1:]) + 1, (X, Y), sigma)
        on = instance[t] > 0
        offset[t][:, on] = centre[instance[t][on]].T - cells[:, on]
    return centerness, offset


def flow_targets(instance: np.ndarray, centres: np.ndarray, ignore: int = IGNORE) -> np.ndarray:
    """flow (T, 2, X, Y) float32: on the cells of id k at frame t, centres[t + 1, k] - centres[t, k].

    instance (T, X, Y) maps on one grid; centres (T, K, 2) the box centres of ids 0..K-1 in that grid's
    cells, NaN where an id has no box. ignore where no instance, no box at t + 1, and in the last frame."""
    T, X, Y = instance.shape
    flow = np.full((T, 2, X, Y), ignore, np.float32)
    for t in range(T - 1):
        motion = centres[t + 1] - centres[t]
        k = instance[t]
        on = (k > 0) & np.isfinite(motion[k, 0])
        flow[t][:, on] = motion[k[on]].T
    return flow


def _frame_boxes(index: dict[str, np.ndarray], i: int, filter_invisible: bool) -> np.ndarray:
    """Index rows of sample i's target boxes (without visibility level 1 when filter_invisible)."""
    rows = np.arange(index["box_offsets"][i], index["box_offsets"][i + 1])
    return rows[index["box_visibility"][rows] != 1] if filter_invisible else rows


def _present_cells(index: dict[str, np.ndarray], rows: np.ndarray, i: int, present: int, grid: Grid) -> np.ndarray:
    """(N, 2) centres of sample i's boxes `rows` in the present level frame, in (fractional) cells from its origin."""
    world = index["box_center"][rows] @ index["ego_rotation"][i].T + index["ego_translation"][i]
    level = _yaw_matrix(ego_yaw(index["ego_rotation"][present]))[:2, :2]
    xy = (world[:, :2] - index["ego_translation"][present][:2]) @ level  # rows: level^T (p - t)
    return xy / np.array([grid.xbound[2], grid.ybound[2]])


def window_labels(
    index: dict[str, np.ndarray],
    frames: np.ndarray,
    past: int,
    grid: Grid,
    filter_invisible: bool = False,
    label_warp: str = "exact",
) -> dict[str, np.ndarray]:
    """The labels of one window (sample rows `frames`, oldest first, present at `past`) of a split index:
    future_egomotion (T, 4, 4) and instance, segmentation, centerness, offset, flow over the present and
    future frames (module doc). filter_invisible: drop boxes of visibility level 1 (FIERY's
    FILTER_INVISIBLE_VEHICLES), before ids are given."""
    frames = np.asarray(frames)
    ego = future_egomotion(index["ego_rotation"][frames], index["ego_translation"][frames])
    rows = [_frame_boxes(index, int(i), filter_invisible) for i in frames]
    ids: dict[bytes, int] = {}
    frame_ids = [
        np.asarray([ids.setdefault(tok, len(ids) + 1) for tok in index["box_instance"][r]], np.int64) for r in rows
    ]
    maps, centres = [], np.full((len(frames) - past, len(ids) + 1, 2), np.nan)
    for t, (i, r, k) in enumerate(zip(frames[past:], rows[past:], frame_ids[past:])):
        feet = level_footprints(
            index["box_center"][r], index["box_size"][r], index["box_rotation"][r], index["ego_rotation"][i]
        )
        maps.append(frame_instances(feet, k, grid))
        centres[t, k] = _present_cells(index, r, int(i), int(frames[past]), grid)
    instance = warp_nearest(np.stack(maps), present_to_frames(ego, past), grid, label_warp)
    centerness, offset = centre_targets(instance)
    return {
        "future_egomotion": ego,
        "instance": instance,
        "segmentation": (instance > 0).astype(np.int64),
        "centerness": centerness,
        "offset": offset,
        "flow": flow_targets(instance, centres),
    }


def augment_labels(labels: dict[str, np.ndarray], A: np.ndarray, grid: Grid) -> dict[str, np.ndarray]:
    """A window's labels in the BEV frame A maps to (bev.data.bev_aug): the instance maps resampled, centerness
    and offset computed again on them, flow resampled and its vectors turned by A (IGNORE kept), and the ego
    motion conjugated (A E A^-1: the motion of the augmented frames)."""
    instance = warp_raster(torch.from_numpy(labels["instance"]), A, grid).numpy()
    centerness, offset = centre_targets(instance)
    flow = warp_raster(torch.from_numpy(labels["flow"]), A, grid, fill=IGNORE).numpy()
    known = (flow != IGNORE).all(1, keepdims=True) & (instance[:, None] > 0)
    steps = np.array([grid.xbound[2], grid.ybound[2]]).reshape(1, 2, 1, 1)
    turned = np.einsum("ij,tjxy->tixy", A[:2, :2], flow * steps) / steps  # cells -> metres, turned, -> cells
    A4 = np.eye(4)
    A4[:3, :3] = A
    return {
        "future_egomotion": (A4 @ labels["future_egomotion"].astype(np.float64) @ np.linalg.inv(A4)).astype(np.float32),
        "instance": instance,
        "segmentation": (instance > 0).astype(np.int64),
        "centerness": centerness,
        "offset": offset,
        "flow": np.where(known, turned, IGNORE).astype(np.float32),
    }


def collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """torch's default_collate (B leading), except that sample_tokens stays one list of tokens per item."""
    from torch.utils.data import default_collate

    if not batch or "sample_tokens" not in batch[0]:
        return default_collate(batch)
    out = default_collate([{k: v for k, v in b.items() if k != "sample_tokens"} for b in batch])
    out["sample_tokens"] = [list(b["sample_tokens"]) for b in batch]
    return out
