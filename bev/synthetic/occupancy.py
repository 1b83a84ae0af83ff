"""Occ3D-format occupancy ground truth of the synthetic world (bev.tasks.occupancy for the format and frame).

For one sample (a world and a time) this gives `semantics`, `mask_camera` and `mask_lidar`, (200, 200, 16)
arrays indexed [x, y, z] in the ego frame of the sample (the writer's LIDAR_TOP ego pose: every sensor of a
synthetic sample shares it), and writes them as gts/<scene>/<sample token>/labels.npz.

semantics, from the world's own geometry:
- every part (box) of an object takes its object's class (its category's detection class, the devkit's
  category_to_detection_name, as bev.tasks.occupancy.grid.DETECTION_TO_OCC3D; a category without one is "others");
  scenery (buildings, traffic lights) is "manmade". A voxel takes a part's class when the part's box overlaps it (a separating-axis test
  per voxel column, the z range per part), so thin parts (a bicycle's wheels, a pole) still occupy a voxel.
- the ground (the flat world's z = 0, voxel layer GROUND_K) takes the map's surface under each column's
  centre: drivable area (roads, junctions, car parks, driveways) "driveable_surface", walkways "sidewalk",
  the rest (what the renderer paints as grass) "terrain". The world has no other_flat or vegetation.
- objects outrank scenery, which outranks the ground; everything else, below-ground voxels included, is
  "free" (as in Occ3D's files, where only surfaces carry classes and the rest is unobserved).

Masks, from the same ray-caster that renders the images (bev.synthetic.raycast), at the render scale:
- mask_camera: a voxel is observed when a camera ray ends in it (the depth buffer's hit point falls in it)
  or passes through it. "Passes through" is taken per voxel: its centre projects into a camera's render
  image and lies before the first surface along the nearest pixel's ray (voxels span >= 2 pixels everywhere
  in the grid at render scale 4), the ground excepted: a known plane, it hides nothing above it, and no
  voxel centre below it is ever passed.
- mask_lidar: the same test with LIDAR_TOP's own beams (bev.synthetic.lidar: 32 rings x 1080 azimuth steps, the
  rays its point cloud comes from, without the range noise): a voxel is observed when a beam's return lies in it,
  or when its centre lies before the returns of all four beams around it (the 2 x 2 of the neighbouring rings and
  azimuth steps), a beam without a return (nothing within 70 m) passing the whole grid. A single sweep from one
  place, not Occ3D's accumulation of a whole scene's sweeps: blind to what other positions along the drive would
  have seen.
The voxel -> pixel tables depend only on the rig, so they are computed once per process.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from bev.geometry import CAMERA_NAMES, ego_to_image
from bev.synthetic import lidar, raycast
from bev.synthetic.roads import RoadMap, fill, road_map
from bev.synthetic.world import World, visible_objects
from bev.tasks.occupancy.grid import CLASS_ID, DETECTION_TO_OCC3D, FREE, GRID_REACH, OCC_RANGE, OCC_SHAPE, VOXEL_SIZE
from bev.tasks.occupancy.grid import voxel_centres as _voxel_centres
from bev.tasks.occupancy.io import labels_path, write_labels

GROUND_K = int(math.floor((0.0 - OCC_RANGE[2]) / VOXEL_SIZE))  # the voxel layer holding the ground z = 0 (2)
GROUND_RES = 0.2  # metres per texel of the per-location ground-class raster
MAX_HALF_LENGTH = 7.0  # metres: no object reaches farther than this from its centre (trailers ~6.7)
GROUND_EPS = 1e-3  # metres: a ray ending this close to z = 0 ends on the ground
NEAR = 0.1  # metres: voxel centres closer to a camera's image plane are not projected
LIDAR_ELEVATION = lidar.ELEVATION[::-1]  # degrees: LIDAR_TOP's top and bottom beams
SCENERY = CLASS_ID["manmade"]


class OccSample(NamedTuple):
    """One sample's Occ3D ground truth, indexed [x, y, z] (ego frame)."""

    semantics: np.ndarray  # (200, 200, 16) uint8
    mask_lidar: np.ndarray  # (200, 200, 16) bool
    mask_camera: np.ndarray  # (200, 200, 16) bool


# ----------------------------------------------------------------------------- semantics


# The devkit's category_to_detection_name for the categories the synthetic world uses (importing the devkit
# costs ~1.5 s per process; a test checks this table against it).
CATEGORY_DETECTION = {
    "vehicle.car": "car",
    "vehicle.truck": "truck",
    "vehicle.construction": "construction_vehicle",
    "vehicle.bus.rigid": "bus",
    "vehicle.trailer": "trailer",
    "vehicle.motorcycle": "motorcycle",
    "vehicle.bicycle": "bicycle",
    "human.pedestrian.adult": "pedestrian",
    "movable_object.barrier": "barrier",
    "movable_object.trafficcone": "traffic_cone",
}


def object_class(category: str) -> int:
    """The Occ3D id of an object of this nuScenes category: its detection class, "others" for a category
    without one, "manmade" for scenery (category "")."""
    if not category:
        return SCENERY
    if category in CATEGORY_DETECTION:
        return DETECTION_TO_OCC3D[CATEGORY_DETECTION[category]]
    from nuscenes.eval.detection.utils import category_to_detection_name

    return DETECTION_TO_OCC3D.get(category_to_detection_name(category) or "", CLASS_ID["others"])


@lru_cache(maxsize=4)
def _ground_raster(seed: int, location: str) -> np.ndarray:
    """(rows = y, cols = x) uint8 Occ3D ground class of the location's map at GROUND_RES, from the map origin."""
    road: RoadMap = road_map(seed, location)
    w, h = (int(math.ceil(c / GROUND_RES)) for c in road.canvas)
    raster = np.full((h, w), CLASS_ID["terrain"], np.uint8)

    def to_px(xy):  # texel (c, r) has its centre at ((c + 0.5) * res, (r + 0.5) * res)
        return xy / GROUND_RES - 0.5

    # One 0/1 mask per surface (fill clears polygon holes to 0), painted in the renderer's order.
    walk = np.zeros_like(raster)
    for rec in road.layers["walkway"]:
        fill(walk, rec["geom"], to_px)
    drive = fill(np.zeros_like(raster), road.layers["drivable_area"][0]["geom"], to_px)
    raster[walk > 0] = CLASS_ID["sidewalk"]
    raster[drive > 0] = CLASS_ID["driveable_surface"]
    return raster


@lru_cache(maxsize=1)
def _column_xy() -> np.ndarray:
    """(200 * 200, 2) ego xy of the voxel column centres, row-major over [x, y]."""
    return _voxel_centres()[:, :, 0, :2].reshape(-1, 2)


def ground_classes(world: World, t: float) -> np.ndarray:
    """(200, 200) uint8 class of the ground under each voxel column's centre at time t."""
    ego_t, yaw = world.ego_pose(t)
    c, s = math.cos(yaw), math.sin(yaw)
    xy = _column_xy()
    gx = ego_t[0] + c * xy[:, 0] - s * xy[:, 1]  # ego -> global (map) frame
    gy = ego_t[1] + s * xy[:, 0] + c * xy[:, 1]
    raster = _ground_raster(world.seed, world.location)
    col, row = np.floor(gx / GROUND_RES).astype(np.int64), np.floor(gy / GROUND_RES).astype(np.int64)
    inside = (col >= 0) & (col < raster.shape[1]) & (row >= 0) & (row < raster.shape[0])
    out = np.full(len(xy), CLASS_ID["terrain"], np.uint8)  # off the map: grass, as the renderer paints it
    out[inside] = raster[row[inside], col[inside]]
    return out.reshape(OCC_SHAPE[:2])


@dataclass
class Boxes:
    """Ego-frame parts of the objects near the ego: yaw-only boxes, one row per part."""

    xy: np.ndarray  # (P, 2) centre
    yaw: np.ndarray  # (P,) heading of the part's x axis
    half: np.ndarray  # (P, 2) half extents along the part's x and y
    z: np.ndarray  # (P, 2) bottom and top
    cls: np.ndarray  # (P,) uint8 Occ3D id


def world_parts(world: World, t: float, objects: list[int] | None = None) -> raycast.Parts:
    """The ego-frame parts of `objects` (default: all that can reach into the grid) as the renderer draws them."""
    if objects is None:
        objects = visible_objects(world, t, GRID_REACH + MAX_HALF_LENGTH)
    return raycast._object_parts_ego(world, t, objects)  # the renderer's own placement: labels match the images


def part_boxes(world: World, parts: raycast.Parts) -> Boxes:
    """The parts that can reach into the grid, as yaw-only boxes with their objects' Occ3D classes."""
    near = np.flatnonzero(np.abs(parts.centre[:, :2]).max(1) < OCC_RANGE[3] + MAX_HALF_LENGTH)
    R, centre, half = parts.R[near], parts.centre[near], parts.half[near]
    cls = np.array([object_class(world.objects[i].category) for i in parts.obj[near].tolist()], np.uint8)
    z = np.stack([centre[:, 2] - half[:, 2], centre[:, 2] + half[:, 2]], 1)
    return Boxes(centre[:, :2], np.arctan2(R[:, 1, 0], R[:, 0, 0]), half[:, :2], z, cls)


def _ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For half-open integer ranges [lo, hi) per row: (row of each element, element)."""
    n = np.maximum(hi - lo, 0)
    row = np.repeat(np.arange(len(n)), n)
    return row, np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n) + lo[row]


def box_voxels(b: Boxes) -> tuple[np.ndarray, np.ndarray]:
    """Flat voxel indices ([x, y, z] row-major) that the boxes overlap, and each one's box index."""
    lo, step, half_v = np.asarray(OCC_RANGE[:2]), VOXEL_SIZE, VOXEL_SIZE / 2
    ac, as_ = np.abs(np.cos(b.yaw)), np.abs(np.sin(b.yaw))
    ext = np.stack([ac * b.half[:, 0] + as_ * b.half[:, 1], as_ * b.half[:, 0] + ac * b.half[:, 1]], 1)  # AABB
    i0 = np.clip(np.floor((b.xy - ext - lo) / step), 0, OCC_SHAPE[0]).astype(np.int64)
    i1 = np.clip(np.floor((b.xy + ext - lo) / step) + 1, 0, OCC_SHAPE[0]).astype(np.int64)
    # Candidate columns: the AABB's x range, then per column its y range.
    bx, ix = _ranges(i0[:, 0], i1[:, 0])
    col, iy = _ranges(i0[bx, 1], i1[bx, 1])
    p, ix = bx[col], ix[col]
    # Separating axes: the ego axes hold by construction; test the part's own two axes.
    dx = lo[0] + (ix + 0.5) * step - b.xy[p, 0]
    dy = lo[1] + (iy + 0.5) * step - b.xy[p, 1]
    cy, sy = np.cos(b.yaw[p]), np.sin(b.yaw[p])
    reach = half_v * (np.abs(cy) + np.abs(sy))  # the voxel's half extent along either part axis
    keep = (np.abs(dx * cy + dy * sy) < b.half[p, 0] + reach) & (np.abs(-dx * sy + dy * cy) < b.half[p, 1] + reach)
    p, ix, iy = p[keep], ix[keep], iy[keep]
    # z layers [k0, k1) that the part's height range overlaps (a hair of slack against round-off).
    kz = (b.z - OCC_RANGE[2]) / step
    k0 = np.clip(np.floor(kz[:, 0] + 1e-6), 0, OCC_SHAPE[2]).astype(np.int64)
    k1 = np.clip(np.ceil(kz[:, 1] - 1e-6), 0, OCC_SHAPE[2]).astype(np.int64)
    c, k = _ranges(k0[p], k1[p])
    return (ix[c] * OCC_SHAPE[1] + iy[c]) * OCC_SHAPE[2] + k, p[c]


def semantics(world: World, t: float, parts: raycast.Parts | None = None) -> np.ndarray:
    """(200, 200, 16) uint8 Occ3D classes of the world at time t (module docstring); `parts` as world_parts."""
    sem = np.full(OCC_SHAPE, FREE, np.uint8)
    sem[:, :, GROUND_K] = ground_classes(world, t)
    boxes = part_boxes(world, world_parts(world, t) if parts is None else parts)
    vox, part = box_voxels(boxes)
    cls = boxes.cls[part]
    flat = sem.reshape(-1)
    scenery = cls == SCENERY
    flat[vox[scenery]] = SCENERY  # then objects over scenery: the later assignment wins
    flat[vox[~scenery]] = cls[~scenery]
    return sem


# ----------------------------------------------------------------------------- masks


class ViewTable(NamedTuple):
    """The voxel centres a camera sees in its image: flat voxel index, flat pixel index, camera depth."""

    voxel: np.ndarray  # (V,) int64
    pixel: np.ndarray  # (V,) int64: the pixel nearest to the voxel centre's projection; (V, 4) the LiDAR's beams
    # around it (all four must pass the centre)
    depth: np.ndarray  # (V,) float32


_TABLES: dict[tuple, object] = {}  # per-camera tables (view_table, _exit_depth): they depend only on the rig


@lru_cache(maxsize=1)
def _centres_tensor() -> torch.Tensor:
    """(200 * 200 * 16, 3) float32 voxel centres, flat in [x, y, z] row-major order."""
    return torch.from_numpy(_voxel_centres().reshape(-1, 3).astype(np.float32))


def view_table(cam: raycast.Camera) -> ViewTable:
    """The voxel -> pixel table of a camera (cached per camera: it depends only on the rig)."""
    key = (cam.name, cam.scale, cam.shape, cam.translation.tobytes(), cam.rotation.tobytes())
    if key not in _TABLES and isinstance(cam, lidar.Spin):
        beam, rng, inside = cam.locate(_centres_tensor().numpy())
        vox = np.flatnonzero(inside & (rng > NEAR) & (_centres_tensor()[:, 2].numpy() >= 0))
        _TABLES[key] = ViewTable(vox, beam[vox], rng[vox].astype(np.float32))
    if key not in _TABLES:
        f = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.float32)  # noqa: E731
        uv, depth = ego_to_image(
            _centres_tensor(), f(cam.intrinsic), f(cam.rotation), f(cam.translation), f(cam.post_rot), f(cam.post_tran)
        )
        uv, depth = uv.numpy(), depth.numpy()
        H, W = cam.shape
        u, v = uv[:, 0], uv[:, 1]  # pixel centres are at integer coordinates: the image spans [-0.5, W - 0.5)
        in_image = (u >= -0.5) & (u < W - 0.5) & (v >= -0.5) & (v < H - 0.5)
        # No ray passes below the ground (the ground layer's centres lie on it).
        vox = np.flatnonzero((depth > NEAR) & in_image & (_centres_tensor()[:, 2].numpy() >= 0))
        col = np.rint(u[vox]).astype(np.int64)  # the nearest pixel's ray stands for the one through the centre
        row = np.rint(v[vox]).astype(np.int64)
        _TABLES[key] = ViewTable(vox, row * W + col, depth[vox])
    return _TABLES[key]


def _exit_depth(cam: raycast.Camera) -> np.ndarray:
    """(H * W,) float32 camera depth at which each ray leaves the grid's box (0 for rays that miss it)."""
    key = ("exit", cam.name, cam.scale, cam.shape, cam.translation.tobytes(), cam.rotation.tobytes())
    if key not in _TABLES:
        rays = cam.rays.reshape(-1, 3).astype(np.float64)
        lo, hi = np.asarray(OCC_RANGE[:3]), np.asarray(OCC_RANGE[3:])
        with np.errstate(divide="ignore", invalid="ignore"):
            t1, t2 = (lo - cam.translation) / rays, (hi - cam.translation) / rays
        t_in = np.nanmax(np.minimum(t1, t2), axis=1)
        t_out = np.nanmin(np.maximum(t1, t2), axis=1)
        _TABLES[key] = np.where(t_out > np.maximum(t_in, 0), t_out, 0).astype(np.float32)
    return _TABLES[key]


def _ray_ends(cam: raycast.Camera, z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rays (flat pixel indices) of depths `z` (H * W,) that end inside the grid, the flat voxel each ends
    in, and whether it ends on the ground."""
    q = np.flatnonzero(z < _exit_depth(cam))  # sky and surfaces beyond the grid are left out
    hit = [cam.translation[a] + z[q] * cam.planes[a].reshape(-1)[q] for a in range(3)]
    flat = 0
    for a in range(3):
        k = np.floor((hit[a] - OCC_RANGE[a]) / VOXEL_SIZE).astype(np.int64)
        flat = flat * OCC_SHAPE[a] + np.clip(k, 0, OCC_SHAPE[a] - 1)  # clip: round-off at the grid's faces
    return q, flat, np.abs(hit[2]) < GROUND_EPS


def observed(cams: list[raycast.Camera], depths: list[np.ndarray]) -> np.ndarray:
    """(200, 200, 16) bool: voxels a ray of these cameras (render-resolution depth buffers) passes or ends in."""
    seen = np.zeros(math.prod(OCC_SHAPE), bool)
    for cam, depth in zip(cams, depths):
        z = depth.reshape(-1)
        q, ends, on_ground = _ray_ends(cam, z)
        seen[ends] = True
        # Passes through: the voxel centre lies before the first surface along its pixel's ray (for the LiDAR, along
        # each of the four beams around it: they are sparser than voxels far out). The ground is
        # left out of the occluders: it hides nothing above it (the view tables hold no centre below it), and
        # where one pixel row spans more ground than a voxel (near the horizon, or between the lidar's beams)
        # the nearest ray's ground depth would drop about half of the ground layer's voxels at random.
        occluder = z.copy()
        occluder[q[on_ground]] = np.inf
        tbl = view_table(cam)
        reach = occluder[tbl.pixel]
        seen[tbl.voxel[tbl.depth <= (reach.min(1) if reach.ndim == 2 else reach)]] = True
    return seen.reshape(OCC_SHAPE)


def prepare(scale: int = raycast.RENDER_SCALE) -> None:
    """Build the per-process tables (cameras at `scale`, the lidar's views) now, e.g. before forking workers."""
    cams = [raycast.make_camera(name, scale) for name in CAMERA_NAMES] + [lidar.sensor()]
    for cam in cams:
        view_table(cam)
        _exit_depth(cam)


def occupancy_sample(
    world: World,
    t: float,
    renders: dict | None = None,
    scale: int = raycast.RENDER_SCALE,
    parts: raycast.Parts | None = None,
    lidar_scan: lidar.Scan | None = None,
) -> OccSample:
    """Semantics and both masks of the world at time t. `renders` ({camera: CameraRender}, as
    raycast.render_sample returns them at `scale`, or {camera: its (H, W) depth buffer}) saves re-rendering the
    six cameras; without it only their depths are cast (raycast.render_depth: the same values, no colours).
    `parts` (the ego-frame parts the renders drew, raycast.sample_parts) saves placing the objects again, and
    `lidar_scan` (bev.synthetic.lidar.cast of the sample's LIDAR_TOP against them) casting the beams again."""
    cams = [raycast.make_camera(name, scale) for name in CAMERA_NAMES]
    if renders is None:
        drawn = raycast.sample_parts(world, t) if parts is None else parts
        renders = {cam.name: raycast.render_depth(world, t, cam, parts=drawn) for cam in cams}
    depths = [getattr(renders[name], "depth", renders[name]) for name in CAMERA_NAMES]
    mask_camera = observed(cams, depths)
    # Only what reaches into the grid: a ray from inside the grid to a voxel never leaves it.
    objects = visible_objects(world, t, GRID_REACH + MAX_HALF_LENGTH)
    if parts is None:
        parts = world_parts(world, t, objects)  # once for the lidar and the semantics
    else:  # the drawn parts of these objects: the same rows, in the same order
        parts = raycast.Parts(*(x[np.isin(parts.obj, objects)] for x in parts))
    if lidar_scan is None:  # the parts beyond the grid change no beam's answer inside it
        lidar_scan = lidar.cast(lidar.sensor(), parts)
    mask_lidar = observed([lidar.sensor()], [lidar_scan.depth])
    return OccSample(semantics(world, t, parts), mask_lidar, mask_camera)


def write_sample_occupancy(
    out_root: str | os.PathLike,
    scene_name: str,
    sample_token: str,
    world: World,
    t: float,
    renders: dict | None = None,
    scale: int = raycast.RENDER_SCALE,
    parts: raycast.Parts | None = None,
    lidar_scan: lidar.Scan | None = None,
) -> Path:
    """Label one sample (occupancy_sample) and write <out_root>/gts/<scene name>/<sample token>/labels.npz."""
    occ = occupancy_sample(world, t, renders, scale, parts, lidar_scan)
    return write_labels(labels_path(out_root, scene_name, sample_token), occ.semantics, occ.mask_lidar, occ.mask_camera)
