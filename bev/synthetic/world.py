"""The synthetic world: scene layout (road, objects, their motion) and the ego trajectory.

A scene is a straight urban road (4 driving lanes, 2 parking lanes, sidewalks, buildings)
in a flat world (ground at z = 0). The ego vehicle drives along it; other vehicles drive
in the lanes or are parked at the sides; pedestrians, barriers and traffic cones are
non-vehicle distractors. Every object is a union of axis-aligned boxes ("parts") in its own
frame (rendered by bev.synthetic.raycast).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

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
