"""RayIoU, the ray-based occupancy metric of SparseOcc (Liu et al., ECCV 2024; github.com/MCG-NJU/SparseOcc,
loaders/ray_metrics.py, loaders/ego_pose_dataset.py and its ray caster lib/dvr), written here from its definition
in numpy and torch (vectorised over rays; CPU or GPU).

What it scores, per sample:

- Query rays as a LiDAR would cast them: 360 azimuths (every degree) at 39 elevations: ten downward ones whose
  slopes are -1/k (k = 1..10, i.e. -45 deg to -5.7 deg: on flat ground they land k sensor heights away), then up
  in the last gap (0.63 deg) until the elevation passes 0.21 rad, the top of nuScenes's LiDAR field of view:
  14,040 directions (`lidar_directions`).
- Cast from the LiDAR origins of the present and the neighbouring key frames of the scene (`scene_origins`): the
  LIDAR_TOP position of every key frame of the scene, past and future, in the present frame's ego frame, kept
  when |x| < 39 m and |y| < 39 m; of more than 8, the 8 at np.round(np.linspace(0, n - 1, 8)) in time order
  (SparseOcc's EgoPoseDataset). So up to 8 x 14,040 rays a sample.
- Each ray walks the voxels it crosses (Amanatides & Woo's traversal, from the origin's voxel, with SparseOcc's
  tie rule) until the first occupied voxel (a class id 0..16; 17 free) or the grid's end; its depth is the
  distance from the origin to where the ray leaves that voxel, its class that voxel's class. Ground truth and
  prediction are walked along the same rays (`cast_rays`).
- Only rays whose ground-truth walk hits something count. For each class c (0..16) and threshold
  t in (1, 2, 4) m: TP = rays whose ground truth and prediction both hit class c with |depth error| < t,
  IoU = TP / (rays of ground-truth class c + rays of predicted class c - TP), summed over the split
  (`RayIoU`); a ray whose prediction hits nothing counts as predicted free (a miss). RayIoU@t = the mean over
  the classes that occur (NaN-ignoring), RayIoU = the mean of RayIoU@1, @2 and @4.

The ground truth is the whole `semantics` volume, no camera mask: the rays decide what is visible.

Differences from SparseOcc's code, none of which changes a number on Occ3D-nuScenes's files: ground-truth ids
>= 18 (e.g. 255) count as free here (SparseOcc's caster would take them as occupied; Occ3D's files hold none);
a ray that never enters the grid is dropped (SparseOcc gives it the class of voxel (0, 0, 0), free in practice,
so it is dropped there too); SparseOcc stops a walk after 1000 steps, which no ray inside a 200 x 200 x 16 grid
reaches (at most 416 voxel crossings).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bev.tasks.occupancy.grid import FREE, NUM_CLASSES, OCC3D_CLASSES, OCC_RANGE, OCC_SHAPE, VOXEL_SIZE
from bev.tasks.occupancy.metric import check_class_ids

THRESHOLDS: tuple[float, ...] = (1.0, 2.0, 4.0)  # metres of depth error
MAX_ORIGINS = 8  # origins per sample (SparseOcc's EgoPoseDataset)
ORIGIN_REACH = 39.0  # an origin is used when |x| and |y| in the present ego frame are below this (m)
DEFINITION = (
    "SparseOcc's RayIoU (bev.tasks.occupancy.rayiou): 14,040 LiDAR-like rays from the LiDAR origins of up to 8 key "
    "frames of the scene, the first occupied voxel's class and depth in truth and prediction along each, rays whose truth "
    "hits something scored; a TP when the classes match and the depth error < 1, 2, 4 m; rayiou_<t>m the mean IoU "
    "over classes 0-16, rayiou the mean of the three (fractions); rayiou_per_class: [1, 2, 4 m] per class"
)
TOP_ELEVATION = 0.21  # rad: nuScenes's LiDAR field of view reaches 0.2108 rad up
AZIMUTHS = 360


def lidar_directions() -> np.ndarray:
    """(14040, 3) float64 unit vectors in the ego frame (x forward, y left, z up): SparseOcc's query rays."""
    elevations = [-math.atan(1.0 / k) for k in range(1, 11)]
    gap = elevations[-1] - elevations[-2]
    while elevations[-1] < TOP_ELEVATION:
        elevations.append(elevations[-1] + gap)
    el = np.asarray(elevations)[:, None]
    az = np.deg2rad(np.arange(AZIMUTHS, dtype=np.float64))[None, :]
    dirs = np.stack([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el) * np.ones_like(az)], axis=-1)
    return dirs.reshape(-1, 3)


def scene_origins(
    ego_rotation: np.ndarray, ego_translation: np.ndarray, lidar_translation: np.ndarray, present: int
) -> np.ndarray:
    """(T <= 8, 3) LiDAR origins for frame `present` of a scene, in its ego frame (m).

    ego_rotation (n, 3, 3), ego_translation (n, 3): each key frame's ego -> global pose; lidar_translation (n, 3):
    LIDAR_TOP's position in each frame's ego frame; frames in time order.
    """
    R, t = np.asarray(ego_rotation, np.float64), np.asarray(ego_translation, np.float64)
    lidar = np.asarray(lidar_translation, np.float64)
    if not (R.ndim == 3 and R.shape[1:] == (3, 3) and t.shape == lidar.shape == (len(R), 3)):
        raise ValueError(
            f"scene_origins takes (n, 3, 3) rotations and (n, 3) translations, got {R.shape}, {t.shape}, {lidar.shape}"
        )
    if not 0 <= present < len(R):
        raise ValueError(f"present={present} is not a frame of this scene of {len(R)} frames")
    world = np.einsum("nij,nj->ni", R, lidar) + t  # each frame's LiDAR origin in the global frame
    origins = (world - t[present]) @ R[present]  # ... in the present ego frame: R^T (p - t)
    origins[present] = lidar[present]  # exactly, not through the round trip
    near = origins[(np.abs(origins[:, 0]) < ORIGIN_REACH) & (np.abs(origins[:, 1]) < ORIGIN_REACH)]
    if len(near) > MAX_ORIGINS:
        near = near[np.round(np.linspace(0, len(near) - 1, MAX_ORIGINS)).astype(np.int64)]
    return near


EXIT = 128  # the bit of the one-voxel border around the grid in cast_rays's code volume: the walk ends there


def cast_rays(occupied: torch.Tensor, origins, directions, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk every ray through V <= 7 volumes at once; returns the first occupied voxel of each ray in each volume.

    occupied: (V, 200, 200, 16) bool [x, y, z]; origins (T, 3) in metres and directions (R, 3), ego frame.
    Rays are every origin x every direction, n = t * R + r. Returns (V, T*R) int64 flat voxel index of the first
    occupied voxel (-1 where the ray meets none or never enters the grid) and (V, T*R) float64 depth in metres:
    the distance from the origin to where the ray leaves that voxel (inf where none).
    """
    occ = torch.as_tensor(occupied, device=device)
    if occ.dim() != 4 or tuple(occ.shape[1:]) != OCC_SHAPE or not 1 <= len(occ) < 8:
        raise ValueError(f"occupied must be (V <= 7, {', '.join(map(str, OCC_SHAPE))}) bool, got {tuple(occ.shape)}")
    dev, V = occ.device, len(occ)
    o = torch.as_tensor(np.asarray(origins, np.float64), device=dev).reshape(-1, 1, 3)
    d = torch.as_tensor(np.asarray(directions, np.float64), device=dev).reshape(1, -1, 3)
    d = d / d.norm(dim=-1, keepdim=True)
    if not (torch.isfinite(o).all() and torch.isfinite(d).all()):
        raise ValueError("ray origins and directions must be finite, and directions non-zero")
    size = torch.tensor(OCC_SHAPE, device=dev)
    # Voxel units (the voxels are cubes, so unit directions stay unit and distances scale by VOXEL_SIZE).
    u = (o - torch.tensor(OCC_RANGE[:3], dtype=torch.float64, device=dev)) / VOXEL_SIZE
    u, d = u.expand(-1, d.shape[1], 3).reshape(-1, 3), d.expand(o.shape[0], -1, 3).reshape(-1, 3)
    index = torch.full((V, len(u)), -1, dtype=torch.int64, device=dev)
    depth = torch.full((V, len(u)), math.inf, dtype=torch.float64, device=dev)

    # One uint8 per voxel of the grid padded by one voxel: bit k = occupied in volume k, EXIT on the border, so
    # a single lookup per step serves every volume and ends the walks that leave the grid.
    X, Y, Z = OCC_SHAPE
    code = torch.full((X + 2, Y + 2, Z + 2), EXIT, dtype=torch.uint8, device=dev)
    bits = (occ.bool().to(torch.uint8) << torch.arange(V, device=dev, dtype=torch.uint8).view(-1, 1, 1, 1)).sum(0)
    code[1:-1, 1:-1, 1:-1] = bits.to(torch.uint8)
    code = code.reshape(-1)
    strides = torch.tensor([(Y + 2) * (Z + 2), Z + 2, 1], device=dev)

    with _one_thread(dev):
        return _walk(code, strides, index, depth, u, d, size, V)


@contextmanager
def _one_thread(device: torch.device):
    """One intra-op thread on the CPU for the block: the walk is ~300 steps of ~25 small element-wise ops (~1e5
    rays), where threads cost more than they give (3-30x the time on the shared 2-core machine, docs/occupancy.md)."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _walk(code, strides, index, depth, u, d, size, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cast_rays's traversal: fills index (padded flat indices, then the grid's) and depth; returns them."""
    X, Y, Z = OCC_SHAPE
    with torch.no_grad():
        # Where each ray enters the grid (at 0 for an origin inside it), by slabs; rays that miss it are dropped.
        inv = 1.0 / d  # +-inf where a component is 0
        along = d != 0
        t0, t1 = (0 - u) * inv, (size - u) * inv
        lo = torch.where(along, torch.minimum(t0, t1), -math.inf).amax(1).clamp(min=0)
        hi = torch.where(along, torch.maximum(t0, t1), math.inf).amin(1)
        enters = (lo < hi) & (along | ((u >= 0) & (u < size))).all(1)
        ids = torch.nonzero(enters).squeeze(1)
        u, d, inv, lo, along = u[ids], d[ids], inv[ids], lo[ids], along[ids]
        v = torch.minimum(torch.floor(u + d * lo[:, None]).long().clamp(min=0), size - 1)
        step = torch.where(d >= 0, 1, -1)  # SparseOcc's: a zero component steps +1 (never taken: its t is inf)
        tnext = torch.where(along, (v + (step > 0).long() - u) * inv, math.inf)  # to the next boundary, per axis
        tdelta = torch.where(along, inv.abs(), math.inf)
        flat = ((v + 1) * strides).sum(1)
        tx, ty, tz = tnext.unbind(1)
        dx, dy, dz = tdelta.unbind(1)
        sx, sy, sz = (step * strides).unbind(1)
        pending = torch.full_like(flat, (1 << V) - 1, dtype=torch.uint8)
        while len(ids):
            c = code[flat]
            leave = torch.minimum(torch.minimum(tx, ty), tz)  # where the ray leaves this voxel
            new = c & pending
            r = torch.nonzero(new).squeeze(1)
            if len(r):
                for k in range(V):
                    rk = r[((new[r] >> k) & 1).bool()]
                    index[k, ids[rk]] = flat[rk]
                    depth[k, ids[rk]] = leave[rk] * VOXEL_SIZE
                pending &= ~new
            done = (pending == 0) | (c == EXIT)
            if done.all():
                break
            if int(done.sum()) * 4 > len(done):  # compact now and then; meanwhile the finished rays stand still
                keep = ~done
                ids, flat, pending = ids[keep], flat[keep], pending[keep]
                tx, ty, tz, dx, dy, dz, sx, sy, sz = (a[keep] for a in (tx, ty, tz, dx, dy, dz, sx, sy, sz))
                done = done[keep]
            # SparseOcc's tie rule: x only when strictly first, else y when strictly before z, else z.
            cx = (tx < ty) & (tx < tz)
            cy = (ty <= tx) & (ty < tz)
            cz = ~(cx | cy)
            flat = flat + torch.where(cx, sx, torch.where(cy, sy, sz)).masked_fill_(done, 0)
            tx = torch.where(cx, tx + dx, tx)
            ty = torch.where(cy, ty + dy, ty)
            tz = torch.where(cz, tz + dz, tz)
    # Padded flat indices -> the grid's.
    hit = index >= 0
    pi, rest = index // strides[0], index % strides[0]
    pj, pk = rest // strides[1], rest % strides[1]
    index = torch.where(hit, ((pi - 1) * Y + (pj - 1)) * Z + (pk - 1), -1)
    return index, depth


@dataclass(frozen=True)
class RayScores:
    """What RayIoU's counts score: per-threshold, per-class IoU (NaN where a class neither occurs nor is predicted)."""

    iou: np.ndarray  # (len(thresholds), 17) classes 0..16
    thresholds: tuple[float, ...]
    rays: int  # scored rays (those whose ground truth hits something)

    @property
    def per_threshold(self) -> list[float]:
        """RayIoU@t for each threshold: the NaN-ignoring mean over classes 0..16."""
        return [_nanmean(row) for row in self.iou]

    @property
    def rayiou(self) -> float:
        """The mean of RayIoU@t over the thresholds (SparseOcc's RayIoU)."""
        vals = [x for x in self.per_threshold if math.isfinite(x)]
        return float(np.mean(vals)) if vals else math.nan

    def as_dict(self) -> dict[str, float]:
        """rayiou and rayiou_<t>m (fractions), as bev-eval writes them to metrics.json."""
        out = {"rayiou": self.rayiou}
        out.update({f"rayiou_{_m(t)}m": v for t, v in zip(self.thresholds, self.per_threshold)})
        return out

    def per_class(self) -> dict[str, list[float | None]]:
        """{class: [IoU at each threshold]} for classes 0..16 (None where undefined)."""
        return {OCC3D_CLASSES[c]: [None if math.isnan(x) else float(x) for x in self.iou[:, c]] for c in range(FREE)}


def _nanmean(a: np.ndarray) -> float:
    a = np.asarray(a, np.float64)
    return float(np.nanmean(a)) if np.isfinite(a).any() else math.nan


def _m(t: float) -> str:
    return f"{t:g}"


class RayIoU:
    """Accumulates RayIoU's ray counts over samples (module docstring); `compute()` scores them.

    update(pred, gt, origins): one sample's (200, 200, 16) class ids (arrays or tensors) and its LiDAR origins (T, 3)
    in metres (scene_origins). `directions` defaults to SparseOcc's 14,040 (lidar_directions); `device` runs the
    walk on a GPU when given one.
    """

    def __init__(self, thresholds: Sequence[float] = THRESHOLDS, directions=None, device=None):
        self.thresholds = tuple(float(t) for t in thresholds)
        if not self.thresholds or not all(t > 0 and math.isfinite(t) for t in self.thresholds):
            raise ValueError(f"RayIoU thresholds must be positive distances in metres, got {list(thresholds)}")
        self.directions = lidar_directions() if directions is None else np.asarray(directions, np.float64)
        if self.directions.ndim != 2 or self.directions.shape[1] != 3 or not len(self.directions):
            raise ValueError(f"ray directions must be (R, 3), got {self.directions.shape}")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.reset()

    def reset(self) -> None:
        self.gt_count = np.zeros(NUM_CLASSES, np.int64)
        self.pred_count = np.zeros(NUM_CLASSES, np.int64)
        self.tp = np.zeros((len(self.thresholds), NUM_CLASSES), np.int64)
        self.samples = 0

    def update(self, pred, gt, origins) -> None:
        """Add one sample's rays to the counts."""
        pred, gt = (torch.as_tensor(np.asarray(a.cpu() if hasattr(a, "cpu") else a)) for a in (pred, gt))
        check_class_ids(pred, gt)
        if tuple(gt.shape) != OCC_SHAPE:
            raise ValueError(f"RayIoU scores one sample at a time: pass {OCC_SHAPE} arrays, got {tuple(gt.shape)}")
        origins = np.asarray(origins, np.float64).reshape(-1, 3)
        self.samples += 1
        if len(origins):
            with _one_thread(self.device):
                self._add(pred, gt, origins)

    def _add(self, pred: torch.Tensor, gt: torch.Tensor, origins: np.ndarray) -> None:
        labels = torch.stack([gt.long(), pred.long()]).to(self.device)
        occupied = (labels >= 0) & (labels < FREE)  # ids >= 18 in the truth (e.g. 255) count as free
        index, depth = cast_rays(occupied, origins, self.directions)
        scored = index[0] >= 0  # rays whose ground truth hits something
        index, depth = index[:, scored], depth[:, scored]
        cls = torch.where(index >= 0, labels.reshape(2, -1).gather(1, index.clamp(min=0)), FREE)  # none met: free
        g, p = cls
        err = (depth[1] - depth[0]).abs()  # inf where the prediction meets nothing
        self.gt_count += torch.bincount(g, minlength=NUM_CLASSES).cpu().numpy()
        self.pred_count += torch.bincount(p, minlength=NUM_CLASSES).cpu().numpy()
        same = g == p
        for j, t in enumerate(self.thresholds):
            self.tp[j] += torch.bincount(g[same & (err < t)], minlength=NUM_CLASSES).cpu().numpy()

    def compute(self) -> RayScores:
        denom = (self.gt_count + self.pred_count)[None, :] - self.tp
        with np.errstate(divide="ignore", invalid="ignore"):
            iou = np.where(denom > 0, self.tp / np.maximum(denom, 1), np.nan)[:, :FREE]
        return RayScores(iou, self.thresholds, int(self.gt_count[:FREE].sum()))


def split_origins(index: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """scene_origins of every row of a dataset index (bev.data.index: scene, timestamp, ego_rotation,
    ego_translation, lidar_translation), each scene's key frames taken in time order."""
    scenes, times = np.asarray(index["scene"]), np.asarray(index["timestamp"])
    out: list[np.ndarray] = [np.zeros((0, 3))] * len(scenes)
    for name in np.unique(scenes):
        rows = np.flatnonzero(scenes == name)
        rows = rows[np.argsort(times[rows], kind="stable")]
        poses = (index["ego_rotation"][rows], index["ego_translation"][rows], index["lidar_translation"][rows])
        for present, row in enumerate(rows):
            out[row] = scene_origins(*poses, present)
    return out


def device_for(accelerator: str) -> str:
    """Where to walk the rays for bev-eval's `accelerator`: the GPU when it may use one and there is one."""
    return "cuda" if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available() else "cpu"


def score_predictions(index: Mapping[str, np.ndarray], dataroot, pred_dir, device=None) -> RayScores:
    """RayIoU of the challenge-format predictions <pred_dir>/<sample token>.npz against the Occ3D labels
    <dataroot>/gts/<scene>/<sample token>/labels.npz, over every sample of a dataset index (bev-eval's split)."""
    from bev.tasks.occupancy.io import labels_path, prediction_path, read_labels, read_prediction

    acc = RayIoU(device=device)
    for row, origins in enumerate(split_origins(index)):
        token, scene = str(index["sample_token"][row]), str(index["scene"][row])
        gt = read_labels(labels_path(dataroot, scene, token)).semantics
        acc.update(read_prediction(prediction_path(Path(pred_dir), token)), gt, origins)
    return acc.compute()


def format_table(scores: RayScores) -> str:
    """RayIoU x 100 per class and threshold, and the means, as SparseOcc prints them."""

    def pct(x) -> str:
        return "   nan" if x is None or not math.isfinite(x) else f"{100 * x:6.2f}"

    head = "".join(f"  @{_m(t)}m".rjust(8) for t in scores.thresholds)
    lines = [f"RayIoU (x 100), SparseOcc's ray metric over {scores.rays} rays:", f"  {'class':<22}{head}"]
    for c in range(FREE):
        lines.append(f"  {OCC3D_CLASSES[c]:<22}" + "".join(f"  {pct(x)}" for x in scores.iou[:, c]))
    lines.append(f"  {'mean':<22}" + "".join(f"  {pct(x)}" for x in scores.per_threshold))
    lines.append(f"  RayIoU (mean of the {len(scores.thresholds)} thresholds) {pct(scores.rayiou).strip()}")
    return "\n".join(lines)
