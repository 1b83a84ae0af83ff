"""The synthetic world of one scene: a drive through its location's road network.

The network and its map geometry come from bev.synthetic.roads (one per location, shared by
the scenes there). The ego follows a random route through the lanes, turning at junctions;
other vehicles (cars, trucks, buses, construction vehicles, motorcycles, bicycles) drive their own
random routes or are parked at the kerb (trailers too) and in the car park; cycles carry a rider when
they move; pedestrians walk or stand on the walkways; barriers and cones stand in the parking lanes;
one object of every detection class is placed near the ego at the start of each drive (_showcase);
buildings line the blocks and traffic lights stand at the stop lines. No two vehicle (or
barrier / cone) footprints overlap at any key frame, the ego's included: candidates that
would are dropped. Every object is a union of axis-aligned boxes ("parts") in its own frame,
rendered by bev.synthetic.raycast. Flat world (ground z = 0); the global frame is the map frame.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import shapely

from bev.synthetic.roads import (
    CROSSING,
    CURB,
    LANE_W,
    LANES,
    PARKING_EDGE,
    SIDEWALK_END,
    Path,
    RoadMap,
    road_map,
)

ANNOTATION_RANGE = 60.0  # objects within this ego distance (xy) are annotated
RENDER_RANGE = 90.0  # objects farther than this are not drawn at all (they would be a few pixels)
SAMPLE_DT = 0.5  # key frames at 2 Hz, as in nuScenes
EGO_SIZE = (1.9, 4.6, 1.7)  # (w, l, h) of the ego footprint kept clear of other vehicles
CLEARANCE = 0.1  # metres between any two vehicle footprints

# Part kinds: how a part's faces are coloured. CABIN: side windows framed by painted pillars
# and a painted roof; WINDOWS: a band of bus windows with mullions.
SOLID, CABIN, DARK, WINDOWS = 0, 1, 2, 3


@dataclass
class Obj:
    """One annotated (or scenery) object: its motion and its boxes in its own frame."""

    category: str  # nuScenes category name; "" for scenery (buildings, traffic lights): never annotated
    size: tuple[float, float, float]  # (w, l, h) as in sample_annotation.size
    parts: list = field(default_factory=list)  # (centre (3,), half extents (3,), rgb (3,), kind)
    attribute: str = ""
    path: Path | None = None  # moving objects follow a path at `speed` from arclength s0, l metres to its left
    s0: float = 0.0
    speed: float = 0.0
    l: float = 0.0
    yaw: float = 0.0  # heading relative to the path (moving) or in the global frame (static)
    xy: tuple[float, float] = (0.0, 0.0)  # static objects' global position

    def pose(self, t) -> tuple[np.ndarray, np.ndarray]:
        """Global xy (..., 2) and yaw (...) at time(s) t."""
        t = np.asarray(t, dtype=np.float64)
        if self.path is None:
            return np.broadcast_to(np.asarray(self.xy, np.float64), t.shape + (2,)), np.full(t.shape, self.yaw)
        xy, h = self.path.at(self.s0 + self.speed * t, self.l)
        return xy, h + self.yaw


@dataclass
class World:
    """A scene: its location's road map, the ego's route and the objects."""

    seed: int
    location: str
    road: RoadMap
    ego: Obj  # the ego's route (path, speed); never drawn
    wobble: tuple[float, float, float]  # lateral wobble within the lane (amplitude, angular freq, phase)
    sun: np.ndarray  # unit vector to the sun, global frame
    objects: list[Obj]
    _xy: dict = field(default_factory=dict, repr=False)  # t -> poses(t)
    _ego: dict = field(default_factory=dict, repr=False)  # t -> ego_pose(t): a sample asks ~10 times
    _parts: list = field(default_factory=list, repr=False)  # every object's parts as arrays (raycast._part_rows)

    def ego_pose(self, t: float) -> tuple[np.ndarray, float]:
        """Global translation (3,) and yaw of the ego at time t (flat world: z = 0)."""
        if t not in self._ego:
            a, w, p = self.wobble
            xy, h = self.ego.path.at(self.ego.s0 + self.ego.speed * t, a * math.sin(w * t + p))
            yaw = float(h) + math.atan2(a * w * math.cos(w * t + p), self.ego.speed)
            self._ego[t] = np.array([xy[0], xy[1], 0.0]), yaw
        xy, yaw = self._ego[t]
        return xy.copy(), yaw

    def object_global(self, obj: Obj, t: float) -> tuple[np.ndarray, float]:
        """Global box centre (3,) and yaw of an object at time t."""
        xy, yaw = obj.pose(t)
        return np.array([xy[0], xy[1], obj.size[2] / 2]), float(yaw)

    def object_pose(self, i: int, t: float) -> tuple[np.ndarray, float]:
        """object_global of object i, the same values, from the poses of time t (poses)."""
        xy, yaw = self.poses(t)
        return np.array([xy[i, 0], xy[i, 1], self.objects[i].size[2] / 2]), float(yaw[i])

    def positions(self, t: float) -> np.ndarray:
        """(N, 2) global xy of every object at time t (poses)."""
        return self.poses(t)[0]

    def poses(self, t: float) -> tuple[np.ndarray, np.ndarray]:
        """Global xy (N, 2) and yaw (N,) of every object at time t (cached; after the first time only moving
        objects are recomputed: most objects are static)."""
        if t not in self._xy:
            if self._xy:
                xy, yaw = (a.copy() for a in next(iter(self._xy.values())))
                for i, o in enumerate(self.objects):
                    if o.path is not None:
                        xy[i], yaw[i] = o.pose(t)
            else:
                xy, yaw = np.zeros((len(self.objects), 2)), np.zeros(len(self.objects))
                for i, o in enumerate(self.objects):
                    xy[i], yaw[i] = o.pose(t)
            self._xy[t] = xy, yaw
        return self._xy[t]

    def cache_poses(self, times) -> None:
        """poses(t) for every t of `times`, the same values, with one path lookup per moving object for them all."""
        todo = [t for t in dict.fromkeys(float(t) for t in times) if t not in self._xy]
        if not todo:
            return
        xy, yaw = np.zeros((len(todo), len(self.objects), 2)), np.zeros((len(todo), len(self.objects)))
        for i, o in enumerate(self.objects):
            xy[:, i], yaw[:, i] = o.pose(np.array(todo))
        for k, t in enumerate(todo):
            self._xy[t] = xy[k], yaw[k]


def visible_objects(world: World, t: float, radius: float) -> list[int]:
    """Indices of objects (annotated or scenery) within `radius` of the ego (xy; scenery by its near end)."""
    ego = world.ego_pose(t)[0][:2]
    d = np.linalg.norm(world.positions(t) - ego, axis=1)
    extent = np.array([o.size[1] / 2 if not o.category else 0.0 for o in world.objects])
    return np.flatnonzero(np.maximum(d - extent, 0.0) < radius).tolist()


def annotated_objects(world: World, t: float) -> list[int]:
    """Objects annotated at time t: every non-scenery object whose centre is within ANNOTATION_RANGE (xy)."""
    ego = world.ego_pose(t)[0][:2]
    d = np.linalg.norm(world.positions(t) - ego, axis=1)
    return [i for i in np.flatnonzero(d <= ANNOTATION_RANGE).tolist() if world.objects[i].category]


# ----------------------------------------------------------------------------- object shapes

# (w, l, h) means and spreads, metres, close to the nuScenes class statistics. Cycles are the ridden
# size; parked ones (no rider) are CYCLE_PARKED_H tall.
SIZES = {
    "vehicle.car": ((1.95, 4.6, 1.7), (0.1, 0.35, 0.15)),
    "vehicle.truck": ((2.5, 7.5, 3.0), (0.15, 1.0, 0.4)),  # l >= 5.5: the centre stays inside the cargo box
    "vehicle.construction": ((2.8, 6.4, 3.2), (0.15, 0.6, 0.25)),
    "vehicle.bus.rigid": ((2.9, 11.5, 3.5), (0.1, 0.8, 0.2)),
    "vehicle.trailer": ((2.6, 11.0, 3.6), (0.1, 1.2, 0.3)),
    "vehicle.motorcycle": ((0.8, 2.1, 1.5), (0.08, 0.15, 0.1)),
    "vehicle.bicycle": ((0.6, 1.7, 1.7), (0.04, 0.08, 0.08)),
    "human.pedestrian.adult": ((0.65, 0.7, 1.75), (0.08, 0.1, 0.1)),
    "movable_object.barrier": ((0.5, 2.2, 1.0), (0.05, 0.3, 0.1)),
    "movable_object.trafficcone": ((0.4, 0.4, 0.75), (0.03, 0.03, 0.08)),
}
CYCLES = ("vehicle.motorcycle", "vehicle.bicycle")
CYCLE_PARKED_H = {"vehicle.motorcycle": 1.15, "vehicle.bicycle": 1.1}
# Bicycles join a lane's traffic only where it is slow enough for them (m/s); else a car takes the place.
BICYCLE_MAX_SPEED = 7.0
MOVING_MIX = (
    ("vehicle.car", 0.72),
    ("vehicle.truck", 0.1),
    ("vehicle.bus.rigid", 0.08),
    ("vehicle.motorcycle", 0.06),
    ("vehicle.bicycle", 0.02),
    ("vehicle.construction", 0.02),
)
PARKED_MIX = (
    ("vehicle.car", 0.68),
    ("vehicle.truck", 0.08),
    ("vehicle.trailer", 0.1),
    ("vehicle.construction", 0.04),
    ("vehicle.motorcycle", 0.05),
    ("vehicle.bicycle", 0.05),
)


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
    if category.startswith("vehicle.") and category not in CYCLES:
        # Contact shadow: a dark 2 cm slab filling the footprint under the body overhang.
        w, l, h = size
        parts.insert(0, _box(0, 0, -h / 2 + 0.01, w, l, 0.02, SHADOW, DARK))
    return parts


def _shape(category: str, size, rng: np.random.Generator) -> list:
    """The category's boxes (see _SHAPES) for an object of `size` (w, l, h)."""
    if category not in _SHAPES:
        raise ValueError(f"no shape for category {category!r}")
    return _SHAPES[category](*size, rng)


# Each shape below takes the object's (w, l, h) and works in its frame: x forward, y left, z up
# from z0 = -h / 2, the ground.


def _car(w, l, h, rng: np.random.Generator) -> list:
    """Tyres, a painted body and a cabin with windows."""
    z0 = -h / 2
    paint = _vehicle_colour(rng)
    body_h = 0.58 * h
    return [
        _box(0, 0, z0 + 0.2, 0.92 * w, 0.8 * l, 0.4, TYRE, DARK),
        _box(0, 0, z0 + 0.3 + (body_h - 0.3) / 2, w, l, body_h - 0.3, paint),
        _box(-0.05 * l, 0, z0 + body_h + (h - body_h) / 2, 0.86 * w, 0.52 * l, h - body_h, paint, CABIN),
    ]


def _truck(w, l, h, rng: np.random.Generator) -> list:
    """Tyres, a cab at the front with its windows, and a cargo box of another colour."""
    z0 = -h / 2
    paint, cargo = _vehicle_colour(rng), _vehicle_colour(rng)
    cab_l = 2.2
    return [
        _box(0, 0, z0 + 0.3, 0.9 * w, 0.9 * l, 0.6, TYRE, DARK),
        _box(l / 2 - cab_l / 2, 0, z0 + 0.5 + 0.3 * (h - 0.5), w, cab_l, 0.6 * (h - 0.5), paint),
        _box(
            l / 2 - cab_l / 2 - 0.1,
            0,
            z0 + 0.5 + 0.6 * (h - 0.5) + 0.175 * (h - 0.5),
            0.95 * w,
            cab_l - 0.2,
            0.35 * (h - 0.5),
            paint,
            CABIN,
        ),
        _box(-cab_l / 2 - 0.15, 0, z0 + 0.6 + (h - 0.6) / 2, w, l - cab_l - 0.3, h - 0.6, cargo),
    ]


def _bus(w, l, h, rng: np.random.Generator) -> list:
    """Tyres and a painted body with a band of windows near the top."""
    z0 = -h / 2
    paint = _vehicle_colour(rng)
    return [
        _box(0, 0, z0 + 0.25, 0.9 * w, 0.85 * l, 0.5, TYRE, DARK),
        _box(0, 0, z0 + 0.4 + 0.25 * (h - 0.4), w, l, 0.5 * (h - 0.4), paint),
        _box(0, 0, z0 + 0.4 + 0.65 * (h - 0.4), 0.98 * w, 0.98 * l, 0.3 * (h - 0.4), paint, WINDOWS),
        _box(0, 0, z0 + 0.4 + 0.9 * (h - 0.4), w, l, 0.2 * (h - 0.4), paint),
    ]


def _trailer(w, l, h, rng: np.random.Generator) -> list:
    """Rear wheels under a high painted box."""
    z0 = -h / 2
    paint = _vehicle_colour(rng)
    return [
        _box(-0.3 * l, 0, z0 + 0.55, 0.9 * w, 0.3 * l, 1.1, TYRE, DARK),
        _box(0, 0, z0 + 1.1 + (h - 1.1) / 2, w, l, h - 1.1, paint),
    ]


def _motorcycle(w, l, h, rng: np.random.Generator) -> list:
    """Wheels and a painted body, and a rider where the object is tall enough to carry one."""
    z0 = -h / 2
    paint = _vehicle_colour(rng)
    parts = [
        _box(0, 0, z0 + 0.35, 0.3, l, 0.7, TYRE, DARK),
        _box(0, 0, z0 + 0.85, 0.6 * w, 0.7 * l, 0.4, paint),
    ]
    if h > 1.3:  # with a rider: torso and helmet
        parts += [
            _box(-0.1 * l, 0, z0 + 1.25, 0.8 * w, 0.25 * l, h - 1.1 - 0.25, _vehicle_colour(rng)),
            _box(-0.05 * l, 0, z0 + h - 0.13, 0.3, 0.3, 0.26, paint),
        ]
    return parts


def _bicycle(w, l, h, rng: np.random.Generator) -> list:
    """Two thin wheels, a frame, a saddle and a handlebar, and a rider where the object is tall enough."""
    z0 = -h / 2
    paint = _vehicle_colour(rng)
    parts = [
        _box(0.32 * l, 0, z0 + 0.33, 0.08, 0.36 * l, 0.66, TYRE, DARK),
        _box(-0.32 * l, 0, z0 + 0.33, 0.08, 0.36 * l, 0.66, TYRE, DARK),
        _box(0, 0, z0 + 0.6, 0.1, 0.6 * l, 0.35, paint),
        _box(-0.12 * l, 0, z0 + 0.84, 0.14, 0.22, 0.08, TYRE, DARK),
        _box(0.28 * l, 0, z0 + 0.95, 0.9 * w, 0.08, 0.08, (0.3, 0.3, 0.32)),
    ]
    if h > 1.4:  # with a rider: legs, torso and helmet
        parts += [
            _box(-0.05 * l, 0, z0 + 0.75, 0.36, 0.3, 0.6, np.array([0.15, 0.17, 0.3]) * rng.uniform(0.7, 1.5)),
            _box(-0.02 * l, 0, z0 + 1.05 + (h - 1.31) / 2, 0.7 * w, 0.3, h - 1.31, _vehicle_colour(rng)),
            _box(0, 0, z0 + h - 0.13, 0.22, 0.24, 0.26, paint),
        ]
    return parts


def _construction(w, l, h, rng: np.random.Generator) -> list:
    """Tracks, a machine body in work-site yellow, a cab to one side and an arm reaching forward to a bucket."""
    z0 = -h / 2
    yellow = np.array([0.95, rng.uniform(0.55, 0.75), 0.08]) * rng.uniform(0.8, 1.0)
    top = h - 0.9  # above the tracks
    return [
        _box(0, 0, z0 + 0.45, w, 0.85 * l, 0.9, TYRE, DARK),
        _box(-0.1 * l, 0, z0 + 0.9 + 0.225 * top, 0.95 * w, 0.7 * l, 0.45 * top, yellow),
        _box(0.02 * l, -0.22 * w, z0 + 0.9 + 0.45 * top + 0.275 * top, 0.5 * w, 0.3 * l, 0.55 * top, yellow, CABIN),
        _box(0.33 * l, 0.2 * w, z0 + 0.9 + 0.6 * top, 0.25, 0.3 * l, 0.25 * top, yellow),
        _box(0.45 * l, 0, z0 + 0.45, 0.8 * w, 0.1 * l, 0.8, (0.3, 0.3, 0.3)),
    ]


def _pedestrian(w, l, h, rng: np.random.Generator) -> list:
    """Legs, a shirt and a head."""
    z0 = -h / 2
    shirt = _vehicle_colour(rng)
    legs = np.array([0.15, 0.17, 0.3]) * rng.uniform(0.7, 1.5)
    return [
        _box(0, 0, z0 + 0.42, 0.36, 0.25, 0.84, legs),
        _box(0, 0, z0 + 0.84 + 0.3, 0.5 * w / 0.65, 0.3, 0.6, shirt),
        _box(0, 0, z0 + h - 0.15, 0.22, 0.24, 0.3, np.array([0.85, 0.65, 0.5]) * rng.uniform(0.5, 1.0)),
    ]


def _barrier(w, l, h, rng: np.random.Generator) -> list:
    """A grey foot under a white board."""
    z0 = -h / 2
    return [
        _box(0, 0, z0 + 0.15, 0.6 * w, 0.9 * l, 0.3, (0.6, 0.6, 0.6)),
        _box(0, 0, z0 + 0.3 + (h - 0.3) / 2, 0.4 * w, l, h - 0.3, (0.95, 0.95, 0.92)),
    ]


def _trafficcone(w, l, h, rng: np.random.Generator) -> list:
    """A black base, an orange cone and a white tip."""
    z0 = -h / 2
    orange = (1.0, 0.45, 0.05)
    return [
        _box(0, 0, z0 + 0.02, w, l, 0.04, (0.1, 0.1, 0.1)),
        _box(0, 0, z0 + 0.04 + 0.3 * (h - 0.04), 0.6 * w, 0.6 * l, 0.6 * (h - 0.04), orange),
        _box(0, 0, z0 + 0.04 + 0.8 * (h - 0.04), 0.3 * w, 0.3 * l, 0.4 * (h - 0.04), (0.95, 0.95, 0.95)),
    ]


_SHAPES = {
    "vehicle.car": _car,
    "vehicle.truck": _truck,
    "vehicle.bus.rigid": _bus,
    "vehicle.trailer": _trailer,
    "vehicle.motorcycle": _motorcycle,
    "vehicle.bicycle": _bicycle,
    "vehicle.construction": _construction,
    "human.pedestrian.adult": _pedestrian,
    "movable_object.barrier": _barrier,
    "movable_object.trafficcone": _trafficcone,
}


def _object(category: str, rng: np.random.Generator, attribute: str = "") -> Obj:
    mean, spread = SIZES[category]
    # Within 2 spreads of the mean, squashed smoothly (tanh) rather than clipped: clipping gave 1 object in
    # 20 the very same extreme size, which real annotations never repeat.
    size = tuple(float(m + d * 2 * math.tanh(rng.standard_normal() / 2)) for m, d in zip(mean, spread))
    return Obj(category, size, _parts(category, size, rng), attribute)


def _vehicle(category: str, rng: np.random.Generator, moving: bool, attribute: str = "") -> Obj:
    """A vehicle with the attribute the devkit scores: cycles ridden when moving (parked ones without
    rider, lower), other vehicles moving or parked (or `attribute`, e.g. vehicle.stopped)."""
    if category not in CYCLES:
        return _object(category, rng, attribute or ("vehicle.moving" if moving else "vehicle.parked"))
    o = _object(category, rng, "cycle.with_rider" if moving else "cycle.without_rider")
    if not moving:
        o.size = (o.size[0], o.size[1], CYCLE_PARKED_H[category])
        o.parts = _parts(category, o.size, rng)
    return o


# ----------------------------------------------------------------------------- no overlaps


def _corners(c: np.ndarray, yaw: np.ndarray, half: np.ndarray) -> np.ndarray:
    """(P, 4, 2) corners of rectangles with centres (P, 2), yaws (P,), half (length, width) (P, 2)."""
    ax = np.stack([np.cos(yaw), np.sin(yaw)], -1) * half[:, :1]
    ay = np.stack([-np.sin(yaw), np.cos(yaw)], -1) * half[:, 1:]
    return c[:, None] + np.stack([ax + ay, ax - ay, -ax - ay, -ax + ay], 1)


def rectangles_overlap(c1, yaw1, half1, c2, yaw2, half2) -> np.ndarray:
    """Whether pairs of rectangles overlap (separating-axis test), all arrays with a leading pair axis."""
    a, b = _corners(c1, yaw1, half1), _corners(c2, yaw2, half2)
    separated = np.zeros(len(a), bool)
    for yaw in (yaw1, yaw1 + math.pi / 2, yaw2, yaw2 + math.pi / 2):
        axis = np.stack([np.cos(yaw), np.sin(yaw)], -1)
        pa, pb = np.einsum("pkd,pd->pk", a, axis), np.einsum("pkd,pd->pk", b, axis)
        separated |= (pa.max(1) < pb.min(1)) | (pb.max(1) < pa.min(1))
    return ~separated


class _Fleet:
    """Footprints of the vehicles, barriers and cones placed so far, at every key frame."""

    def __init__(self):
        self.n = 0  # footprints held: the first n rows of the buffers (grown by doubling, not by a copy per add)
        self.x = self.y = self.yaw = self.half = None  # (capacity, T) centres and yaws, (capacity, 2) half sizes
        self.lo = self.hi = None  # (capacity, 2) corners of each track's bounding box

    def add(self, xy: np.ndarray, yaw: np.ndarray, size) -> bool:
        """Place a footprint track ((T, 2) centres, (T,) yaws) unless it overlaps one already placed."""
        half = np.array([size[1], size[0]]) / 2 + CLEARANCE / 2
        n_ = self.n
        if n_:
            reach = np.linalg.norm(self.half[:n_], axis=1) + np.linalg.norm(half)
            # Only tracks whose bounding boxes come within reach can come within reach at a key frame.
            lo, hi = xy.min(0), xy.max(0)
            gap = np.maximum(np.maximum(self.lo[:n_] - hi, lo - self.hi[:n_]), 0.0).max(1)
            rows = np.flatnonzero(gap <= reach + 1.0)
            # x and y apart: the squared distance is the same sum, without a reduction over a 2-long axis
            d2 = np.square(self.x[rows] - xy[:, 0]) + np.square(self.y[rows] - xy[:, 1])  # (rows, T)
            n, k = np.nonzero(d2 < np.square(reach[rows])[:, None])
            n = rows[n]
            if (
                len(n)
                and rectangles_overlap(
                    np.stack([self.x[n, k], self.y[n, k]], -1),
                    self.yaw[n, k],
                    self.half[n],
                    xy[k],
                    yaw[k],
                    np.broadcast_to(half, (len(k), 2)),
                ).any()
            ):
                return False
        if self.x is None or n_ == len(self.x):
            grow = lambda a, shape: np.concatenate([a[:n_], np.empty(shape)]) if n_ else np.empty(shape)  # noqa: E731
            cap = max(64, 2 * n_)
            self.x, self.y = grow(self.x, (cap, len(xy))), grow(self.y, (cap, len(xy)))
            self.yaw, self.half = grow(self.yaw, (cap, len(yaw))), grow(self.half, (cap, 2))
            self.lo, self.hi = grow(self.lo, (cap, 2)), grow(self.hi, (cap, 2))
        self.x[n_], self.y[n_], self.yaw[n_], self.half[n_] = xy[:, 0], xy[:, 1], yaw, half
        self.lo[n_], self.hi[n_] = xy.min(0), xy.max(0)  # the track's bounding box
        self.n = n_ + 1
        return True


# ----------------------------------------------------------------------------- the scene


def ego_route(road: RoadMap, rng: np.random.Generator, samples: int) -> tuple[Obj, tuple[float, float, float]]:
    """The ego's drive (a random route from a random lane position) and its lateral wobble."""
    duration = (samples - 1) * SAMPLE_DT
    speed = rng.uniform(5.0, 9.0)
    street = int(rng.integers(len(road.streets)))
    dirn, k = int(rng.choice([-1, 1])), int(rng.integers(LANES))
    lane = road.lane_path(street, dirn, k)
    route = road.route(rng, street, dirn, k, rng.uniform(0.0, lane.length), speed * duration + 20.0)
    wobble = (rng.uniform(0.05, 0.3), rng.uniform(0.2, 0.5), rng.uniform(0, 2 * math.pi))
    return Obj("", EGO_SIZE, path=route, speed=speed), wobble


def scene_rng(seed: int, scene: int) -> np.random.Generator:
    return np.random.default_rng([seed, scene])


def build_world(seed: int, scene: int, samples: int, location: str) -> World:
    """The deterministic world of scene number `scene` for `seed` at `location`, sized for `samples` key frames."""
    road = road_map(seed, location)
    rng = scene_rng(seed, scene)
    ego, wobble = ego_route(road, rng, samples)  # first: ego_route(road, scene_rng(...), samples) gives the same drive
    sun_az, sun_el = rng.uniform(0, 2 * math.pi), rng.uniform(0.5, 1.1)
    sun = np.array([math.cos(sun_az) * math.cos(sun_el), math.sin(sun_az) * math.cos(sun_el), math.sin(sun_el)])
    world = World(seed, location, road, ego, wobble, sun, [])
    placer = _Placer.start(world, rng, np.arange(samples) * SAMPLE_DT)
    # Each step draws from the one random stream in turn: their order fixes every scene.
    streets = placer.streets_near()
    _showcase(placer, np.random.default_rng([seed, scene, SHOWCASE_STREAM]), streets)
    for i in streets:
        for sd in (-1, 1):
            _line_kerb(placer, _Kerb(i, road.streets[i].path, sd, road.driveways))
    _park_in_bays(placer)
    _add_traffic(placer)
    _add_pedestrians(placer, streets)
    _add_scenery(placer)
    return world


def _static(o: Obj, xy, yaw) -> Obj:
    """o, standing still at global xy (its first two values) with global yaw."""
    o.xy, o.yaw = (float(xy[0]), float(xy[1])), float(yaw)
    return o


@dataclass
class _Placer:
    """A world being filled with objects, and what the steps that fill it share."""

    world: World
    rng: np.random.Generator
    times: np.ndarray  # (T,) key-frame times
    ego_xy: np.ndarray  # (T, 2) the ego's position at each
    fleet: _Fleet  # footprints placed so far, the ego's first

    @classmethod
    def start(cls, world: World, rng: np.random.Generator, times: np.ndarray) -> _Placer:
        """An empty world's state: only the ego's footprint placed."""
        poses = [world.ego_pose(t) for t in times]
        ego_xy, ego_yaw = np.array([p[0][:2] for p in poses]), np.array([p[1] for p in poses])
        fleet = _Fleet()
        fleet.add(ego_xy, ego_yaw, EGO_SIZE)
        return cls(world, rng, times, ego_xy, fleet)

    @property
    def duration(self) -> float:
        """Seconds from the first key frame to the last."""
        return float(self.times[-1])

    def near(self, xy, r=RENDER_RANGE + 10.0) -> bool:
        """Whether a static point ever comes within r of the ego."""
        return bool(np.min(np.linalg.norm(self.ego_xy - np.asarray(xy)[:2], axis=1)) < r)

    def place(self, o: Obj) -> bool:
        """Add a vehicle, barrier or cone unless its footprint would overlap one placed before; whether it was."""
        xy, yaw = o.pose(self.times)
        if self.fleet.add(np.array(xy), np.array(yaw), o.size):
            self.world.objects.append(o)
            return True
        return False

    def streets_near(self) -> list[int]:
        """Streets that come within render range (plus a margin) of the ego."""
        return [
            i
            for i, st in enumerate(self.world.road.streets)
            if np.min(np.linalg.norm(st.path.xy[::20, None] - self.ego_xy[None], axis=2)) < RENDER_RANGE + 20.0
        ]


@dataclass
class _Kerb:
    """One side (sd = +1: left, -1: right of the street's direction) of a street's parking lanes."""

    street: int
    path: Path
    sd: int
    driveways: list[tuple[int, int, float, float]]  # RoadMap.driveways

    def clear(self, a: float, b: float) -> bool:
        """Whether arclengths [a, b] are straight and cross no driveway on this side."""
        return self.path.straight(a, b) and not any(
            self.street == di and self.sd == ds and a < d1 and b > d0 for di, ds, d0, d1 in self.driveways
        )


def _line_kerb(placer: _Placer, kerb: _Kerb) -> None:
    """Parked vehicles along a kerb, with cones and barriers in some of the gaps (straight stretches only)."""
    p, rng = kerb.path, placer.rng
    s, end = CROSSING[1] - CURB + 2.0 + rng.uniform(0, 5), p.length - (CROSSING[1] - CURB + 2.0)
    while s < end:
        if rng.random() < 0.45:
            s = _park_at_kerb(placer, kerb, s, end)
            if s is None:
                break
        else:
            s = _kerb_gap(placer, kerb, s, end)


def _park_at_kerb(placer: _Placer, kerb: _Kerb, s: float, end: float) -> float | None:
    """A parked vehicle from arclength s: where the next one may start, or None where it would pass `end`."""
    p, rng, sd = kerb.path, placer.rng, kerb.sd
    yaw_rel = 0.0 if -sd * placer.world.road.side > 0 else math.pi  # facing the traffic on this side
    o = _vehicle(_choice(rng, PARKED_MIX), rng, moving=False)
    length = o.size[1]
    if s + length > end:
        return None
    # Centred 1.4 m into the parking lane: the widest trailer stays clear of the outer lane.
    xy, h = p.at(s + length / 2, sd * (PARKING_EDGE + 1.4) + rng.uniform(-0.1, 0.1))
    if kerb.clear(s, s + length) and placer.near(xy):
        placer.place(_static(o, xy, h + yaw_rel + rng.normal(0, 0.04)))
    return s + (length + rng.uniform(1.5, 8.0))


def _kerb_gap(placer: _Placer, kerb: _Kerb, s: float, end: float) -> float:
    """A gap from arclength s holding a few traffic cones, a row of barriers or nothing; returns its end."""
    p, rng, sd = kerb.path, placer.rng, kerb.sd
    gap = rng.uniform(4.0, 10.0)
    kind = rng.random()
    if kerb.clear(s, s + gap) and s + gap < end:
        if kind < 0.4:  # a few traffic cones
            for c in range(min(rng.integers(2, 5), int((gap - 1.0) / 1.5))):
                xy, h = p.at(s + 1 + 1.5 * c, sd * (PARKING_EDGE + rng.uniform(0.5, 2.0)))
                if placer.near(xy):
                    placer.place(_static(_object("movable_object.trafficcone", rng), xy, h))
        elif kind < 0.7:  # a row of barriers along the kerb
            for c in range(min(rng.integers(2, 4), int((gap - 0.2) / 2.9))):  # barriers are <= 2.8 m long
                xy, h = p.at(s + 1.65 + 2.9 * c, sd * (CURB - 0.6))
                if placer.near(xy):
                    placer.place(_static(_object("movable_object.barrier", rng), xy, h))
    return s + gap


# Every scene shows each detection class near the start of its drive, so that a small set (or the two
# val scenes of the mini split) holds them all with LiDAR points: one of each, placed before anything else
# (nearest the ego at the kerb, a cyclist riding ahead of it, a pedestrian on the walkway) from a random
# stream of their own, so the rest of the scene is drawn as before and only makes room for them. Cars
# are everywhere already. Small objects first: they take the kerb places nearest the ego.
SHOWCASE_STREAM = 38
SHOWCASE_KERB = (
    ("movable_object.trafficcone", ""),
    ("vehicle.bicycle", "cycle.without_rider"),
    ("movable_object.barrier", ""),
    ("vehicle.motorcycle", "cycle.without_rider"),
    ("vehicle.construction", "vehicle.parked"),
    ("vehicle.truck", "vehicle.parked"),
    ("vehicle.trailer", "vehicle.parked"),
    ("vehicle.bus.rigid", "vehicle.stopped"),  # at a stop
)
# Metres from the ego (at the reference key frame) to a showcase object's centre: small objects (cones,
# barriers, cycles: the devkit scores them up to 30 or 40 m) and large vehicles (to 50 m).
SHOWCASE_RANGE = {"small": 25.0, "large": 40.0}
SHOWCASE_FRAME = 2  # the reference key frame (the last of shorter scenes)
CYCLIST_LEAD = 12.0  # metres ahead of the ego that the showcase cyclist starts


def _showcase(placer: _Placer, rng: np.random.Generator, streets: list[int]) -> None:
    """One object of each class but car near the ego at the start of the drive (see SHOWCASE_KERB)."""
    ref = placer.ego_xy[min(SHOWCASE_FRAME, len(placer.ego_xy) - 1)]
    _ride_ahead(placer, rng)
    slots = _kerb_slots(placer, streets, ref)
    for category, attribute in SHOWCASE_KERB:
        if category.startswith("vehicle."):
            o = _vehicle(category, rng, moving=False, attribute=attribute)
        else:
            o = _object(category, rng)
        _park_nearest(placer, o, slots, ref)
    _stand_nearest(placer, rng, slots)


def _kerb_slots(placer: _Placer, streets: list[int], ref: np.ndarray) -> list[tuple[float, _Kerb, float]]:
    """(distance to ref, kerb, arclength) of the parking-lane points of the streets every metre, nearest
    first, within reach of ref, between the crossings as _line_kerb uses them (_park_nearest checks the rest)."""
    road, out = placer.world.road, []
    for i in streets:
        p = road.streets[i].path
        lo = CROSSING[1] - CURB + 2.0
        s = np.arange(lo, p.length - lo, 1.0)
        for sd in (-1, 1):
            d = np.linalg.norm(p.at(s, sd * (PARKING_EDGE + 1.4))[0] - ref, axis=1)
            kerb = _Kerb(i, p, sd, road.driveways)
            out += [(float(d[j]), kerb, float(s[j])) for j in np.flatnonzero(d < SHOWCASE_RANGE["large"])]
    return sorted(out, key=lambda x: x[0])


def _park_nearest(placer: _Placer, o: Obj, slots: list, ref: np.ndarray) -> None:
    """Park o at the free kerb place nearest ref (as _park_at_kerb / _kerb_gap place its kind), if any."""
    half = o.size[1] / 2
    reach = SHOWCASE_RANGE["large" if half > 2.0 else "small"]
    for _, kerb, s in slots:
        lo, hi = CROSSING[1] - CURB + 2.0, kerb.path.length - (CROSSING[1] - CURB + 2.0)
        if not (lo <= s - half and s + half <= hi and kerb.clear(s - half, s + half)):
            continue
        if o.category == "movable_object.barrier":
            xy, h = kerb.path.at(s, kerb.sd * (CURB - 0.6))
        elif o.category == "movable_object.trafficcone":
            xy, h = kerb.path.at(s, kerb.sd * (PARKING_EDGE + 1.0))
        else:  # facing the traffic on this side
            xy, h = kerb.path.at(s, kerb.sd * (PARKING_EDGE + 1.4))
            h = h + (0.0 if -kerb.sd * placer.world.road.side > 0 else math.pi)
        if np.linalg.norm(xy - ref) < reach and placer.place(_static(o, xy, h)):
            return


def _stand_nearest(placer: _Placer, rng: np.random.Generator, slots: list) -> None:
    """A pedestrian standing on the walkway nearest the kerb slots' reference (never on drivable area)."""
    drivable = placer.world.road.layers["drivable_area"][0]["geom"]
    o = _object("human.pedestrian.adult", rng, "pedestrian.standing")
    l = rng.uniform(CURB + 0.8, SIDEWALK_END - 0.5)
    for _, kerb, s in slots:
        xy, h = kerb.path.at(s, kerb.sd * l)
        if not shapely.contains_xy(drivable, xy[0], xy[1]):
            placer.world.objects.append(_static(o, xy, h - math.pi / 2 * kerb.sd))  # facing the street
            return


def _ride_ahead(placer: _Placer, rng: np.random.Generator) -> None:
    """A cyclist riding the ego's route in the next lane of its direction, starting CYCLIST_LEAD ahead and slower."""
    world = placer.world
    start = world.ego.path.at(0.0)[0]
    d = min(float(np.min(np.linalg.norm(st.path.xy - start, axis=1))) for st in world.road.streets)
    inner = d < LANE_W  # the ego is in lane 0: the next lane is on its kerb side (lane_offset's sign)
    o = _vehicle("vehicle.bicycle", rng, moving=True)
    o.path, o.s0 = world.ego.path, world.ego.s0 + CYCLIST_LEAD
    o.speed = min(rng.uniform(3.5, 5.5), 0.8 * world.ego.speed)
    o.l = (-world.road.side if inner else world.road.side) * LANE_W
    placer.place(o)


def _park_in_bays(placer: _Placer) -> None:
    """Cars in some of the car-park bays, facing either way."""
    rng = placer.rng
    for x, y, yaw in placer.world.road.bays:
        if rng.random() < 0.65 and placer.near((x, y)):
            o = _object("vehicle.car", rng, "vehicle.parked")
            placer.place(_static(o, (x, y), yaw + (math.pi if rng.random() < 0.5 else 0.0) + rng.normal(0, 0.03)))


def _add_traffic(placer: _Placer) -> None:
    """Moving traffic: random routes from every lane, one speed per lane; dropped where they would overlap."""
    for i in range(len(placer.world.road.streets)):
        for dirn in (1, -1):
            for k in range(LANES):
                _drive_lane(placer, i, dirn, k)


def _drive_lane(placer: _Placer, i: int, dirn: int, k: int) -> None:
    """Vehicles spaced along lane k of street i (direction dirn), each driving its own route at the lane's speed."""
    road, rng, duration, ego_xy = placer.world.road, placer.rng, placer.duration, placer.ego_xy
    lane = road.lane_path(i, dirn, k)
    v, s = rng.uniform(5.0, 11.0), rng.uniform(0.0, 10.0)
    while s < lane.length:
        cat = _choice(rng, MOVING_MIX)
        if cat == "vehicle.bicycle" and v > BICYCLE_MAX_SPEED:
            cat = "vehicle.car"
        o = _vehicle(cat, rng, moving=True)
        sc = s + o.size[1] / 2
        s += o.size[1] + rng.uniform(6.0, 22.0)
        # Skip vehicles that cannot come into render range during the scene (at up to 11 m/s).
        if (
            sc >= lane.length
            or np.min(np.linalg.norm(lane.at(sc)[0] - ego_xy, axis=1)) > RENDER_RANGE + 11.0 * duration + 10.0
        ):
            continue
        o.path, o.speed = road.route(rng, i, dirn, k, sc, v * duration + 5.0), v
        xy, yaw = o.pose(placer.times)
        if np.min(np.linalg.norm(xy - ego_xy, axis=1)) < RENDER_RANGE + 10.0 and placer.fleet.add(xy, yaw, o.size):
            placer.world.objects.append(o)


def _add_pedestrians(placer: _Placer, streets: list[int]) -> None:
    """Pedestrians on the walkways, walking along the street or standing (never on drivable area)."""
    road, rng, duration = placer.world.road, placer.rng, placer.duration
    drivable = road.layers["drivable_area"][0]["geom"]
    for i in streets:
        p = road.streets[i].path
        for sd in (-1, 1):
            for _ in range(rng.poisson(0.09 * p.length)):
                l = sd * rng.uniform(CURB + 0.8, SIDEWALK_END - 0.5)
                s0 = rng.uniform(0.0, p.length)
                o = _object("human.pedestrian.adult", rng, "pedestrian.moving")
                v = rng.choice([-1, 1]) * rng.uniform(0.8, 1.6)
                if rng.random() < 0.7 and 0.0 <= s0 + v * duration <= p.length:
                    o.path, o.s0, o.speed, o.l, o.yaw = p, s0, v, l, (0.0 if v > 0 else math.pi) + rng.normal(0, 0.1)
                else:
                    xy, _ = p.at(s0, l)
                    _static(o, xy, rng.uniform(0, 2 * math.pi)).attribute = "pedestrian.standing"
                xy, _ = o.pose(placer.times)
                if (
                    placer.near(xy[0], RENDER_RANGE + 10.0 + 1.6 * duration)
                    and not shapely.contains_xy(drivable, xy[:, 0], xy[:, 1]).any()
                ):
                    placer.world.objects.append(o)


def _add_scenery(placer: _Placer) -> None:
    """Scenery near the drive: buildings (their tones drawn from the scene's stream) and traffic lights."""
    road, rng, objects = placer.world.road, placer.rng, placer.world.objects
    for x, y, yaw, w, length, h in road.buildings:
        if placer.near((x, y), RENDER_RANGE + length / 2 + 10.0):
            tone = rng.uniform(0.45, 0.8) * np.array([1.0, rng.uniform(0.85, 1.0), rng.uniform(0.7, 0.95)])
            objects.append(_static(Obj("", (w, length, h), [_box(0, 0, 0, w, length, h, tone)]), (x, y), yaw))
    for tl in road.layers["traffic_light"]:
        x, y, z, yaw = tl["pose"]
        if placer.near((x, y)):
            parts = [
                _box(0, 0, 0, 0.15, 0.15, 4.0, (0.35, 0.36, 0.38)),
                _box(0.1, 0, 1.45, 0.35, 0.3, 0.9, (0.08, 0.08, 0.08), DARK),
            ]
            objects.append(_static(Obj("", (0.35, 0.4, 4.0), parts), (x, y), yaw))
