"""LIDAR_TOP of the synthetic world: a spinning 32-beam LiDAR as nuScenes' (Velodyne HDL-32E), ray-cast by the
cameras' own caster (bev.synthetic.raycast) against the same ground and object parts.

- 32 beams (rings) evenly spaced from ELEVATION[0] to ELEVATION[1], ring 0 the lowest (as nuScenes' ring index:
  range-image code flips it, row = 31 - ring); AZIMUTHS steps per turn (20 Hz), column 0 along the ego's x axis.
- A beam returns the first surface it meets (ground, road paint, object parts, buildings, poles) within
  MIN_RANGE..MAX_RANGE, its range plus Gaussian noise (RANGE_NOISE), an intensity (0-255) by material and the
  ring index; nothing else. A sweep is cast at one instant (the world as at its timestamp: a motion-compensated
  sweep).
- Points are written as nuScenes' .pcd.bin: float32 (x, y, z, intensity, ring) in the LIDAR_TOP frame.
- A return within BOX_GAP of an annotated box's faces is moved 2 * BOX_GAP off it (on its side), so that every
  chain of float32 or float64 transforms (the devkit's included) counts it in or out of the box alike:
  num_lidar_pts is then exactly the devkit's points_in_box count.

The beams form a (32, AZIMUTHS) panorama "camera" (Spin) whose part rectangles are angular bounds, so the slab
tests and the z-buffer are raycast's (raycast.zbuffer: native, bev.synthetic.native, or numpy); the occupancy masks
use the same panorama.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch

from bev.geometry import quaternion_to_matrix
from bev.synthetic import native, raycast
from bev.synthetic.sensors import LIDAR_ROTATION, LIDAR_TRANSLATION
from bev.synthetic.world import CABIN, DARK, WINDOWS, World

BEAMS = 32
ELEVATION = (-30.67, 10.67)  # degrees: the lowest and the highest beam
AZIMUTHS = 1080  # steps per turn: a third of a degree (an HDL-32E at 20 Hz)
MIN_RANGE, MAX_RANGE = 1.0, 70.0  # metres: no return outside
RANGE_NOISE = 0.02  # metres, one standard deviation of a return's range
BOX_GAP = 1e-3  # metres: no return this close to an annotated box's faces (module docstring)
SWEEP_DT = 0.05  # seconds between sweeps (20 Hz)
MAX_SWEEPS = 9  # sweeps between two key frames 0.5 s apart at 20 Hz

# Intensity (0-255) by material: road paint and kerbs are bright, asphalt dark; retro-reflective cones and
# barriers brightest; tyres, shadows and signal heads (DARK parts) and glass dim.
GROUND_INTENSITY = {"grass": 20, "walkway": 25, "asphalt": 8, "carpark": 10, "kerb": 35, "white": 100, "yellow": 80}
CATEGORY_INTENSITY = {
    "": 25,  # scenery: buildings, traffic light poles
    "human.pedestrian.adult": 18,
    "movable_object.barrier": 70,
    "movable_object.trafficcone": 120,
}
PAINT_INTENSITY = 35  # vehicles' bodies
KIND_INTENSITY = {DARK: 4, CABIN: 20, WINDOWS: 12}
INTENSITY_SPREAD = 0.1  # relative, one standard deviation


@dataclass
class Spin(raycast.Camera):
    """The LiDAR's beams as a (BEAMS, AZIMUTHS) panorama of unit ego-frame rays from its mount: row = ring,
    column = azimuth step; depths along them are ranges."""

    def part_rects(self, parts: raycast.Parts) -> tuple[np.ndarray, np.ndarray]:
        """Angular rectangles [r0, r1, c0, c1) holding every beam that may meet each part, and the part of each
        (a part across azimuth 0 has two); parts beyond MAX_RANGE have none."""
        o = self.translation
        corners = parts.corners - o
        z_lo, z_hi = corners[..., 2].min(1), corners[..., 2].max(1)
        # Horizontal distance from the mount to the part's footprint: nearest (0 above or below it), farthest.
        local = np.einsum("pj,pjk->pk", o - parts.centre, parts.R)[:, :2]
        near = np.hypot(*np.clip(np.abs(local) - parts.half[:, :2], 0, None).T)
        far = np.hypot(corners[..., 0], corners[..., 1]).max(1)
        e_lo = np.arctan2(z_lo, np.where(z_lo < 0, near, far))
        e_hi = np.arctan2(z_hi, np.where(z_hi > 0, near, far))
        step_e = math.radians(ELEVATION[1] - ELEVATION[0]) / (BEAMS - 1)
        r0 = np.floor((e_lo - math.radians(ELEVATION[0])) / step_e)
        r1 = np.floor((e_hi - math.radians(ELEVATION[0])) / step_e) + 2
        # A footprint not under the mount spans less than half a turn, between its corners' azimuths.
        mid = np.arctan2(parts.centre[:, 1] - o[1], parts.centre[:, 0] - o[0])
        rel = np.angle(np.exp(1j * (np.arctan2(corners[..., 1], corners[..., 0]) - mid[:, None])))
        step_a = 2 * math.pi / AZIMUTHS
        c0 = np.floor((mid + rel.min(1)) / step_a)
        c1 = np.floor((mid + rel.max(1)) / step_a) + 2
        whole = (near == 0) | (c1 - c0 >= AZIMUTHS)
        c0, c1 = np.where(whole, 0, c0), np.where(whole, AZIMUTHS, c1)
        c1, c0 = c1 - np.floor(c0 / AZIMUTHS) * AZIMUTHS, c0 % AZIMUTHS  # 0 <= c0 < AZIMUTHS
        reach = np.hypot(near, np.clip(np.maximum(z_lo, -z_hi), 0, None))
        rows = np.clip(np.stack([r0, r1], 1), 0, BEAMS)
        keep = (rows[:, 1] > rows[:, 0]) & (reach <= MAX_RANGE)
        first = np.concatenate([rows, np.stack([c0, np.minimum(c1, AZIMUTHS)], 1)], 1)
        wrap = np.concatenate([rows, np.stack([np.zeros_like(c1), c1 - AZIMUTHS], 1)], 1)
        index = np.concatenate([np.flatnonzero(keep), np.flatnonzero(keep & (c1 > AZIMUTHS))])
        rects = np.concatenate([first[keep], wrap[keep & (c1 > AZIMUTHS)]]).astype(np.int64)
        return rects, index

    def locate(self, points: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For ego points (N, 3): the flat indices (ring * AZIMUTHS + azimuth step) of the 2 x 2 beams around each
        one's direction (N, 4), its range from the mount, and whether it lies within the fan (between the lowest
        and the highest beam)."""
        d = points.astype(np.float64) - self.translation
        rng = np.linalg.norm(d, axis=1)
        step_e = (ELEVATION[1] - ELEVATION[0]) / (BEAMS - 1)
        e = (np.degrees(np.arctan2(d[:, 2], np.hypot(d[:, 0], d[:, 1]))) - ELEVATION[0]) / step_e
        a = np.arctan2(d[:, 1], d[:, 0]) / (2 * math.pi / AZIMUTHS)
        inside = (e >= 0) & (e <= BEAMS - 1)
        ring = np.clip(np.floor(e), 0, BEAMS - 2).astype(np.int64)[:, None] + [0, 0, 1, 1]
        col = (np.floor(a).astype(np.int64)[:, None] + [0, 1, 0, 1]) % AZIMUTHS
        return ring * AZIMUTHS + col, rng, inside


def beam_directions() -> np.ndarray:
    """(BEAMS, AZIMUTHS, 3) unit ego-frame directions of the beams."""
    e = np.radians(np.linspace(ELEVATION[0], ELEVATION[1], BEAMS))[:, None]
    a = np.arange(AZIMUTHS) * (2 * math.pi / AZIMUTHS)
    return np.stack(np.broadcast_arrays(np.cos(e) * np.cos(a), np.cos(e) * np.sin(a), np.sin(e)), -1)


@lru_cache(maxsize=4)
def sensor(translation: tuple[float, float, float] = tuple(LIDAR_TRANSLATION)) -> Spin:
    """The LiDAR at `translation` (ego frame; default the LIDAR_TOP mount), built once per process."""
    rays = np.ascontiguousarray(beam_directions().astype(np.float32))
    R = quaternion_to_matrix(LIDAR_ROTATION)
    t = np.asarray(translation, np.float64)
    return Spin("LIDAR_TOP", np.eye(3), R, t, 1, torch.eye(3), torch.zeros(3), rays)


class Scan(NamedTuple):
    """One sweep's first surfaces along the beams, (BEAMS, AZIMUTHS) each, without noise."""

    depth: np.ndarray  # float32 range (m); inf where no return (sky, or nothing within MIN_RANGE..MAX_RANGE)
    part: np.ndarray  # int64 index of the part met (into the cast's parts), -1 for the ground or no return


def cast(spin: Spin, parts: raycast.Parts) -> Scan:
    """The first surface along each beam of `spin` among the ground and `parts` (ego frame)."""
    rects, index = spin.part_rects(parts)
    drawn = raycast.Parts(*(x[index] for x in parts))
    key = raycast.zbuffer(spin, drawn, rects)
    depth = raycast._key_depth(key)
    field = (key & 0xFFFFFFFF).astype(np.int64) - 1
    part = np.where(field >= 0, index[np.maximum(field, 0)], -1)
    miss = ~((depth >= MIN_RANGE) & (depth <= MAX_RANGE))
    depth[miss], part[miss] = np.inf, -1
    return Scan(depth.reshape(BEAMS, AZIMUTHS), part.reshape(BEAMS, AZIMUTHS))


class Boxes(NamedTuple):
    """Annotated objects' boxes in the ego frame."""

    obj: list[int]
    R: np.ndarray  # (B, 3, 3) box -> ego
    centre: np.ndarray  # (B, 3)
    half: np.ndarray  # (B, 3) half extents along the box's x (length), y (width), z


def annotation_boxes(world: World, t: float, annotated: list[int]) -> Boxes:
    """The boxes of the annotated objects at time t, as their sample_annotation rows give them, in the ego frame."""
    ego_t, ego_yaw = world.ego_pose(t)
    R_ge = _yaw_matrix(ego_yaw)  # ego -> global
    R, centre, half = [], [], []
    for i in annotated:
        c, yaw = world.object_pose(i, t)
        w, length, h = world.objects[i].size
        R.append(_yaw_matrix(yaw - ego_yaw))
        centre.append(R_ge.T @ (c - ego_t))
        half.append((length / 2, w / 2, h / 2))
    shape = (len(annotated), 3)
    return Boxes(
        list(annotated), np.reshape(R, (-1, 3, 3)), np.reshape(centre, shape), np.reshape(half, shape).astype(float)
    )


def _yaw_matrix(yaw: float) -> np.ndarray:
    c, s = math.cos(yaw), math.sin(yaw)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def _to_local(points: np.ndarray, centre: np.ndarray, R: np.ndarray) -> np.ndarray:
    """Rows R^T (p - c) of points (N, 3), written out elementwise: BLAS's `@` rounds differently per build and per
    row count, and the native kernels (bev.synthetic.native) repeat these exact float64 operations."""
    d = points - centre
    return np.stack([(d[:, 0] * R[0, j] + d[:, 1] * R[1, j]) + d[:, 2] * R[2, j] for j in range(3)], 1)


def _from_local(local: np.ndarray, centre: np.ndarray, R: np.ndarray) -> np.ndarray:
    """Rows c + R a of local points a (N, 3), elementwise as _to_local."""
    a = local
    return np.stack([centre[i] + ((a[:, 0] * R[i, 0] + a[:, 1] * R[i, 1]) + a[:, 2] * R[i, 2]) for i in range(3)], 1)


def _reach(boxes: Boxes, pad: float) -> np.ndarray:
    """(B,) how far from its centre each box looks for points: its half diagonal plus `pad`."""
    return np.array([float(np.linalg.norm(h)) + pad for h in boxes.half], np.float64).reshape(-1)


def _native_boxes(boxes: Boxes, pad: float) -> tuple:
    """The boxes as bev.synthetic.native's LiDAR operators take them."""
    c = np.ascontiguousarray
    return c(boxes.centre, np.float64), c(boxes.R, np.float64), c(boxes.half, np.float64), _reach(boxes, pad)


def _near_boxes(points: np.ndarray, boxes: Boxes, pad: float):
    """Per box: (its index, the points within its reach, their coordinates in the box frame)."""
    # A box looks only at the points within its reach in x. Any sort gives the same sets of points (callers use them
    # as sets), and numpy's default one is ~6x faster than kind="stable" here.
    order = np.argsort(points[:, 0])
    xs = points[order, 0]
    for b, reach in enumerate(_reach(boxes, pad).tolist()):
        cx, cy, _ = boxes.centre[b]
        near = order[np.searchsorted(xs, cx - reach) : np.searchsorted(xs, cx + reach, "right")]
        near = near[np.abs(points[near, 1] - cy) <= reach]
        yield b, near, _to_local(points[near], boxes.centre[b], boxes.R[b])


def points_in_boxes(points: np.ndarray, boxes: Boxes) -> dict[int, int]:
    """{annotated object: the ego points (N, 3) inside its box, faces included} (the devkit's points_in_box); native
    when bev.synthetic.native's LiDAR operators are active, else points_in_boxes_numpy."""
    if native.active(native.LIDAR_OPS):
        counts = native.lidar_count(np.ascontiguousarray(points, np.float64), *_native_boxes(boxes, 0.0))
        return dict(zip(boxes.obj, counts.tolist()))
    return points_in_boxes_numpy(points, boxes)


def points_in_boxes_numpy(points: np.ndarray, boxes: Boxes) -> dict[int, int]:
    """points_in_boxes in numpy (the reference)."""
    counts = {}
    for b, _, local in _near_boxes(points, boxes, 0.0):
        counts[boxes.obj[b]] = int(np.count_nonzero(np.all(np.abs(local) <= boxes.half[b], axis=1)))
    return counts


def _off_faces(points: np.ndarray, boxes: Boxes) -> np.ndarray:
    """`points` (N, 3) with every one within BOX_GAP of an annotated box's face moved to 2 * BOX_GAP off it, along
    the face's normal, on its side of the face (a few millimetres, under the range noise). Native when
    bev.synthetic.native's LiDAR operators are active (two full passes: the same points move)."""
    points = np.array(points, np.float64, order="C")
    if native.active(native.LIDAR_OPS):
        native.lidar_off_faces(points, *_native_boxes(boxes, BOX_GAP))
        return points
    moved = _off_faces_pass(points, boxes, None)
    if len(moved):  # a second pass for points moved near another box's faces (boxes millimetres apart)
        _off_faces_pass(points, boxes, moved)
    return points


def _off_faces_pass(points: np.ndarray, boxes: Boxes, moved: np.ndarray | None) -> np.ndarray:
    """One pass of _off_faces over the boxes in order, moving `points` in place; the indices it moved. As
    _near_boxes, a box looks at the points within its reach (x as at the start of the pass, y as now). In the second
    pass (`moved`: the first's) a box that no point moved so far reaches is skipped: it would see only unmoved points,
    which it saw the same in the first pass and left, so its band is empty."""
    order = np.argsort(points[:, 0])  # any sort: the points near a box are used as a set
    x0 = points[:, 0].copy()
    xs = x0[order]
    done = [] if moved is None else [moved]
    for b, reach in enumerate(_reach(boxes, BOX_GAP).tolist()):
        cx, cy, _ = boxes.centre[b]
        lo, hi = cx - reach, cx + reach
        if moved is not None:
            m = np.concatenate(done)
            if not np.any((x0[m] >= lo) & (x0[m] <= hi) & (np.abs(points[m, 1] - cy) <= reach)):
                continue
        near = order[np.searchsorted(xs, lo) : np.searchsorted(xs, hi, "right")]
        near = near[np.abs(points[near, 1] - cy) <= reach]
        local = _to_local(points[near], boxes.centre[b], boxes.R[b])
        off = np.abs(local) - boxes.half[b]  # per axis: > 0 outside that face pair
        band = np.all(off <= BOX_GAP, 1) & np.any(np.abs(off) < BOX_GAP, 1)
        if not band.any():
            continue
        a, d = local[band], off[band]
        close = np.abs(d) < BOX_GAP
        pushed = np.sign(a) * (boxes.half[b] + np.where(d >= 0, 2, -2) * BOX_GAP)
        a[close] = pushed[close]
        points[near[band]] = _from_local(a, boxes.centre[b], boxes.R[b])
        done.append(near[band])
    return np.concatenate(done) if done else np.zeros(0, np.int64)


def intensity(world: World, t: float, parts: raycast.Parts, part: np.ndarray, points: np.ndarray, rng) -> np.ndarray:
    """(N,) intensity 0-255 of returns on `part` (-1: the ground) at ego `points`, by material (module tables)."""
    spread = np.exp(INTENSITY_SPREAD * rng.standard_normal(len(part)))
    if native.active(native.LIDAR_OPS):
        return _intensity_native(world, t, parts, part, points, spread)
    base = np.empty(len(part))
    ground = part < 0
    base[ground] = _ground_intensity(world, t, points[ground])
    base[~ground] = _part_intensity(world, parts)[part[~ground]]
    return np.clip(np.rint(base * spread), 0, 255)


_GROUND_VALUES = np.array([GROUND_INTENSITY[name] for name in raycast.GROUND], float)


def _ground_intensity(world: World, t: float, points: np.ndarray) -> np.ndarray:
    """(N,) intensity of the ground's material under ego points (N, 3) before the spread (the map's texel class)."""
    ego_t, ego_yaw = world.ego_pose(t)
    M = _yaw_matrix(ego_yaw)  # ego -> global, elementwise as bev.synthetic.native's kernel
    x = (points[:, 0] * M[0, 0] + points[:, 1] * M[0, 1]) + ego_t[0]
    y = (points[:, 0] * M[1, 0] + points[:, 1] * M[1, 1]) + ego_t[1]
    return _GROUND_VALUES[raycast.ground_class(world.seed, world.location, x, y)]


def _intensity_native(world, t, parts, part, points, spread) -> np.ndarray:
    """intensity in one native pass over the map's ground classes around the ego (raycast's tile ring)."""
    ego_t, ego_yaw = world.ego_pose(t)
    M = _yaw_matrix(ego_yaw)
    t0x, t0y, n = raycast._tile_window(ego_t)
    labels = raycast._ring(world.seed, world.location, labels=True).fill(t0x, t0y, n).reshape(-1)
    pose = (ego_t[0], ego_t[1], M[0, 0], M[0, 1], M[1, 0], M[1, 1], 1 / raycast.TEX_RES)
    window = (t0x * raycast.TILE, t0y * raycast.TILE, n * raycast.TILE, raycast.RING * raycast.TILE)
    value = native.lidar_intensity(
        points, part, _part_intensity(world, parts), spread, _GROUND_VALUES, labels, *pose, *window
    )
    off = np.flatnonzero(np.isnan(value))  # ground beyond the tiles' window (none within MAX_RANGE): numpy's
    value[off] = np.clip(np.rint(_ground_intensity(world, t, points[off]) * spread[off]), 0, 255)
    return value


def _part_intensity(world: World, parts: raycast.Parts) -> np.ndarray:
    """(P,) intensity of each part's material."""
    cats = [world.objects[i].category for i in parts.obj.tolist()]
    out = np.array([CATEGORY_INTENSITY.get(c, PAINT_INTENSITY) for c in cats], float)
    for kind, value in KIND_INTENSITY.items():
        out[parts.kind == kind] = value
    return out


def point_cloud(
    world: World,
    t: float,
    scan: Scan,
    parts: raycast.Parts,
    boxes: Boxes,
    rng: np.random.Generator,
    noise: float = RANGE_NOISE,
) -> np.ndarray:
    """The returns of `scan` as a .pcd.bin cloud (N, 5) float32 (x, y, z, intensity, ring) in the LIDAR_TOP frame,
    in firing order (azimuth step by step, the 32 rings of each); `parts` are the ones `scan` was cast against."""
    return _cloud(world, t, scan, parts, boxes, rng, noise)[0]


def _cloud(world: World, t: float, scan: Scan, parts: raycast.Parts, boxes: Boxes, rng, noise: float):
    """point_cloud's cloud, and its points in the ego frame as to_ego gives them (None from the numpy path)."""
    spin = sensor()
    if native.active(native.LIDAR_OPS):
        jitter = noise * rng.standard_normal(int(np.count_nonzero(np.isfinite(scan.depth))))
        points, beams = native.lidar_returns(scan.depth, spin.rays.reshape(-1, 3), spin.translation, jitter)
        ring = beams // AZIMUTHS
    else:
        col, ring = np.nonzero(np.isfinite(scan.depth.T))
        beams = ring * AZIMUTHS + col
        dirs = spin.rays.reshape(-1, 3)[beams].astype(np.float64)
        r = scan.depth.reshape(-1)[beams] + noise * rng.standard_normal(len(beams))
        points = spin.translation + r[:, None] * dirs
    points = _off_faces(points, boxes)
    value = intensity(world, t, parts, scan.part.reshape(-1)[beams], points, rng)
    if native.active(native.LIDAR_OPS):
        return native.lidar_cloud(points, value, ring, spin.rotation, spin.translation)
    local = _to_local(points, spin.translation, spin.rotation)  # ego -> lidar
    return np.concatenate([local, value[:, None], ring[:, None]], 1).astype(np.float32), None


def to_ego(cloud: np.ndarray) -> np.ndarray:
    """The (N, 3) float64 ego-frame points of a LIDAR_TOP cloud (its float32 values, as a reader has them)."""
    spin = sensor()
    return _from_local(cloud[:, :3].astype(np.float64), spin.translation, spin.rotation)


class KeyFrame(NamedTuple):
    """A key frame's LiDAR: its cloud, the returns in each annotated box, and the noise-free scan."""

    cloud: np.ndarray  # (N, 5) float32, point_cloud
    num_points: dict[int, int]  # annotated object -> points of `cloud` in its box
    scan: Scan


def key_frame(
    world: World, t: float, annotated: list[int], rng: np.random.Generator, parts: raycast.Parts | None = None
) -> KeyFrame:
    """Cast, sample and count a key frame's LiDAR sweep; `parts`: raycast.sample_parts(world, t), if at hand."""
    if parts is None:
        parts = raycast.sample_parts(world, t)
    scan = cast(sensor(), parts)
    boxes = annotation_boxes(world, t, annotated)
    cloud, ego = _cloud(world, t, scan, parts, boxes, rng, RANGE_NOISE)
    return KeyFrame(cloud, points_in_boxes(to_ego(cloud) if ego is None else ego, boxes), scan)


def sweep(world: World, t: float, rng: np.random.Generator) -> np.ndarray:
    """The cloud of a sweep at time t between key frames (no annotations there): point_cloud of the world at t."""
    parts = raycast.sample_parts(world, t)
    return point_cloud(world, t, cast(sensor(), parts), parts, annotation_boxes(world, t, []), rng)
