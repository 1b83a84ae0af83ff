"""World model and numpy ray-caster behind the synthetic nuScenes-format dataset.

A scene is a straight urban road (4 driving lanes, 2 parking lanes, sidewalks, buildings)
in a flat world (ground at z = 0). The ego vehicle drives along it; other vehicles drive
in the lanes or are parked at the sides; pedestrians, barriers and traffic cones are
non-vehicle distractors. Every object is a union of axis-aligned boxes ("parts") in its own
frame, so one camera is rendered exactly by casting one ray per pixel: ground plane first,
then a slab test per part inside the part's projected bounding rectangle, with a z-buffer
(camera depth) for occlusion and a per-pixel instance-id buffer.

Geometry conventions (ego frame, camera->ego extrinsics, quaternions (w, x, y, z), pixel
centres) are those of bev.geometry; projection and unprojection go through its functions.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple
from importlib import resources

import numpy as np
import torch

from bev.geometry import CAMERA_NAMES, ego_to_image, frustum_to_ego, quaternion_to_matrix

IMAGE_W, IMAGE_H = 1600, 900
# Cameras are ray-cast at 1/RENDER_SCALE of 1600x900 and upscaled bilinearly: the model
# sees 352x128 crops, and full-resolution casting would cost 4x the time for no gain.
RENDER_SCALE = 2
NEAR = 0.1  # metres, camera near plane for clipping projected bounding rectangles
ANNOTATION_RANGE = 60.0  # objects within this ego distance (xy) are annotated
RENDER_RANGE = 90.0  # objects farther than this are not drawn at all (they would be a few pixels)
SAMPLE_DT = 0.5  # key frames at 2 Hz, as in nuScenes

# Road cross-section, lateral offset l (metres, + = left of the road direction +s).
LANE_W = 3.5
PARKING_EDGE = 7.0  # solid white edge line between driving and parking lanes
CURB = 9.5
SIDEWALK_END = 14.0
BUILDING_START = 17.0

# Part kinds: how a part's faces are coloured. CABIN: side windows framed by painted pillars
# and a painted roof; WINDOWS: a band of bus windows with mullions.
SOLID, CABIN, DARK, WINDOWS = 0, 1, 2, 3


@lru_cache(maxsize=1)
def load_rig() -> dict:
    """The real nuScenes camera rig (bev/data/nuscenes_rig.json), shipped with the package."""
    return json.loads(resources.files("bev.data").joinpath("nuscenes_rig.json").read_text())


@dataclass
class Obj:
    """One annotated (or scenery) object: road-frame motion plus boxes in its own frame."""

    category: str  # nuScenes category name; "" for scenery (buildings): never annotated
    size: tuple[float, float, float]  # (w, l, h) as in sample_annotation.size
    s0: float  # position along the road at t = 0
    l: float  # lateral position in the road frame
    speed: float  # signed speed along +s, m/s
    yaw: float  # heading relative to the road direction
    parts: list = field(default_factory=list)  # (centre (3,), half extents (3,), rgb (3,), kind)
    attribute: str = ""

    def s_at(self, t: float) -> float:
        return self.s0 + self.speed * t


@dataclass
class World:
    """A scene: road frame in the global frame, the ego trajectory and the objects."""

    origin: np.ndarray  # global (x, y) of road coordinate s = 0, l = 0
    heading: float  # global yaw of the road direction +s
    ego_s0: float
    ego_speed: float
    ego_l: float
    wobble: tuple[float, float, float]  # lateral wobble (amplitude, angular freq, phase)
    sun: np.ndarray  # unit vector to the sun, road frame
    objects: list[Obj]

    def ego_road(self, t: float) -> tuple[float, float, float]:
        """Ego (s, l, yaw relative to the road) at time t."""
        a, w, p = self.wobble
        s = self.ego_s0 + self.ego_speed * t
        l = self.ego_l + a * math.sin(w * t + p)
        yaw = math.atan2(a * w * math.cos(w * t + p), self.ego_speed)
        return s, l, yaw

    def road_to_global(self, s, l) -> np.ndarray:
        c, sn = math.cos(self.heading), math.sin(self.heading)
        s, l = np.asarray(s, dtype=np.float64), np.asarray(l, dtype=np.float64)
        return np.stack([self.origin[0] + c * s - sn * l, self.origin[1] + sn * s + c * l], axis=-1)

    def ego_pose(self, t: float) -> tuple[np.ndarray, float]:
        """Global translation (3,) and yaw of the ego at time t (flat world: z = 0)."""
        s, l, yaw = self.ego_road(t)
        xy = self.road_to_global(s, l)
        return np.array([xy[0], xy[1], 0.0]), self.heading + yaw

    def object_global(self, obj: Obj, t: float) -> tuple[np.ndarray, float]:
        """Global box centre (3,) and yaw of an object at time t."""
        xy = self.road_to_global(obj.s_at(t), obj.l)
        return np.array([xy[0], xy[1], obj.size[2] / 2]), self.heading + obj.yaw


# ----------------------------------------------------------------------------- world building

# (w, l, h) means and spreads, metres, close to the nuScenes class statistics.
SIZES = {
    "vehicle.car": ((1.95, 4.6, 1.7), (0.1, 0.35, 0.15)),
    "vehicle.truck": ((2.5, 7.5, 3.0), (0.15, 1.0, 0.4)),  # l >= 5.5: the centre stays inside the cargo box
    "vehicle.bus.rigid": ((2.9, 11.5, 3.5), (0.1, 0.8, 0.2)),
    "vehicle.trailer": ((2.6, 11.0, 3.6), (0.1, 1.2, 0.3)),
    "vehicle.motorcycle": ((0.8, 2.1, 1.5), (0.08, 0.15, 0.1)),
    "human.pedestrian.adult": ((0.65, 0.7, 1.75), (0.08, 0.1, 0.1)),
    "movable_object.barrier": ((0.5, 2.2, 1.0), (0.05, 0.3, 0.1)),
    "movable_object.trafficcone": ((0.4, 0.4, 0.75), (0.03, 0.03, 0.08)),
}
MOVING_MIX = (("vehicle.car", 0.74), ("vehicle.truck", 0.1), ("vehicle.bus.rigid", 0.08), ("vehicle.motorcycle", 0.08))
PARKED_MIX = (("vehicle.car", 0.75), ("vehicle.truck", 0.09), ("vehicle.trailer", 0.1), ("vehicle.motorcycle", 0.06))


def _choice(rng: np.random.Generator, mix) -> str:
    names, p = zip(*mix)
    return names[rng.choice(len(names), p=np.asarray(p) / sum(p))]


def _vehicle_colour(rng: np.random.Generator) -> np.ndarray:
    """Saturated paint of a random hue (a few white ones): vehicles must stand out from grey road."""
    if rng.random() < 0.1:
        return np.full(3, rng.uniform(0.8, 0.95))
    h, s, v = rng.random(), rng.uniform(0.65, 1.0), rng.uniform(0.6, 0.95)
    k = (np.array([5.0, 3.0, 1.0]) + h * 6) % 6
    return v - v * s * np.clip(np.minimum(k, 4 - k), 0, 1)


def _box(cx, cy, cz, w, l, h, rgb, kind=SOLID):
    """A part from its centre and extents in the object frame (x forward along l, y left along w)."""
    return (np.array([cx, cy, cz]), np.array([l / 2, w / 2, h / 2]), np.asarray(rgb, dtype=np.float64), kind)


GLASS = (0.12, 0.15, 0.2)
TYRE = (0.06, 0.06, 0.07)


SHADOW = (0.07, 0.07, 0.08)


def _parts(category: str, size, rng: np.random.Generator) -> list:
    """Boxes of an object in its own frame (origin at the box centre, z up)."""
    parts = _shape(category, size, rng)
    if category.startswith("vehicle.") and category != "vehicle.motorcycle":
        # Contact shadow: a dark 2 cm slab filling the footprint under the body overhang.
        w, l, h = size
        parts.insert(0, _box(0, 0, -h / 2 + 0.01, w, l, 0.02, SHADOW, DARK))
    return parts


def _shape(category: str, size, rng: np.random.Generator) -> list:
    w, l, h = size
    z0 = -h / 2  # ground level in the object frame
    if category == "vehicle.car":
        paint = _vehicle_colour(rng)
        body_h = 0.58 * h
        return [
            _box(0, 0, z0 + 0.2, 0.92 * w, 0.8 * l, 0.4, TYRE, DARK),
            _box(0, 0, z0 + 0.3 + (body_h - 0.3) / 2, w, l, body_h - 0.3, paint),
            _box(-0.05 * l, 0, z0 + body_h + (h - body_h) / 2, 0.86 * w, 0.52 * l, h - body_h, paint, CABIN),
        ]
    if category == "vehicle.truck":
        paint, cargo = _vehicle_colour(rng), _vehicle_colour(rng)
        cab_l = 2.2
        return [
            _box(0, 0, z0 + 0.3, 0.9 * w, 0.9 * l, 0.6, TYRE, DARK),
            _box(l / 2 - cab_l / 2, 0, z0 + 0.5 + 0.3 * (h - 0.5), w, cab_l, 0.6 * (h - 0.5), paint),
            _box(l / 2 - cab_l / 2 - 0.1, 0, z0 + 0.5 + 0.6 * (h - 0.5) + 0.175 * (h - 0.5), 0.95 * w, cab_l - 0.2, 0.35 * (h - 0.5), paint, CABIN),
            _box(-cab_l / 2 - 0.15, 0, z0 + 0.6 + (h - 0.6) / 2, w, l - cab_l - 0.3, h - 0.6, cargo),
        ]
    if category == "vehicle.bus.rigid":
        paint = _vehicle_colour(rng)
        return [
            _box(0, 0, z0 + 0.25, 0.9 * w, 0.85 * l, 0.5, TYRE, DARK),
            _box(0, 0, z0 + 0.4 + 0.25 * (h - 0.4), w, l, 0.5 * (h - 0.4), paint),
            _box(0, 0, z0 + 0.4 + 0.65 * (h - 0.4), 0.98 * w, 0.98 * l, 0.3 * (h - 0.4), paint, WINDOWS),
            _box(0, 0, z0 + 0.4 + 0.9 * (h - 0.4), w, l, 0.2 * (h - 0.4), paint),
        ]
    if category == "vehicle.trailer":
        paint = _vehicle_colour(rng)
        return [
            _box(-0.3 * l, 0, z0 + 0.55, 0.9 * w, 0.3 * l, 1.1, TYRE, DARK),
            _box(0, 0, z0 + 1.1 + (h - 1.1) / 2, w, l, h - 1.1, paint),
        ]
    if category == "vehicle.motorcycle":
        paint = _vehicle_colour(rng)
        parts = [
            _box(0, 0, z0 + 0.35, 0.3, l, 0.7, TYRE, DARK),
            _box(0, 0, z0 + 0.85, 0.6 * w, 0.7 * l, 0.4, paint),
        ]
        if h > 1.3:  # with a rider: torso and helmet
            parts += [_box(-0.1 * l, 0, z0 + 1.25, 0.8 * w, 0.25 * l, h - 1.1 - 0.25, _vehicle_colour(rng)),
                      _box(-0.05 * l, 0, z0 + h - 0.13, 0.3, 0.3, 0.26, paint)]
        return parts
    if category == "human.pedestrian.adult":
        shirt = _vehicle_colour(rng)
        legs = np.array([0.15, 0.17, 0.3]) * rng.uniform(0.7, 1.5)
        return [
            _box(0, 0, z0 + 0.42, 0.36, 0.25, 0.84, legs),
            _box(0, 0, z0 + 0.84 + 0.3, 0.5 * w / 0.65, 0.3, 0.6, shirt),
            _box(0, 0, z0 + h - 0.15, 0.22, 0.24, 0.3, np.array([0.85, 0.65, 0.5]) * rng.uniform(0.5, 1.0)),
        ]
    if category == "movable_object.barrier":
        return [_box(0, 0, z0 + 0.15, 0.6 * w, 0.9 * l, 0.3, (0.6, 0.6, 0.6)),
                _box(0, 0, z0 + 0.3 + (h - 0.3) / 2, 0.4 * w, l, h - 0.3, (0.95, 0.95, 0.92))]
    if category == "movable_object.trafficcone":
        orange = (1.0, 0.45, 0.05)
        return [_box(0, 0, z0 + 0.02, w, l, 0.04, (0.1, 0.1, 0.1)),
                _box(0, 0, z0 + 0.04 + 0.3 * (h - 0.04), 0.6 * w, 0.6 * l, 0.6 * (h - 0.04), orange),
                _box(0, 0, z0 + 0.04 + 0.8 * (h - 0.04), 0.3 * w, 0.3 * l, 0.4 * (h - 0.04), (0.95, 0.95, 0.95))]
    raise ValueError(f"no shape for category {category!r}")


def _object(category: str, s0: float, l: float, speed: float, yaw: float, rng, attribute: str) -> Obj:
    mean, spread = SIZES[category]
    size = tuple(float(m + d * np.clip(rng.standard_normal(), -2, 2)) for m, d in zip(mean, spread))
    return Obj(category, size, s0, l, speed, yaw, _parts(category, size, rng), attribute)


def build_world(seed: int, scene: int, samples: int) -> World:
    """The deterministic world of scene number `scene` for `seed`, sized for `samples` key frames."""
    rng = np.random.default_rng([seed, scene])
    duration = (samples - 1) * SAMPLE_DT
    ego_speed = rng.uniform(5.0, 9.0)
    ego_l = -LANE_W / 2 if rng.random() < 0.6 else -1.5 * LANE_W
    wobble = (rng.uniform(0.1, 0.4), rng.uniform(0.2, 0.5), rng.uniform(0, 2 * math.pi))
    ego_end = ego_speed * duration
    reach = RENDER_RANGE + 5
    objects: list[Obj] = []

    # Moving traffic: lanes at l < 0 drive along +s, l > 0 along -s (right-hand traffic).
    # One speed per lane so vehicles in a lane never collide; the ego's lane moves with the ego.
    for lane_l in (-1.5 * LANE_W, -0.5 * LANE_W, 0.5 * LANE_W, 1.5 * LANE_W):
        if lane_l == ego_l:
            v = ego_speed
        elif lane_l < 0:
            v = ego_speed + rng.uniform(-2.5, 2.5)
        else:
            v = -rng.uniform(5.0, 11.0)
        rel = (ego_speed - v) * duration  # how far the lane drifts past the ego over the scene
        s = -reach + min(0.0, rel) + rng.uniform(0, 8)
        while s < reach + max(0.0, rel):
            cat = _choice(rng, MOVING_MIX)
            o = _object(cat, 0.0, lane_l + rng.uniform(-0.15, 0.15), v, 0.0 if v > 0 else math.pi, rng,
                        "cycle.with_rider" if cat == "vehicle.motorcycle" else "vehicle.moving")
            half = o.size[1] / 2
            o.s0 = s + half
            if not (lane_l == ego_l and abs(o.s0) < half + 7.0):  # keep clear of the ego
                objects.append(o)
            s += o.size[1] + rng.uniform(8.0, 30.0)

    # Parked vehicles in the parking lanes; cones and barriers in some gaps.
    for side in (-1, 1):
        s = -reach + rng.uniform(0, 5)
        while s < ego_end + reach:
            if rng.random() < 0.45:
                cat = _choice(rng, PARKED_MIX)
                yaw = (0.0 if side < 0 else math.pi) + rng.normal(0, 0.04)
                attr = "cycle.without_rider" if cat == "vehicle.motorcycle" else "vehicle.parked"
                # Centred 1.4 m into the parking lane: the widest trailer stays clear of the outer lane.
                o = _object(cat, 0.0, side * (PARKING_EDGE + 1.4) + rng.uniform(-0.1, 0.1), 0.0, yaw, rng, attr)
                if cat == "vehicle.motorcycle":  # parked without rider
                    o.size = (o.size[0], o.size[1], 1.15)
                    o.parts = _parts(cat, o.size, rng)
                o.s0 = s + o.size[1] / 2
                objects.append(o)
                s += o.size[1] + rng.uniform(1.5, 8.0)
            else:
                # An empty stretch, sometimes with cones or barriers that fit inside it.
                gap = rng.uniform(4.0, 10.0)
                kind = rng.random()
                if kind < 0.4:  # a few traffic cones
                    for k in range(min(rng.integers(2, 5), int((gap - 1.0) / 1.5))):
                        objects.append(_object("movable_object.trafficcone", s + 1 + 1.5 * k,
                                               side * (PARKING_EDGE + rng.uniform(0.5, 2.0)), 0.0, 0.0, rng, ""))
                elif kind < 0.7:  # a row of barriers along the curb
                    for k in range(min(rng.integers(2, 4), int((gap - 0.2) / 2.9))):  # barriers are <= 2.8 m long
                        objects.append(_object("movable_object.barrier", s + 1.65 + 2.9 * k,
                                               side * (CURB - 0.6), 0.0, 0.0, rng, ""))
                s += gap
    # Pedestrians on the sidewalks, walking along the road or standing.
    for side in (-1, 1):
        for _ in range(rng.poisson(0.09 * (ego_end + 2 * reach))):
            walking = rng.random() < 0.7
            v = rng.choice([-1, 1]) * rng.uniform(0.8, 1.6) if walking else 0.0
            objects.append(_object("human.pedestrian.adult", rng.uniform(-reach, ego_end + reach),
                                   side * rng.uniform(CURB + 0.8, SIDEWALK_END - 0.5), v,
                                   (0.0 if v >= 0 else math.pi) + rng.normal(0, 0.1) if walking else rng.uniform(0, 2 * math.pi),
                                   rng, "pedestrian.moving" if walking else "pedestrian.standing"))
    # Buildings (scenery, not annotated) behind the sidewalks.
    for side in (-1, 1):
        s = -reach - 40
        while s < ego_end + reach + 40:
            length, depth, height = rng.uniform(10, 35), rng.uniform(8, 16), rng.uniform(6, 28)
            tone = rng.uniform(0.45, 0.8) * np.array([1.0, rng.uniform(0.85, 1.0), rng.uniform(0.7, 0.95)])
            o = Obj("", (depth, length, height), s + length / 2, side * (BUILDING_START + depth / 2 + rng.uniform(0, 3)),
                    0.0, 0.0)
            o.parts = [_box(0, 0, 0, depth, length, height, tone)]
            objects.append(o)
            s += length + rng.uniform(0.0, 8.0)

    sun_az, sun_el = rng.uniform(0, 2 * math.pi), rng.uniform(0.5, 1.1)
    sun = np.array([math.cos(sun_az) * math.cos(sun_el), math.sin(sun_az) * math.cos(sun_el), math.sin(sun_el)])
    origin = rng.uniform(150.0, 350.0, size=2)
    return World(origin, rng.uniform(-math.pi, math.pi), 0.0, ego_speed, ego_l, wobble, sun, objects)


# ----------------------------------------------------------------------------- rendering

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


def _ground_colour(s: np.ndarray, l: np.ndarray) -> np.ndarray:
    """Road surface colour at road coordinates (s, l): asphalt, lane markings, curbs, sidewalks, grass."""
    al = np.abs(l)
    noise = _hash(np.floor(s * 2), np.floor(l * 2)).astype(np.float32)
    col = np.empty(s.shape + (3,), np.float32)
    asphalt = 0.3 + 0.025 * noise
    col[...] = asphalt[..., None]
    park = (al > PARKING_EDGE) & (al <= CURB)
    col[park] = (asphalt[park] + 0.03)[:, None]
    curb = (al > CURB) & (al <= CURB + 0.25)
    col[curb] = 0.75
    walk = (al > CURB + 0.25) & (al <= SIDEWALK_END)
    seam = (np.abs(((s + 0.75) % 1.5) - 0.75) < 0.03) & walk
    col[walk] = (0.58 + 0.05 * noise[walk])[:, None]
    col[seam] = 0.45
    grass = al > SIDEWALK_END
    col[grass] = np.stack([0.22 + 0.06 * noise[grass], 0.38 + 0.06 * noise[grass], 0.16 + 0.03 * noise[grass]], -1)
    # Markings: double yellow centre line, dashed white lane lines, solid white edge lines.
    yellow = np.abs(al - 0.15) < 0.07
    col[yellow] = (0.85, 0.7, 0.15)
    dashed = (np.abs(al - LANE_W) < 0.08) & ((s % 9.0) < 3.0)
    edge = np.abs(al - PARKING_EDGE) < 0.08
    col[dashed | edge] = 0.9
    return col


# The road texture repeats every TEX_PERIOD metres along s (a multiple of the 9 m dash and
# 1.5 m tile periods), so it is tabulated once at TEX_RES and looked up per pixel.
TEX_PERIOD, TEX_RES, TEX_HALF_WIDTH = 36.0, 0.05, 40.0


@lru_cache(maxsize=1)
def _ground_texture() -> np.ndarray:
    s = (np.arange(int(TEX_PERIOD / TEX_RES)) + 0.5) * TEX_RES
    l = (np.arange(int(2 * TEX_HALF_WIDTH / TEX_RES)) + 0.5) * TEX_RES - TEX_HALF_WIDTH
    return _ground_colour(*np.meshgrid(s, l, indexing="ij"))


def _ground_lookup(s: np.ndarray, l: np.ndarray) -> np.ndarray:
    tex = _ground_texture()
    rows = ((s % TEX_PERIOD) * (1 / TEX_RES)).astype(np.int64) % tex.shape[0]
    cols = np.clip(((l + TEX_HALF_WIDTH) * (1 / TEX_RES)).astype(np.int64), 0, tex.shape[1] - 1)
    return tex[rows, cols]


def _sky_colour(elev: np.ndarray) -> np.ndarray:
    e = np.clip(elev, 0, 1)[..., None]
    return (np.array([0.78, 0.85, 0.92], np.float32) * (1 - e) + np.array([0.35, 0.55, 0.85], np.float32) * e)


def _object_parts_ego(world: World, t: float, obj_indices) -> tuple[list, np.ndarray, np.ndarray]:
    """Ego-frame boxes of the given objects at time t: [(obj_index, R (3,3), centre (3,), half, colours (6,3))]."""
    ego_t, ego_yaw = world.ego_pose(t)
    c, s = math.cos(ego_yaw), math.sin(ego_yaw)
    R_eg = np.array([[c, s, 0], [-s, c, 0], [0, 0, 1.0]])  # global -> ego rotation
    rel = world.heading - ego_yaw  # road frame -> ego rotation angle
    cr, sr = math.cos(rel), math.sin(rel)
    sun_ego = np.array([cr * world.sun[0] - sr * world.sun[1], sr * world.sun[0] + cr * world.sun[1], world.sun[2]])
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


def visible_objects(world: World, t: float, radius: float) -> list[int]:
    """Indices of objects (annotated or scenery) whose centre is within `radius` of the ego (xy)."""
    s_e, l_e, _ = world.ego_road(t)
    out = []
    for i, o in enumerate(world.objects):
        ds, dl = o.s_at(t) - s_e, o.l - l_e
        extent = o.size[1] / 2 if o.category == "" else 0.0  # buildings are long: use their near end
        if math.hypot(max(abs(ds) - extent, 0.0), dl) < radius:
            out.append(i)
    return out


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
    post_rot / post_tran (bev.data.render.downscale), e.g. through bev.geometry.ego_to_image.
    `objects` defaults to everything within RENDER_RANGE; `parts` (from render_sample) skips
    recomputing the ego-frame boxes per camera.
    """
    cam = make_camera(camera, scale) if isinstance(camera, str) else camera
    if objects is None:
        objects = visible_objects(world, t, RENDER_RANGE)
    rays = cam.rays
    H, W = cam.shape
    C = cam.translation.astype(np.float32)

    # Ground plane z = 0 (fixed per camera) textured in road coordinates, sky above.
    t_ground, ground, gx, gy, haze = cam.ground
    s_e, l_e, yaw_e = world.ego_road(t)
    cy, sy = math.cos(yaw_e), math.sin(yaw_e)
    s = s_e + cy * gx - sy * gy  # ego -> road coordinates
    l = l_e + sy * gx + cy * gy
    img = cam.sky.copy()
    img[ground] = _ground_lookup(s, l) * (1 - haze) + np.array([0.72, 0.78, 0.85], np.float32) * haze
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
