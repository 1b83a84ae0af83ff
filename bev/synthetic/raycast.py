"""Numpy ray-caster of the synthetic world (bev.synthetic.world) for the six nuScenes cameras.

Every object is a union of axis-aligned boxes ("parts") in its own frame, so one camera is
rendered exactly by casting one ray per pixel: ground plane first, then a slab test per part
inside the part's projected bounding rectangle, with a z-buffer (camera depth) for occlusion
and a per-pixel instance-id buffer.

Geometry conventions (ego frame, camera->ego extrinsics, quaternions (w, x, y, z), pixel
centres) are those of bev.geometry; projection and unprojection go through its functions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import shapely
import torch

from bev.data.rig import IMAGE_H, IMAGE_W, load_rig
from bev.geometry import CAMERA_NAMES, ego_to_image, frustum_to_ego, quaternion_to_matrix
from bev.synthetic.roads import fill, road_map, stroke
from bev.synthetic.world import CABIN, GLASS, RENDER_RANGE, WINDOWS, World, visible_objects

# Cameras are ray-cast at 1/RENDER_SCALE of 1600x900 and upscaled bilinearly: the model
# sees 352x128 crops, and full-resolution casting would cost 4x the time for no gain.
RENDER_SCALE = 2
NEAR = 0.1  # metres, camera near plane for clipping projected bounding rectangles


@dataclass
class Camera:
    """A calibrated camera and its per-pixel ray directions at the render resolution."""

    name: str
    intrinsic: np.ndarray  # (3, 3), full 1600x900 image
    rotation: np.ndarray  # (3, 3) camera->ego
    translation: np.ndarray  # (3,) camera->ego
    scale: int
    post_rot: torch.Tensor  # full-resolution pixels -> render-resolution pixels
    post_tran: torch.Tensor
    rays: np.ndarray  # (H, W, 3) float32 ego-frame ray directions with unit camera depth

    @property
    def shape(self) -> tuple[int, int]:
        return self.rays.shape[:2]

    @property
    def planes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ray x, y, z components as contiguous (H, W) planes."""
        if not hasattr(self, "_planes"):
            self._planes = tuple(np.ascontiguousarray(self.rays[..., k]) for k in range(3))
        return self._planes

    @property
    def inv_planes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """1 / ray components (inf where a component is 0)."""
        if not hasattr(self, "_inv_planes"):
            with np.errstate(divide="ignore"):
                self._inv_planes = tuple(np.float32(1.0) / p for p in self.planes)
        return self._inv_planes

    @property
    def sky(self) -> np.ndarray:
        """(H, W, 3) sky colour by ray elevation (the background before ground and objects)."""
        if not hasattr(self, "_sky"):
            self._sky = _sky_colour(self.rays[..., 2] / np.linalg.norm(self.rays, axis=-1) * 3.0)
        return self._sky

    @property
    def ground(self):
        """Where rays meet the ground z = 0: depth (H, W) (inf above the horizon), mask, ego x, y, haze."""
        if not hasattr(self, "_ground"):
            C, dz = self.translation.astype(np.float32), self.rays[..., 2]
            with np.errstate(divide="ignore"):
                t = np.where(dz < -1e-6, -C[2] / dz, np.inf).astype(np.float32)
            m = np.isfinite(t)
            gx = C[0] + t[m] * self.rays[..., 0][m]
            gy = C[1] + t[m] * self.rays[..., 1][m]
            haze = np.clip((t[m] - 60.0) / 250.0, 0, 0.7)[:, None]
            self._ground = (t, m, gx, gy, haze)
        return self._ground

    def project(self, pts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Ego points (..., 3) -> render-resolution (u, v) and camera depth (bev.geometry.ego_to_image)."""
        t = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.float64)  # noqa: E731
        shape = pts.shape[:-1]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny matrices: thread start-up costs 100x the maths here
        try:
            uv, depth = ego_to_image(t(pts.reshape(-1, 3)), t(self.intrinsic), t(self.rotation), t(self.translation),
                                     self.post_rot.double(), self.post_tran.double())
        finally:
            torch.set_num_threads(threads)
        return uv.numpy().reshape(*shape, 2), depth.numpy().reshape(shape)


def downscale(scale: int) -> tuple[torch.Tensor, torch.Tensor]:
    """post_rot/post_tran of a 1/scale resize with the pixel-centre convention of bev.geometry."""
    post_rot = torch.diag(torch.tensor([1.0 / scale, 1.0 / scale, 1.0]))
    off = 0.5 / scale - 0.5  # pixel centres: u' + 0.5 = (u + 0.5) / scale
    return post_rot, torch.tensor([off, off, 0.0])


@lru_cache(maxsize=16)
def make_camera(name: str, scale: int = RENDER_SCALE) -> Camera:
    cal = load_rig()["cameras"][name]
    K = np.array(cal["camera_intrinsic"], dtype=np.float64)
    R = quaternion_to_matrix(cal["rotation"])
    t = np.array(cal["translation"], dtype=np.float64)
    if IMAGE_W % scale or IMAGE_H % scale:
        raise ValueError(f"render scale {scale} must divide {IMAGE_W}x{IMAGE_H}")
    H, W = IMAGE_H // scale, IMAGE_W // scale
    post_rot, post_tran = downscale(scale)
    # Unproject every render pixel at unit depth (bev.geometry.frustum_to_ego), minus the centre.
    v, u = torch.meshgrid(torch.arange(H, dtype=torch.float64), torch.arange(W, dtype=torch.float64), indexing="ij")
    frustum = torch.stack([u, v, torch.ones_like(u)], dim=-1)[None]  # (D=1, H, W, 3)
    d = lambda a: torch.as_tensor(a, dtype=torch.float64)[None, None]  # noqa: E731
    pts = frustum_to_ego(frustum, d(K), d(R), d(t), post_rot.double()[None, None], post_tran.double()[None, None])
    rays = (pts[0, 0, 0].numpy() - t).astype(np.float32)
    return Camera(name, K, R, t, scale, post_rot, post_tran, np.ascontiguousarray(rays))


def _hash(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cheap deterministic per-cell noise in [0, 1) for ground texture."""
    x = np.sin(a * 12.9898 + b * 78.233) * 43758.5453
    return x - np.floor(x)


# The ground is the location's map, rasterised once per process into TILE x TILE texel tiles
# (TEX_RES metres per texel) as they come into view; ground beyond TEX_RANGE is plain grass.
TEX_RES, TILE, TEX_RANGE = 0.1, 512, 110.0
# Ground classes in painting order (later ones paint over earlier ones): colour and noise amplitude.
GROUND = {"grass": ((0.25, 0.41, 0.175), (0.06, 0.06, 0.03)), "walkway": ((0.6, 0.58, 0.55), (0.06,) * 3),
          "asphalt": ((0.3, 0.3, 0.3), (0.05,) * 3), "carpark": ((0.4, 0.38, 0.42), (0.04,) * 3),
          "kerb": ((0.78, 0.78, 0.76), (0.0,) * 3), "white": ((0.9, 0.9, 0.9), (0.0,) * 3),
          "yellow": ((0.85, 0.7, 0.15), (0.0,) * 3)}
_CLASS = {name: i for i, name in enumerate(GROUND)}
_PALETTE = np.array([c for c, _ in GROUND.values()], np.float32)
_NOISE = np.array([a for _, a in GROUND.values()], np.float32)


@lru_cache(maxsize=160)
def _tile(seed: int, location: str, tx: int, ty: int) -> np.ndarray:
    """(TILE, TILE, 3) uint8 ground colours of tile (tx, ty); texel [r, c] has its centre at
    x = (tx * TILE + c + 0.5) * TEX_RES, y = (ty * TILE + r + 0.5) * TEX_RES."""
    road = road_map(seed, location)
    x0, y0, size = tx * TILE * TEX_RES, ty * TILE * TEX_RES, TILE * TEX_RES
    label = np.zeros((TILE, TILE), np.uint8)

    def to_px(xy):
        return (xy - (x0, y0)) / TEX_RES - 0.5

    def clip(geoms):
        g = shapely.clip_by_rect(np.asarray(geoms, dtype=object), x0 - 1, y0 - 1, x0 + size + 1, y0 + size + 1)
        return g[~shapely.is_empty(g)]

    def area(geoms, name):
        for g in clip(geoms):
            fill(label, g, to_px, _CLASS[name])

    def lines(geoms, width, name):
        for g in clip(geoms):
            stroke(label, g, to_px, round(width / TEX_RES), _CLASS[name])

    L, P = road.layers, road.paint
    area([r["geom"] for r in L["walkway"]], "walkway")
    area([r["geom"] for r in L["drivable_area"]], "asphalt")
    area([r["geom"] for r in L["carpark_area"]], "carpark")
    lines([P["kerb"]], 0.3, "kerb")
    lines(P["bays"], 0.12, "white")
    lines([g for g in P["white"] if g.geom_type == "LineString"] + P["dashes"], 0.15, "white")
    area([g for g in P["white"] if g.geom_type != "LineString"] + P["zebra"], "white")
    lines(P["yellow"], 0.1, "yellow")
    # Surface noise in 0.5 m cells (5 x 5 texels), a hash of the global cell index so tiles join seamlessly.
    cells = int(0.5 / TEX_RES)
    n = TILE // cells + 1
    cx, cy = tx * TILE // cells + np.arange(n), ty * TILE // cells + np.arange(n)
    noise = np.repeat(np.repeat(_hash(cx[None, :].astype(np.float64), cy[:, None].astype(np.float64)), cells, 0), cells, 1)
    noise = noise[:TILE, :TILE].astype(np.float32) - 0.5
    img = _PALETTE[label] + _NOISE[label] * noise[..., None]
    return (img * 255.0 + 0.5).clip(0, 255).astype(np.uint8)


@lru_cache(maxsize=2)
def _mosaic(seed: int, location: str, t0x: int, t0y: int, n: int) -> np.ndarray:
    """n x n tiles from (t0x, t0y) as one (n * TILE, n * TILE, 3) array (shared by the six cameras of a frame)."""
    out = np.empty((n * TILE, n * TILE, 3), np.uint8)
    for j in range(n):
        for i in range(n):
            out[j * TILE:(j + 1) * TILE, i * TILE:(i + 1) * TILE] = _tile(seed, location, t0x + i, t0y + j)
    return out


def ground_colour(seed: int, location: str, x: np.ndarray, y: np.ndarray, centre) -> np.ndarray:
    """(N, 3) float32 ground colours at global points (x, y): the map texture, plain grass beyond
    TEX_RANGE of `centre` (x, y)."""
    out = np.empty(x.shape + (3,), np.float32)
    out[...] = _PALETTE[_CLASS["grass"]]
    tile_m = TILE * TEX_RES
    t0x, t0y = int(math.floor((centre[0] - TEX_RANGE) / tile_m)), int(math.floor((centre[1] - TEX_RANGE) / tile_m))
    n = int(math.floor((centre[0] + TEX_RANGE) / tile_m)) - t0x + 1
    n = max(n, int(math.floor((centre[1] + TEX_RANGE) / tile_m)) - t0y + 1)
    col = np.floor(x * (1 / TEX_RES)).astype(np.int64) - t0x * TILE
    row = np.floor(y * (1 / TEX_RES)).astype(np.int64) - t0y * TILE
    m = (col >= 0) & (row >= 0) & (col < n * TILE) & (row < n * TILE)
    out[m] = _mosaic(seed, location, t0x, t0y, n)[row[m], col[m]] * np.float32(1 / 255)
    return out


def _sky_colour(elev: np.ndarray) -> np.ndarray:
    e = np.clip(elev, 0, 1)[..., None]
    return (np.array([0.78, 0.85, 0.92], np.float32) * (1 - e) + np.array([0.35, 0.55, 0.85], np.float32) * e)


def _object_parts_ego(world: World, t: float, obj_indices) -> tuple[list, np.ndarray, np.ndarray]:
    """Ego-frame boxes of the given objects at time t: [(obj_index, R (3,3), centre (3,), half, colours (6,3))]."""
    ego_t, ego_yaw = world.ego_pose(t)
    c, s = math.cos(ego_yaw), math.sin(ego_yaw)
    R_eg = np.array([[c, s, 0], [-s, c, 0], [0, 0, 1.0]])  # global -> ego rotation
    sun_ego = R_eg @ world.sun
    parts = []
    for i in obj_indices:
        obj = world.objects[i]
        centre, yaw = world.object_global(obj, t)
        c_ego = R_eg @ (centre - ego_t)
        a = yaw - ego_yaw
        R = np.array([[math.cos(a), -math.sin(a), 0], [math.sin(a), math.cos(a), 0], [0, 0, 1.0]])
        for pc, half, rgb, kind in obj.parts:
            # Face order: -x, +x, -y, +y, -z, +z (axis * 2 + positive side).
            normals = np.concatenate([-R.T, R.T], axis=0)[[0, 3, 1, 4, 2, 5]]
            shade = 0.45 + 0.55 * np.clip(normals @ sun_ego, 0, None)
            # Rows 0-5: paint per face; rows 6-11: glass per face (used by CABIN / WINDOWS parts).
            cols = np.concatenate([np.tile(np.asarray(rgb, np.float64), (6, 1)), np.tile(GLASS, (6, 1))])
            cols = cols * np.tile(shade, 2)[:, None]
            cols[6:] += 0.12 * np.clip(normals @ sun_ego, 0, None)[:, None]  # a glint on the glass
            parts.append((i, R, c_ego + R @ pc, half, cols.astype(np.float32), kind))
    return parts


def _part_rects(cam: Camera, parts: list) -> np.ndarray:
    """(P, 4) pixel rectangles [r0, r1, c0, c1) bounding each part's projection, clipped at the near plane."""
    if not parts:
        return np.zeros((0, 4), np.int64)
    signs = np.array([[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)], np.float64)
    corners = np.stack([c + (signs * h) @ R.T for _, R, c, h, *_ in parts])  # (P, 8, 3)
    # Camera depth is affine along an edge, so edges crossing the near plane are cut there.
    edges = np.array([(a, b) for a in range(8) for b in range(a + 1, 8) if np.sum(signs[a] != signs[b]) == 1])
    depth = (corners - cam.translation) @ cam.rotation[:, 2]
    da, db = depth[:, edges[:, 0]], depth[:, edges[:, 1]]
    with np.errstate(divide="ignore", invalid="ignore"):
        f = np.clip((NEAR - da) / (db - da), 0, 1)
    cut = corners[:, edges[:, 0]] + f[..., None] * (corners[:, edges[:, 1]] - corners[:, edges[:, 0]])
    crossing = (da - NEAR) * (db - NEAR) < 0
    pts = np.concatenate([corners, cut], axis=1)
    valid = np.concatenate([depth > NEAR, crossing], axis=1)
    uv, _ = cam.project(pts)
    H, W = cam.shape
    big = 1e9
    umin = np.where(valid, uv[..., 0], big).min(1)
    umax = np.where(valid, uv[..., 0], -big).max(1)
    vmin = np.where(valid, uv[..., 1], big).min(1)
    vmax = np.where(valid, uv[..., 1], -big).max(1)
    rects = np.stack([np.floor(vmin) - 1, np.ceil(vmax) + 2, np.floor(umin) - 1, np.ceil(umax) + 2], 1)
    rects = np.clip(np.nan_to_num(rects, nan=0.0), -1, big).astype(np.int64)
    rects[:, 0:2] = np.clip(rects[:, 0:2], 0, H)
    rects[:, 2:4] = np.clip(rects[:, 2:4], 0, W)
    rects[~valid.any(1)] = 0  # entirely behind the camera
    return rects


def _glass(face: np.ndarray, p: list, half: np.ndarray, kind: int) -> np.ndarray:
    """Which hit points (part frame) on the side faces are window glass rather than paint."""
    side = face < 4
    along = np.where(face < 2, p[1], p[0])  # horizontal coordinate on the hit face
    half_along = np.where(face < 2, half[1], half[0])
    z_ok = np.abs(p[2]) < half[2] - 0.06
    if kind == CABIN:
        return side & z_ok & (np.abs(along) < half_along - 0.14)
    mullion = (along % 1.6) < 0.16
    return side & z_ok & ~mullion & (np.abs(along) < half_along - 0.25)


class CameraRender(NamedTuple):
    """One rendered camera, all at the render resolution (1600/scale x 900/scale)."""

    image: np.ndarray  # (H, W, 3) float32 RGB in [0, 1]
    ids: np.ndarray  # (H, W) int32: object index + 1 for annotated objects, 0 for ground, sky, buildings
    depth: np.ndarray  # (H, W) float32 camera depth of the visible surface (inf for sky)
    coverage: dict  # {object index: pixels it would cover with nothing in front of it}


def render_camera(world: World, t: float, camera: str | Camera, objects: list[int] | None = None,
                  scale: int = RENDER_SCALE, parts: list | None = None) -> CameraRender:
    """Ray-cast one camera of the ego at time t (ego frame = the ego pose at t).

    Full-resolution pixel coordinates map to the render resolution with the camera's
    post_rot / post_tran (bev.synthetic.raycast.downscale), e.g. through bev.geometry.ego_to_image.
    `objects` defaults to everything within RENDER_RANGE; `parts` (from render_sample) skips
    recomputing the ego-frame boxes per camera.
    """
    cam = make_camera(camera, scale) if isinstance(camera, str) else camera
    if objects is None:
        objects = visible_objects(world, t, RENDER_RANGE)
    H, W = cam.shape
    C = cam.translation.astype(np.float32)

    # Ground plane z = 0 (fixed per camera) textured in road coordinates, sky above.
    t_ground, ground, gx, gy, haze = cam.ground
    ego_t, ego_yaw = world.ego_pose(t)
    cy, sy = math.cos(ego_yaw), math.sin(ego_yaw)
    x = ego_t[0] + cy * gx - sy * gy  # ego -> global (map) coordinates
    y = ego_t[1] + sy * gx + cy * gy
    img = cam.sky.copy()
    img[ground] = ground_colour(world.seed, world.location, x, y, ego_t) * (1 - haze) + np.array([0.72, 0.78, 0.85], np.float32) * haze
    zbuf = t_ground.copy()
    ids = np.zeros((H, W), np.int32)

    if parts is None:
        parts = _object_parts_ego(world, t, objects)
    rects = _part_rects(cam, parts)
    # Each annotated object's own coverage (ignoring everything else) lives in the union of
    # its parts' rectangles.
    boxes: dict[int, list[int]] = {}
    for (i, *_), (r0, r1, c0, c1) in zip(parts, rects):
        if r1 > r0 and c1 > c0 and world.objects[i].category:
            b = boxes.setdefault(i, [r0, r1, c0, c1])
            b[:] = [min(b[0], r0), max(b[1], r1), min(b[2], c0), max(b[3], c1)]
    own = {i: np.zeros((b[1] - b[0], b[3] - b[2]), bool) for i, b in boxes.items()}
    rx, ry, rz = cam.planes
    for (i, R, c, half, cols, kind), (r0, r1, c0, c1) in zip(parts, rects):
        if r1 <= r0 or c1 <= c0:
            continue
        # Slab test in the part frame, one axis at a time on 2-D planes (fast in numpy).
        o = (C - c) @ R
        px, py, pz = rx[r0:r1, c0:c1], ry[r0:r1, c0:c1], rz[r0:r1, c0:c1]
        tnear = tfar = None
        d_axes, lo_axes = [], []
        upright = R[2, 2] == 1.0 and R[2, 0] == R[2, 1] == 0.0  # objects only yaw: the part z axis is the ego z axis
        for k in range(3):
            if upright and k == 2:
                d, inv = pz, cam.inv_planes[2][r0:r1, c0:c1]
            else:
                if upright:
                    d = px * np.float32(R[0, k]) + py * np.float32(R[1, k])
                else:
                    d = px * np.float32(R[0, k]) + py * np.float32(R[1, k]) + pz * np.float32(R[2, k])
                with np.errstate(divide="ignore"):
                    inv = np.float32(1.0) / d
            with np.errstate(invalid="ignore"):
                t1 = (np.float32(-half[k] - o[k])) * inv
                t2 = (np.float32(half[k] - o[k])) * inv
            lo, hi = np.fmin(t1, t2), np.fmax(t1, t2)
            tnear = lo if tnear is None else np.fmax(tnear, lo)
            tfar = hi if tfar is None else np.fmin(tfar, hi)
            d_axes.append(d)
            lo_axes.append(lo)
        hit = (tnear <= tfar) & (tnear > NEAR)
        if i in own:
            b = boxes[i]
            own[i][r0 - b[0]:r1 - b[0], c0 - b[2]:c1 - b[2]] |= hit
        front = hit & (tnear < zbuf[r0:r1, c0:c1])
        if not front.any():
            continue
        # The entry face is the axis whose slab was entered last; the ray enters the + face
        # when it travels towards -axis.
        tn = tnear[front]
        face = np.zeros(tn.shape, np.int64)
        for k in range(3):
            on = lo_axes[k][front] == tn
            face[on] = 2 * k + (d_axes[k][front][on] < 0)
        if kind in (CABIN, WINDOWS):
            face = face + 6 * _glass(face, [o[k] + tn * d_axes[k][front] for k in range(3)], half, kind)
        zbuf[r0:r1, c0:c1][front] = tn
        img[r0:r1, c0:c1][front] = cols[face]
        ids[r0:r1, c0:c1][front] = i + 1 if world.objects[i].category else 0
    coverage = {i: int(np.count_nonzero(m)) for i, m in own.items()}
    return CameraRender(img, ids, zbuf, coverage)


def visibility_level(visible: int, unoccluded: int) -> str:
    """nuScenes visibility token from visible / unoccluded pixels: '1' 0-40%, '2' 40-60%, '3' 60-80%, '4' 80-100%."""
    frac = visible / unoccluded if unoccluded > 0 else 0.0
    return "1" if frac < 0.4 else "2" if frac < 0.6 else "3" if frac < 0.8 else "4"


def render_sample(world: World, t: float, scale: int = RENDER_SCALE):
    """All six cameras: ({camera: CameraRender}, {object index: (visible px, unoccluded px) summed over cameras})."""
    objects = visible_objects(world, t, RENDER_RANGE)
    parts = _object_parts_ego(world, t, objects)
    out, counts = {}, {}
    for name in CAMERA_NAMES:
        r = render_camera(world, t, name, objects, scale, parts)
        out[name] = r
        vis = np.bincount(r.ids.ravel(), minlength=len(world.objects) + 1)
        for i, n in r.coverage.items():
            v, u = counts.get(i, (0, 0))
            counts[i] = (v + int(vis[i + 1]), u + n)
    return out, counts
