"""Numpy ray-caster of the synthetic world (bev.synthetic.world) for the six nuScenes cameras.

Every object is a union of axis-aligned boxes ("parts") in its own frame, so one camera is
rendered exactly by casting one ray per pixel: ground plane first, then a slab test per part
inside the part's projected bounding rectangle, with a z-buffer (camera depth) for occlusion
and a per-pixel instance-id buffer. The slab tests of all (part, pixel) pairs run as a few long
numpy passes and the z-buffer is one scatter-min (a part-by-part loop costs ~40 numpy calls per
part, most of them on a few hundred pixels).

The slab tests, the z-buffer, the winners' entry faces, the objects' coverage and the parts' pixels (colours,
glass, depth, ids) run natively when bev.ops._C has the ray caster (bev.synthetic.native: C++, the same float
operations, the same keys and pixels bit for bit); this module's numpy code (_slab, zbuffer_numpy, _front, _coverage,
_colours) is the reference the native caster is tested against, and the fallback without the extension. So are the
parts' pixel rectangles (_part_rects_numpy; native float64 sums, equal today, within a pixel by design) and the
ground's texture and haze (_ground_render). The tiles' rasterising (_Ring) and the parts' placement are numpy.

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
from bev.synthetic import native
from bev.synthetic.roads import RoadMap, fill, road_map, stroke
from bev.synthetic.world import CABIN, GLASS, RENDER_RANGE, WINDOWS, World, visible_objects

# Cameras are ray-cast at 1/RENDER_SCALE of 1600x900 and upscaled bilinearly: the model
# sees 352x128 crops, and full-resolution casting would cost 4x the time for no gain.
RENDER_SCALE = 2
NEAR = 0.1  # metres, camera near plane for clipping projected bounding rectangles
HAZE = np.array([0.72, 0.78, 0.85], np.float32)  # colour distant ground fades to


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
    def planes(self) -> np.ndarray:
        """(3, H, W) ray x, y, z components as contiguous planes."""
        if not hasattr(self, "_planes"):
            self._planes = np.ascontiguousarray(np.moveaxis(self.rays, -1, 0))
        return self._planes

    @property
    def ground_key(self) -> np.ndarray:
        """(H * W,) z-buffer keys (_slab_chunk) of the ground: depth bits, part field 0."""
        if not hasattr(self, "_ground_key"):
            self._ground_key = (self.ground[0].view(np.int32).astype(np.int64) << 32).ravel()
        return self._ground_key

    @property
    def sky(self) -> np.ndarray:
        """(H, W, 3) sky colour by ray elevation (the background before ground and objects)."""
        if not hasattr(self, "_sky"):
            self._sky = _sky_colour(self.rays[..., 2] / np.linalg.norm(self.rays, axis=-1) * 3.0)
        return self._sky

    @property
    def ground(self):
        """Rays that meet the ground z = 0: depth (H, W) (inf above the horizon); the runs [start, stop)
        of flat pixel indices they fill (a few: the ground is a half-plane) and their ego x, y; the
        haze of the first ones, up to the last with any (the far ground): 1 - haze, haze colour * haze."""
        if not hasattr(self, "_ground"):
            C, dz = self.translation.astype(np.float32), self.rays[..., 2]
            with np.errstate(divide="ignore"):
                t = np.where(dz < -1e-6, -C[2] / dz, np.inf).astype(np.float32)
            m = np.isfinite(t)
            gx = C[0] + t[m] * self.rays[..., 0][m]
            gy = C[1] + t[m] * self.rays[..., 1][m]
            haze = np.clip((t[m] - 60.0) / 250.0, 0, 0.7)[:, None]
            haze = haze[: np.flatnonzero(haze)[-1] + 1] if haze.any() else haze[:0]
            edges = np.flatnonzero(np.diff(np.concatenate([[False], m.ravel(), [False]])))
            self._ground = (t, edges.reshape(-1, 2).tolist(), gx, gy, 1 - haze, HAZE * haze)
        return self._ground

    @property
    def ground_pixels(self) -> np.ndarray:
        """(N,) int64 flat indices of the rays that meet the ground, in order (ground's runs)."""
        if not hasattr(self, "_ground_pixels"):
            runs = self.ground[1]
            self._ground_pixels = np.concatenate([np.arange(a, b) for a, b in runs] + [np.zeros(0, np.int64)])
        return self._ground_pixels

    def project(self, pts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Ego points (..., 3) -> render-resolution (u, v) and camera depth (bev.geometry.ego_to_image)."""
        t = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.float64)  # noqa: E731
        shape = pts.shape[:-1]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny matrices: thread start-up costs 100x the maths here
        try:
            uv, depth = ego_to_image(
                t(pts.reshape(-1, 3)),
                t(self.intrinsic),
                t(self.rotation),
                t(self.translation),
                self.post_rot.double(),
                self.post_tran.double(),
            )
        finally:
            torch.set_num_threads(threads)
        return uv.numpy().reshape(*shape, 2), depth.numpy().reshape(shape)

    def project_uv(self, pts: np.ndarray) -> np.ndarray:
        """project's (u, v) in numpy: the same maths without torch's per-call cost (tiny arrays, one per camera
        and frame); within round-off of project, which is all the renderer's padded part rectangles need."""
        if not hasattr(self, "_uv_maps"):
            post = self.post_rot.double().numpy()
            self._uv_maps = (self.rotation, self.intrinsic.T, post.T, self.post_tran.double().numpy())
        R, KT, postT, post_t = self._uv_maps
        cam = (pts - self.translation) @ R  # rows: R^T (p - t)
        pix = cam @ KT
        depth = cam[..., 2]
        uvd = np.stack([pix[..., 0] / depth, pix[..., 1] / depth, depth], axis=-1)
        return (uvd @ postT + post_t)[..., :2]


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
GROUND = {
    "grass": ((0.25, 0.41, 0.175), (0.06, 0.06, 0.03)),
    "walkway": ((0.6, 0.58, 0.55), (0.06,) * 3),
    "asphalt": ((0.3, 0.3, 0.3), (0.05,) * 3),
    "carpark": ((0.4, 0.38, 0.42), (0.04,) * 3),
    "kerb": ((0.78, 0.78, 0.76), (0.0,) * 3),
    "white": ((0.9, 0.9, 0.9), (0.0,) * 3),
    "yellow": ((0.85, 0.7, 0.15), (0.0,) * 3),
}
_CLASS = {name: i for i, name in enumerate(GROUND)}
_PALETTE = np.array([c for c, _ in GROUND.values()], np.float32)
_NOISE = np.array([a for _, a in GROUND.values()], np.float32)


@lru_cache(maxsize=160)
def _tile(seed: int, location: str, tx: int, ty: int) -> np.ndarray:
    """(TILE, TILE, 3) uint8 ground colours of tile (tx, ty); texel [r, c] has its centre at
    x = (tx * TILE + c + 0.5) * TEX_RES, y = (ty * TILE + r + 0.5) * TEX_RES."""
    return _textured(_labels(seed, location, tx, ty), tx, ty)


@lru_cache(maxsize=160)
def _labels(seed: int, location: str, tx: int, ty: int) -> np.ndarray:
    """_tile_labels of tile (tx, ty), kept for the LiDAR's materials (bev.synthetic.lidar)."""
    return _tile_labels(road_map(seed, location), tx, ty)


def ground_class(seed: int, location: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(N,) uint8 ground class (GROUND's order) of the map texel under each global point (x, y), as painted."""
    col, row = np.floor(x * (1 / TEX_RES)).astype(np.int64), np.floor(y * (1 / TEX_RES)).astype(np.int64)
    tx, ty = col // TILE, row // TILE
    out = np.empty(len(col), np.uint8)
    if not len(col):
        return out
    # One flat index per tile over the few tiles' bounding range (np.unique(axis=0) of the pairs costs ~30x more).
    x0, y0 = int(tx.min()), int(ty.min())
    span = int(ty.max()) - y0 + 1
    which = (tx - x0) * span + (ty - y0)
    for k in np.flatnonzero(np.bincount(which)).tolist():
        a, b = x0 + k // span, y0 + k % span
        q = np.flatnonzero(which == k)
        out[q] = _labels(seed, location, a, b)[row[q] - b * TILE, col[q] - a * TILE]
    return out


def _tile_labels(road: RoadMap, tx: int, ty: int) -> np.ndarray:
    """(TILE, TILE) uint8 ground class (_CLASS) of every texel of tile (tx, ty): the map's surfaces and paint."""
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
    return label


def _textured(label: np.ndarray, tx: int, ty: int) -> np.ndarray:
    """(TILE, TILE, 3) uint8 colours of tile (tx, ty)'s texel classes: each class's colour plus surface noise."""
    # Surface noise in 0.5 m cells (5 x 5 texels), a hash of the global cell index so tiles join seamlessly.
    # Colours are computed once per (cell, class) and looked up per texel.
    cells = int(0.5 / TEX_RES)
    n = TILE // cells + 1
    cx, cy = tx * TILE // cells + np.arange(n), ty * TILE // cells + np.arange(n)
    noise = _hash(cx[None, :].astype(np.float64), cy[:, None].astype(np.float64)).astype(np.float32) - 0.5
    colours = _PALETTE + _NOISE * noise.reshape(-1, 1, 1)  # (cells, classes, 3)
    colours = (colours * 255.0 + 0.5).clip(0, 255).astype(np.uint8).reshape(-1, 3)
    cell = (np.arange(TILE) // cells)[:, None] * n + np.arange(TILE) // cells
    return colours.take(cell * len(GROUND) + label, axis=0)


class _Ring:
    """The tiles around the ego in one array, tile (tx, ty) in slot (tx % RING, ty % RING): as the ego drives on,
    only the tiles that come into view are copied in (a mosaic rebuilt for every new window copies them all)."""

    def __init__(self, seed: int, location: str, tile=None):
        self.key, self.tile = (seed, location), _tile if tile is None else tile  # tile: _tile, or _labels (1 byte)
        depth = 3 if self.tile is _tile else 1
        self.texels = np.zeros((RING * TILE, RING * TILE, depth), np.uint8)
        self.held: dict[tuple[int, int], tuple[int, int]] = {}  # slot (x, y) -> the tile (tx, ty) in it
        self.window = None

    def fill(self, t0x: int, t0y: int, n: int) -> np.ndarray:
        """The (RING * TILE) ** 2 x 3 texels (x 1: labels), holding the n x n tiles from (t0x, t0y)."""
        if self.window != (t0x, t0y, n):  # (the six cameras of a frame share it)
            for ty in range(t0y, t0y + n):
                for tx in range(t0x, t0x + n):
                    sx, sy = tx % RING, ty % RING
                    if self.held.get((sx, sy)) != (tx, ty):
                        tile = self.tile(*self.key, tx, ty).reshape(TILE, TILE, -1)
                        self.texels[sy * TILE : (sy + 1) * TILE, sx * TILE : (sx + 1) * TILE] = tile
                        self.held[sx, sy] = (tx, ty)
            self.window = (t0x, t0y, n)
        return self.texels.reshape(-1, self.texels.shape[2])


RING = 8  # slots per axis, a power of two (indices wrap with a mask) above the most tiles a window spans (6)
_RINGS: list[_Ring] = []  # this process's ring, of the location it drew last
_LABEL_RINGS: list[_Ring] = []  # and of the ground classes (the LiDAR's materials, bev.synthetic.native)


def _ring(seed: int, location: str, labels: bool = False) -> _Ring:
    rings = _LABEL_RINGS if labels else _RINGS
    if not rings or rings[0].key != (seed, location):
        rings[:] = [_Ring(seed, location, _labels if labels else None)]
    return rings[0]


def _tile_window(centre) -> tuple[int, int, int]:
    """The first tile (t0x, t0y) and the tiles per side n of the n x n window of tiles textured around `centre`."""
    tile_m = TILE * TEX_RES
    t0x, t0y = int(math.floor((centre[0] - TEX_RANGE) / tile_m)), int(math.floor((centre[1] - TEX_RANGE) / tile_m))
    n = int(math.floor((centre[0] + TEX_RANGE) / tile_m)) - t0x + 1
    n = max(n, int(math.floor((centre[1] + TEX_RANGE) / tile_m)) - t0y + 1)
    return t0x, t0y, n


def ground_colour(seed: int, location: str, x: np.ndarray, y: np.ndarray, centre) -> np.ndarray:
    """(N, 3) float32 ground colours at global points (x, y): the map texture, plain grass beyond
    TEX_RANGE of `centre` (x, y)."""
    t0x, t0y, n = _tile_window(centre)
    size = n * TILE
    gcol = np.floor(x * (1 / TEX_RES)).astype(np.int64)  # global texel indices
    grow = np.floor(y * (1 / TEX_RES)).astype(np.int64)
    col, row = gcol - t0x * TILE, grow - t0y * TILE  # on the n x n window of tiles from (t0x, t0y)
    # Negative indices view as huge unsigned ones: one test per axis for "off the window".
    outside = np.flatnonzero((col.view(np.uint64) >= size) | (row.view(np.uint64) >= size))
    texels = _ring(seed, location).fill(t0x, t0y, n)
    side = RING * TILE
    out = texels.take((grow & (side - 1)) * side + (gcol & (side - 1)), axis=0, mode="clip") * np.float32(1 / 255)
    out.reshape(-1, 3)[outside] = _PALETTE[_CLASS["grass"]]
    return out


def _sky_colour(elev: np.ndarray) -> np.ndarray:
    e = np.clip(elev, 0, 1)[..., None]
    return np.array([0.78, 0.85, 0.92], np.float32) * (1 - e) + np.array([0.35, 0.55, 0.85], np.float32) * e


class Parts(NamedTuple):
    """Ego-frame boxes of the drawn objects at one time, one row per part (objects only yaw, so
    every part's z axis is the ego z axis)."""

    label: np.ndarray  # (P,) int32 instance id: object index + 1 for annotated objects, 0 for scenery
    obj: np.ndarray  # (P,) object index
    R: np.ndarray  # (P, 3, 3) part -> ego rotation
    centre: np.ndarray  # (P, 3)
    half: np.ndarray  # (P, 3) half extents
    cols: np.ndarray  # (P, 12, 3) float32 colour per face (-x, +x, -y, +y, -z, +z): paint, then glass
    kind: np.ndarray  # (P,) part kind (bev.synthetic.world SOLID, CABIN, DARK, WINDOWS)
    corners: np.ndarray  # (P, 8, 3)


_SIGNS = np.array([[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)], np.float64)


def _object_parts_ego(world: World, t: float, obj_indices) -> Parts:
    """Ego-frame boxes of the given objects at time t."""
    ego_t, ego_yaw = world.ego_pose(t)
    c, s = math.cos(ego_yaw), math.sin(ego_yaw)
    R_eg = np.array([[c, s, 0], [-s, c, 0], [0, 0, 1.0]])  # global -> ego rotation
    objs = [world.objects[i] for i in obj_indices]
    n = [len(o.parts) for o in objs]
    xy, yaw = world.poses(t)  # world.object_pose's values, gathered at once
    rows = np.asarray(obj_indices, np.int64)
    pose = np.stack([xy[rows, 0], xy[rows, 1], [o.size[2] / 2 for o in objs]], 1).reshape(-1, 3)
    R_obj = [
        ((math.cos(a), -math.sin(a), 0), (math.sin(a), math.cos(a), 0), (0, 0, 1.0))
        for a in (y - ego_yaw for y in yaw[rows].tolist())
    ]
    R = np.repeat(np.array(R_obj, np.float64).reshape(-1, 3, 3), n, axis=0)
    c_ego = np.repeat((pose - ego_t) @ R_eg.T, n, axis=0)
    first, pc, half, rgb, kind = _part_rows(world)
    count = np.asarray(n, np.int64)
    take = np.repeat(first[rows] - np.cumsum(count) + count, count) + np.arange(count.sum())  # their rows, in order
    pc, half, rgb, kind = pc[take], half[take], rgb[take], kind[take]
    centre = c_ego + np.einsum("pij,pj->pi", R, pc)
    # Face f = 2 * axis + positive side has the normal (2 * side - 1) * R[:, axis].
    towards = np.einsum("pjk,j->pk", R, R_eg @ world.sun)
    lit = np.clip(np.stack([-towards, towards], -1).reshape(-1, 6), 0, None)
    shade = np.concatenate([0.45 + 0.55 * lit] * 2, 1)[..., None]
    cols = (
        np.concatenate(
            [np.broadcast_to(rgb[:, None], (len(rgb), 6, 3)), np.broadcast_to(np.asarray(GLASS), (len(rgb), 6, 3))], 1
        )
        * shade
    )
    cols[:, 6:] += 0.12 * lit[..., None]  # a glint on the glass
    label = np.repeat([i + 1 if o.category else 0 for i, o in zip(obj_indices, objs)], n).astype(np.int32)
    corners = centre[:, None] + _yawed(_SIGNS * half[:, None], R)
    return Parts(
        label, np.repeat(np.asarray(obj_indices, np.int64), n), R, centre, half, cols.astype(np.float32), kind, corners
    )


def _part_rows(world: World) -> tuple[np.ndarray, ...]:
    """Every object's parts as arrays, built once per world (its objects are fixed once built): each object's first
    row (N + 1,), centres, half extents, colours (P, 3) float64 and kinds (P,) int64, in object order."""
    if not world._parts or world._parts[0] != len(world.objects):
        rows = [p for o in world.objects for p in o.parts]
        first = np.cumsum([0] + [len(o.parts) for o in world.objects])
        arrays = (np.array([p[k] for p in rows], np.float64).reshape(-1, 3) for k in range(3))
        world._parts[:] = [len(world.objects), first, *arrays, np.array([p[3] for p in rows], np.int64)]
    return tuple(world._parts[1:])


def _yawed(v: np.ndarray, R: np.ndarray) -> np.ndarray:
    """R_p v for vectors v (P, C, 3) and yaw rotations R (P, 3, 3): einsum("pcj,pij->pci")'s values, ~10x cheaper.
    A yaw matrix's zeros make each sum one rounded two-term sum (x and y) or one product (z), so no order differs."""
    R = R[:, None]
    return np.stack(
        [(v[..., 0] * R[..., i, 0] + v[..., 1] * R[..., i, 1]) + v[..., 2] * R[..., i, 2] for i in range(3)], -1
    )


_EDGES = np.array([(a, b) for a in range(8) for b in range(a + 1, 8) if np.sum(_SIGNS[a] != _SIGNS[b]) == 1])


def _part_rects(cam: Camera, parts: Parts) -> np.ndarray:
    """(P, 4) pixel rectangles [r0, r1, c0, c1) bounding each part's projection, clipped at the near
    plane (empty for parts entirely behind it): natively when active (bev.synthetic.native), else in numpy."""
    if native.active():
        if not hasattr(cam, "_rect_maps"):
            c = np.ascontiguousarray
            post = (c(cam.post_rot.double().numpy()), c(cam.post_tran.double().numpy()))
            cam._rect_maps = (c(cam.rotation), c(cam.translation), c(cam.intrinsic), *post)
        H, W = cam.shape
        return native.rects(np.ascontiguousarray(parts.corners), *cam._rect_maps, H, W, NEAR)
    return _part_rects_numpy(cam, parts)


def _part_rects_numpy(cam: Camera, parts: Parts) -> np.ndarray:
    """_part_rects in numpy (the reference)."""
    rects = np.zeros((len(parts.obj), 4), np.int64)
    depth = (parts.corners - cam.translation) @ cam.rotation[:, 2]
    front = np.flatnonzero((depth > NEAR).any(1))
    if not len(front):
        return rects
    corners, depth = parts.corners[front], depth[front]
    # Camera depth is affine along an edge, so edges crossing the near plane are cut there.
    da, db = depth[:, _EDGES[:, 0]], depth[:, _EDGES[:, 1]]
    with np.errstate(divide="ignore", invalid="ignore"):
        f = np.clip((NEAR - da) / (db - da), 0, 1)
    cut = corners[:, _EDGES[:, 0]] + f[..., None] * (corners[:, _EDGES[:, 1]] - corners[:, _EDGES[:, 0]])
    crossing = (da - NEAR) * (db - NEAR) < 0
    pts = np.concatenate([corners, cut], axis=1)
    valid = np.concatenate([depth > NEAR, crossing], axis=1)
    uv = cam.project_uv(pts)
    H, W = cam.shape
    big = 1e9
    umin = np.where(valid, uv[..., 0], big).min(1)
    umax = np.where(valid, uv[..., 0], -big).max(1)
    vmin = np.where(valid, uv[..., 1], big).min(1)
    vmax = np.where(valid, uv[..., 1], -big).max(1)
    r = np.stack([np.floor(vmin) - 1, np.ceil(vmax) + 2, np.floor(umin) - 1, np.ceil(umax) + 2], 1)
    r = np.clip(np.nan_to_num(r, nan=0.0), -1, big).astype(np.int64)
    rects[front] = np.clip(r, 0, [H, H, W, W])
    return rects


def _pixel_pairs(rects: np.ndarray, W: int) -> np.ndarray:
    """Flat index of every pixel of every (non-empty) rectangle, rectangle by rectangle in row-major
    order: a cumulative sum of steps, +1 along a row and a jump to the start of the next row."""
    h, w = rects[:, 1] - rects[:, 0], rects[:, 3] - rects[:, 2]
    length = np.repeat(w, h)
    first = np.repeat(rects[:, 0] - np.cumsum(h) + h, h) + np.arange(h.sum())  # image row of each row run
    start = first * W + np.repeat(rects[:, 2], h)
    step = np.ones(length.sum(), np.int64)
    step[np.cumsum(length) - length] = start - np.concatenate([[1], start[:-1] + length[:-1]]) + 1
    return np.cumsum(step)


CHUNK = 32768  # (part, pixel) pairs per pass of the slab test: its temporaries stay in the CPU cache


def _part_frames(cam: Camera, parts: Parts) -> tuple[np.ndarray, np.ndarray]:
    """Camera centre in each part's frame (P, 3), and cos, sin of the part yaws in float32 (P, 2)."""
    o = np.einsum("pj,pjk->pk", cam.translation.astype(np.float32) - parts.centre, parts.R)
    return o, parts.R[:, :2, 0].astype(np.float32)


def _directions(rx: np.ndarray, ry: np.ndarray, rz: np.ndarray, c: np.ndarray, s: np.ndarray) -> list:
    """Ray directions along the axes of parts with yaw cos c, sin s (their x, y axes lie in the ground plane)."""
    return [rx * c + ry * s, ry * c - rx * s, rz]


def _part_table(cam: Camera, parts: Parts) -> np.ndarray:
    """(P, 8) float32 per-part values of the slab test: yaw cos, sin; slab bounds -half - o, half - o (o: the camera
    centre in the part's frame), the rows the native caster (bev.synthetic.native) takes."""
    return _slab_table(*_part_frames(cam, parts), parts.half)


def _slab_table(o: np.ndarray, yaw: np.ndarray, half: np.ndarray) -> np.ndarray:
    """_part_table from _part_frames' o and yaw and the parts' half extents."""
    near, far = (-half - o).astype(np.float32), (half - o).astype(np.float32)
    return np.ascontiguousarray(np.concatenate([yaw, near, far], 1))


MISS = np.int32(0x7FFFFFFF)  # depth bits of a pair that hits nothing: above every float's


def _slab(cam: Camera, parts: Parts, rects: np.ndarray, faces: bool = True):
    """Slab test of every pixel's ray in each part's (non-empty) rectangle against the part, in the part
    frames, rectangle by rectangle in row-major order and about CHUNK pairs at a time: z-buffer key
    (_slab_chunk), hit and entry face per pair (the key alone when not `faces`).

    Call under np.errstate(divide="ignore", invalid="ignore"): rays parallel to a slab give inf / nan."""
    per_part = _part_table(cam, parts).T  # (8, P)
    n = (rects[:, 1] - rects[:, 0]) * (rects[:, 3] - rects[:, 2])
    ends, a = np.cumsum(n), 0
    out = [np.empty(n.sum(), dt) for dt in ((np.int64, bool, np.int8) if faces else (np.int64,))]
    while a < len(n):
        b = max(a + 1, int(np.searchsorted(ends, ends[a] - n[a] + CHUNK, "right")))
        pairs = slice(ends[a] - n[a], ends[b - 1])
        res = _slab_chunk(_rect_pixels(cam.planes, rects[a:b]), per_part[:, a:b], n[a:b], a, faces)
        for x, r in zip(out, res):
            x[pairs] = r
        a = b
    return out


def _rect_pixels(planes: np.ndarray, rects: np.ndarray) -> np.ndarray:
    """(K, N) values of (K, H, W) planes at every pixel of the rectangles (block copies, no gathers)."""
    n = (rects[:, 1] - rects[:, 0]) * (rects[:, 3] - rects[:, 2])
    out, s = np.empty((len(planes), int(n.sum())), planes.dtype), 0
    for (r0, r1, c0, c1), m in zip(rects.tolist(), n.tolist()):
        out[:, s : s + m].reshape(len(planes), r1 - r0, c1 - c0)[...] = planes[:, r0:r1, c0:c1]
        s += m
    return out


def _slab_chunk(rays: np.ndarray, per_part: np.ndarray, n: np.ndarray, first: int, faces: bool = True):
    """The slab test of the pairs of parts first, first + 1, ... (n pairs each) with rays (3, N)
    and per-part values (_slab): (key, hit, face), or (key,) when not `faces`. np.where is ~10x slower
    than arithmetic here: the face is int8 sums."""
    rx, ry, rz = rays
    c, s, *bounds = (np.repeat(x, n) for x in per_part)
    d = _directions(rx, ry, rz, c, s)
    inv = [np.float32(1.0) / dk for dk in d]
    lo, hi = [], []
    for k in range(3):
        t1, t2 = bounds[k] * inv[k], bounds[3 + k] * inv[k]
        lo.append(np.fmin(t1, t2))
        hi.append(np.fmax(t1, t2))
    tnear = np.fmax(np.fmax(lo[0], lo[1]), lo[2])
    hit = (tnear <= np.fmin(np.fmin(hi[0], hi[1]), hi[2])) & (tnear > NEAR)
    # Depths are positive, and positive floats order as their bits: the key orders hits by
    # (depth, part + 1), so the least key per pixel, the ground's (part field 0) included, is what
    # drawing the ground and then the parts in order with a strict depth test would show.
    bits = np.maximum(tnear.view(np.int32), ~hit * MISS)
    key = (bits.astype(np.int64) << 32) | np.repeat(np.arange(first + 1, first + len(n) + 1), n)
    if not faces:
        return (key,)
    # The entry face is the axis whose slab was entered last (the last axis on a tie); the ray
    # enters the + face when it travels towards -axis.
    neg = [(dk < 0).view(np.int8) for dk in d]
    face = neg[0] + (lo[1] == tnear).view(np.int8) * (2 + neg[1] - neg[0])
    face += (lo[2] == tnear).view(np.int8) * (4 + neg[2] - face)
    return key, hit, face


def _coverage(parts: Parts, rects: np.ndarray, hit: np.ndarray) -> dict:
    """{annotated object: pixels its parts hit}, a pixel counted once however many of its parts hit it:
    each object's hits are merged into a mask over the union of its parts' rectangles."""
    mine = np.flatnonzero(parts.label > 0).tolist()
    boxes: dict[int, list[int]] = {}
    for i, (r0, r1, c0, c1) in zip(parts.obj[mine].tolist(), rects[mine].tolist()):
        b = boxes.setdefault(i, [r0, r1, c0, c1])
        b[:] = [min(b[0], r0), max(b[1], r1), min(b[2], c0), max(b[3], c1)]
    own = {i: np.zeros((b[1] - b[0], b[3] - b[2]), bool) for i, b in boxes.items()}
    ends = np.cumsum((rects[:, 1] - rects[:, 0]) * (rects[:, 3] - rects[:, 2])).tolist()
    for j, i, (r0, r1, c0, c1) in zip(mine, parts.obj[mine].tolist(), rects[mine].tolist()):
        b, h, w = boxes[i], r1 - r0, c1 - c0
        own[i][r0 - b[0] : r1 - b[0], c0 - b[2] : c1 - b[2]] |= hit[ends[j] - h * w : ends[j]].reshape(h, w)
    return {i: int(np.count_nonzero(m)) for i, m in own.items()}


def _front(cam: Camera, key: np.ndarray, pix: np.ndarray) -> np.ndarray:
    """Indices of the pairs seen at their pixel: the least z-buffer key there (_slab_chunk), if not the ground's."""
    best = cam.ground_key.copy()
    np.minimum.at(best, pix, key)
    return np.flatnonzero(key == best[pix])


def _glass(face: np.ndarray, p: list, half: np.ndarray, kind: np.ndarray) -> np.ndarray:
    """Which hit points (part frame, float32) on the side faces are window glass rather than paint."""
    side = face < 4
    along = np.where(face < 2, p[1], p[0])  # horizontal coordinate on the hit face
    half_along = np.where(face < 2, half[:, 1], half[:, 0])
    z_ok = np.abs(p[2]) < (half[:, 2] - 0.06).astype(np.float32)
    cabin = kind == CABIN
    inside = np.abs(along) < half_along - np.where(cabin, 0.14, 0.25)
    mullion = (along % 1.6) < 0.16
    return side & z_ok & inside & (cabin | ~mullion)


def _colours(cam: Camera, parts: Parts, p: np.ndarray, q: np.ndarray, tn: np.ndarray, face: np.ndarray) -> np.ndarray:
    """(N, 3) colours of the hits of parts p at pixels q, depth tn, through face `face`; the side faces of
    CABIN and WINDOWS parts show glass (face colours 6-11) or paint."""
    g = np.flatnonzero(np.isin(parts.kind, (CABIN, WINDOWS))[p])
    o, yaw = _part_frames(cam, parts)
    d = _directions(*(r.ravel()[q[g]] for r in cam.planes), *yaw[p[g]].T)
    hits = [o[p[g], k].astype(np.float32) + tn[g] * d[k] for k in range(3)]  # part frame
    face[g] += 6 * _glass(face[g], hits, parts.half[p[g]], parts.kind[p[g]])
    return parts.cols.reshape(-1, 3).take(p * 12 + face, axis=0)


def _rgb(a: np.ndarray) -> np.ndarray:
    """A contiguous (..., 3) float32 array as a flat view of 12-byte RGB items: fancy indexing moves
    a whole pixel at once (2-3x faster than rows of 3 floats)."""
    return a.reshape(-1, 3).view(np.dtype((np.void, 12))).ravel()


class CameraRender(NamedTuple):
    """One rendered camera, all at the render resolution (1600/scale x 900/scale)."""

    image: np.ndarray  # (H, W, 3) float32 RGB in [0, 1]
    ids: np.ndarray  # (H, W) int32: object index + 1 for annotated objects, 0 for ground, sky, buildings
    depth: np.ndarray  # (H, W) float32 camera depth of the visible surface (inf for sky)
    coverage: dict  # {object index: pixels it would cover with nothing in front of it}


def _ground_render(world: World, t: float, cam: Camera) -> tuple[np.ndarray, np.ndarray]:
    """(H, W, 3) sky and textured ground (road coordinates), and its depth (inf for sky)."""
    t_ground, runs, gx, gy, clear, fog = cam.ground
    ego_t, ego_yaw = world.ego_pose(t)
    cy, sy = math.cos(ego_yaw), math.sin(ego_yaw)
    if native.active():  # the same pixels in one C++ pass (bev.synthetic.native.ground)
        t0x, t0y, n = _tile_window(ego_t)
        texels = _ring(world.seed, world.location).fill(t0x, t0y, n)
        img, grass = _sky_around_ground(cam), _PALETTE[_CLASS["grass"]]
        window = (t0x * TILE, t0y * TILE, n * TILE, RING * TILE)
        pose = (ego_t[0], ego_t[1], cy, sy, 1 / TEX_RES, np.float32(1 / 255))
        native.ground(gx, gy, cam.ground_pixels, clear.ravel(), fog, texels, grass, img, *pose, *window)
        return img, t_ground.copy()
    x = ego_t[0] + cy * gx - sy * gy  # ego -> global (map) coordinates
    y = ego_t[1] + sy * gx + cy * gy
    colour = ground_colour(world.seed, world.location, x, y, ego_t)
    colour[: len(clear)] = colour[: len(clear)] * clear + fog  # exact where there is no haze
    img, sky = np.empty_like(cam.sky), cam.sky.reshape(-1, 3)
    flat, done, used = img.reshape(-1, 3), 0, 0
    for start, stop in runs:
        flat[done:start] = sky[done:start]
        flat[start:stop] = colour[used : used + stop - start]
        done, used = stop, used + stop - start
    flat[done:] = sky[done:]
    return img, t_ground.copy()


def _sky_around_ground(cam: Camera) -> np.ndarray:
    """(H, W, 3) the camera's sky outside the ground's runs, the rest unset (the ground paint fills it): half the
    bytes of a copy of the sky."""
    img = np.empty_like(cam.sky)
    flat, sky, done = img.reshape(-1, 3), cam.sky.reshape(-1, 3), 0
    for start, stop in cam.ground[1]:
        flat[done:start] = sky[done:start]
        done = stop
    flat[done:] = sky[done:]
    return img


def render_camera(
    world: World,
    t: float,
    camera: str | Camera,
    objects: list[int] | None = None,
    scale: int = RENDER_SCALE,
    parts: Parts | None = None,
) -> CameraRender:
    """Ray-cast one camera of the ego at time t (ego frame = the ego pose at t).

    Full-resolution pixel coordinates map to the render resolution with the camera's
    post_rot / post_tran (bev.synthetic.raycast.downscale), e.g. through bev.geometry.ego_to_image.
    `objects` defaults to everything within RENDER_RANGE; `parts` (from render_sample) skips
    recomputing the ego-frame boxes per camera.
    """
    cam, parts = _camera_parts(world, t, camera, objects, scale, parts)
    H, W = cam.shape
    img, zbuf = _ground_render(world, t, cam)
    ids = np.zeros((H, W), np.int32)
    # Every (part, pixel) pair in the parts' projected rectangles is ray-cast; the nearest hit per pixel wins.
    parts, rects = _visible(cam, parts)
    if native.active():  # the same keys, faces, coverage and pixels, in C++ (bev.synthetic.native)
        group, objs = _coverage_groups(parts)
        o, yaw = _part_frames(cam, parts)
        table = _slab_table(o, yaw, parts.half)
        best, faces, cover = native.zbuffer(cam.planes, table, rects, cam.ground_key, group, len(objs), faces=True)
        origin = o.astype(np.float32)
        glass = (parts.kind == CABIN) * np.int8(1) + (parts.kind == WINDOWS) * np.int8(2)
        c = np.ascontiguousarray
        arrays = (origin, c(parts.half), glass.astype(np.int8), c(parts.cols), c(parts.label.astype(np.int32)))
        native.shade(best, faces, cam.planes, table, *arrays, img, zbuf, ids)
        return CameraRender(img, ids, zbuf, dict(zip(objs, cover.tolist())))
    # The numpy reference: every pair at once in long passes, a scatter-min z-buffer.
    pix = _pixel_pairs(rects, W)
    with np.errstate(divide="ignore", invalid="ignore"):
        key, hit, face = _slab(cam, parts, rects)
    coverage = _coverage(parts, rects, hit)
    win = _front(cam, key, pix)
    q, key, face = pix[win], key[win], face[win].astype(np.int64)
    p, tn = (key & 0xFFFFFFFF) - 1, (key >> 32).astype(np.int32).view(np.float32)
    zbuf.ravel()[q] = tn
    _rgb(img)[q] = _rgb(_colours(cam, parts, p, q, tn, face))
    ids.ravel()[q] = parts.label[p]
    return CameraRender(img, ids, zbuf, coverage)


def _visible(cam: Camera, parts: Parts) -> tuple[Parts, np.ndarray]:
    """The parts whose rectangles (_part_rects) hold pixels, and their rectangles."""
    rects = _part_rects(cam, parts)
    seen = np.flatnonzero((rects[:, 1] > rects[:, 0]) & (rects[:, 3] > rects[:, 2]))
    return Parts(*(x[seen] for x in parts)), rects[seen]


def _in_view(cam: Camera, parts: Parts) -> tuple[Parts, np.ndarray, np.ndarray]:
    """_visible's parts and rectangles, and their pairs' pixels (_pixel_pairs)."""
    parts, rects = _visible(cam, parts)
    return parts, rects, _pixel_pairs(rects, cam.shape[1])


def _coverage_groups(parts: Parts) -> tuple[np.ndarray, list[int]]:
    """The native caster's coverage groups (bev.synthetic.native.zbuffer): per part the rank of its object among the
    annotated objects (label > 0) in order of first appearance, -1 for scenery; and those objects (_coverage's keys,
    in its order)."""
    mine = np.flatnonzero(parts.label > 0)
    objs, first, inverse = np.unique(parts.obj[mine], return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(objs), np.int64)
    rank[order] = np.arange(len(objs))
    group = np.full(len(parts.obj), -1, np.int64)
    group[mine] = rank[inverse.ravel()]
    return group, objs[order].tolist()


def _camera_parts(world: World, t: float, camera, objects, scale: int, parts) -> tuple[Camera, Parts]:
    """render_camera's camera and parts from its arguments."""
    cam = make_camera(camera, scale) if isinstance(camera, str) else camera
    if parts is None:
        parts = _object_parts_ego(world, t, visible_objects(world, t, RENDER_RANGE) if objects is None else objects)
    return cam, parts


def render_depth(
    world: World, t: float, camera: str | Camera, scale: int = RENDER_SCALE, parts: Parts | None = None
) -> np.ndarray:
    """render_camera's depth alone, (H, W) float32, the same values: no colours, ids or coverage to compute."""
    cam, parts = _camera_parts(world, t, camera, None, scale, parts)
    return _key_depth(zbuffer(cam, *_visible(cam, parts))).reshape(cam.shape)


def zbuffer(cam: Camera, parts: Parts, rects: np.ndarray, pix: np.ndarray | None = None) -> np.ndarray:
    """(H * W,) least z-buffer key (_slab_chunk) of each ray of `cam` over the ground and the parts, each part
    tested on the rays of its rectangle (rects (P, 4) [r0, r1, c0, c1), pix their flat indices, _pixel_pairs,
    computed when not given): the depth of the first surface in the upper half, in the lower the index of its
    part + 1 (0: the ground). The native caster when active (bev.synthetic.native), else zbuffer_numpy."""
    if native.active():
        return native.zbuffer(cam.planes, _part_table(cam, parts), rects, cam.ground_key)[0]
    return zbuffer_numpy(cam, parts, rects, _pixel_pairs(rects, cam.shape[1]) if pix is None else pix)


def zbuffer_numpy(cam: Camera, parts: Parts, rects: np.ndarray, pix: np.ndarray) -> np.ndarray:
    """zbuffer in numpy (the reference): every (part, pixel) pair's slab test in long passes, one scatter-min."""
    with np.errstate(divide="ignore", invalid="ignore"):
        (key,) = _slab(cam, parts, rects, faces=False)
    best = cam.ground_key.copy()  # the ground's depth bits (inf above the horizon), part field 0
    np.minimum.at(best, pix, key)
    return best


def _key_depth(key: np.ndarray) -> np.ndarray:
    """The depths (float32) in the upper halves of z-buffer keys."""
    return (key >> 32).astype(np.int32).view(np.float32)


def visibility_level(visible: int, unoccluded: int) -> str:
    """nuScenes visibility token from visible / unoccluded pixels: '1' 0-40%, '2' 40-60%, '3' 60-80%, '4' 80-100%."""
    frac = visible / unoccluded if unoccluded > 0 else 0.0
    return "1" if frac < 0.4 else "2" if frac < 0.6 else "3" if frac < 0.8 else "4"


def sample_parts(world: World, t: float) -> Parts:
    """The ego-frame parts render_sample draws at time t: every object within RENDER_RANGE."""
    return _object_parts_ego(world, t, visible_objects(world, t, RENDER_RANGE))


def render_sample(world: World, t: float, scale: int = RENDER_SCALE, parts: Parts | None = None):
    """All six cameras: ({camera: CameraRender}, {object index: (visible px, unoccluded px) summed over cameras}).
    `parts`: sample_parts(world, t), if the caller has them."""
    if parts is None:
        parts = sample_parts(world, t)
    out, counts = {}, {}
    for name in CAMERA_NAMES:
        r = render_camera(world, t, name, None, scale, parts)
        out[name] = r
        shown = r.ids[r.ids > 0]  # (most pixels show none: counting only the others is ~5x cheaper)
        vis = np.bincount(shown, minlength=len(world.objects) + 1)
        for i, n in r.coverage.items():
            v, u = counts.get(i, (0, 0))
            counts[i] = (v + int(vis[i + 1]), u + n)
    return out, counts
