"""The road network of a synthetic location and its HD-map geometry: one home for both.

Each location (a real nuScenes map name) has ONE network, generated deterministically from
(seed, location): a rotated grid of junctions (blocks of 80-150 m) whose corner nodes become
curved streets, boundary nodes T junctions, interior nodes 4-way junctions, and a few removed
streets add more T junctions and bends. Every street has the same cross-section (lateral
offset l from its centreline, + = left of the direction a -> b):

    |l| < 3.5 inner lane, 3.5..7 outer lane (dashed white line at 3.5, solid white at 7),
    7..9.5 parking lane, 9.5 kerb, 9.5..14 walkway, buildings from 17; double yellow at l = 0.

Junctions are squares (half-size CURB) with a zebra crossing on every arm, a stop line and a
traffic light on every incoming approach; lanes end at LANE_START from the junction node and
lane connectors (straight, or quarter circles) join them across it. Up to CARPARKS blocks hold a
car park with bays, reached by a driveway through the walkway. Traffic drives on the right in Boston
and on the left in Singapore.

The geometry lives here as shapely polygons and lines in the map (global) frame, metres:
`RoadMap.layers` are the nuScenes map-expansion layers (bev.synthetic.mapjson writes them),
`RoadMap.paint` the markings the renderer draws (bev.synthetic.raycast), and vehicles follow
`Path`s through the same lanes: what the map says is what the cameras see.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import cv2
import numpy as np
import shapely
from shapely.geometry import LineString, Polygon
from shapely.ops import unary_union
from shapely.prepared import prep

LOCATIONS = ("boston-seaport", "singapore-onenorth", "singapore-hollandvillage", "singapore-queenstown")
# +1: traffic keeps to the right (Boston), -1: to the left (Singapore).
TRAFFIC_SIDE = {
    "boston-seaport": 1,
    "singapore-onenorth": -1,
    "singapore-hollandvillage": -1,
    "singapore-queenstown": -1,
}

# Cross-section, metres from the street centreline.
LANE_W = 3.5
LANES = 2  # driving lanes per direction
PARKING_EDGE = 7.0
CURB = 9.5
SIDEWALK_END = 14.0
BUILDING_START = 17.0
# Along an arm, metres from the junction node.
CROSSING = (10.5, 14.5)  # zebra crossing band
STOP_LINE = (15.0, 15.5)  # the painted line
# The map's stop_line polygon: as in the nuScenes map expansion, the area where a car waits (the
# incoming lanes from the painted line back 3 m), not the 0.5 m of paint, which a 1 m grid cannot hold.
STOP_AREA = (15.0, 18.0)
LANE_START = 16.0  # lanes start / end here; lane connectors cross the junction in between
BEND_RADIUS = 24.0  # centreline radius of a curved street
GRID = 4  # junction nodes per side
BLOCK = (80.0, 150.0)  # node spacing range
MARGIN = 100.0  # map canvas beyond the outermost street centreline
CARPARK_LEN, CARPARK_DEPTH = 44.2, 19.0  # 17 bays of 2.6 m; two 5.5 m rows and a 7 m aisle
CARPARKS = 4  # car parks per location, where blocks leave room (one was too rare to learn: absent from most drives)
BAY_W, BAY_D = 2.6, 5.5
DASH, GAP = 3.0, 6.0  # white dashed lane line
# Map surfaces are snapped to this grid (metres). Unions of bands otherwise keep vertices 1e-14 m apart,
# which GEOS clips (the renderer's tiles) into rings of fewer than 4 points, and the map file would repeat.
SNAP = 1e-4


# ----------------------------------------------------------------------------- paths

Piece = tuple  # (x0, y0, heading0, length, curvature): a straight (curvature 0) or circular piece


def _piece_pose(p: Piece, u) -> tuple:
    """Pose (x, y, heading) at arclength u along a piece (u may be an array)."""
    x0, y0, h0, _, k = p
    h = h0 + k * np.asarray(u, dtype=np.float64)
    if k == 0.0:
        return x0 + u * math.cos(h0), y0 + u * math.sin(h0), h
    return x0 + (np.sin(h) - math.sin(h0)) / k, y0 - (np.cos(h) - math.cos(h0)) / k, h


class Path:
    """A chain of straight and circular pieces (exact geometry), densely sampled for fast lookup."""

    DS = 0.5  # sample spacing, metres: linear interpolation between samples is within 3 mm on a 10 m radius

    def __init__(self, pieces: list[Piece]):
        self.pieces = [p for p in pieces if p[3] > 1e-9]
        self.length = float(sum(p[3] for p in self.pieces))

    @cached_property
    def _samples(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Dense arclength, positions, unwrapped headings and curvatures (sampled on first use)."""
        xs, ys, hs, ks, ss, s0 = [], [], [], [], [], 0.0
        for i, p in enumerate(self.pieces):
            u = np.linspace(0.0, p[3], max(2, int(math.ceil(p[3] / self.DS)) + 1))
            if i:
                u = u[1:]  # the first sample is the previous piece's last
            x, y, h = _piece_pose(p, u)
            xs.append(np.broadcast_to(x, u.shape)), ys.append(np.broadcast_to(y, u.shape)), hs.append(h)
            ks.append(np.full(u.shape, p[4])), ss.append(s0 + u)
            s0 += p[3]
        xy = np.stack([np.concatenate(xs), np.concatenate(ys)], -1)
        return np.concatenate(ss), xy, np.unwrap(np.concatenate(hs)), np.concatenate(ks)

    @property
    def s(self) -> np.ndarray:
        return self._samples[0]

    @property
    def xy(self) -> np.ndarray:
        return self._samples[1]

    @property
    def heading(self) -> np.ndarray:
        return self._samples[2]

    @property
    def curvature(self) -> np.ndarray:
        return self._samples[3]

    def at(self, s, l=0.0) -> tuple[np.ndarray, np.ndarray]:
        """Position (..., 2) and heading (...) at arclength s (clipped to the path), l metres to the left."""
        ss, xy, hh, _ = self._samples
        s = np.clip(s, 0.0, self.length)
        h = np.interp(s, ss, hh)
        x = np.interp(s, ss, xy[:, 0]) - l * np.sin(h)
        y = np.interp(s, ss, xy[:, 1]) + l * np.cos(h)
        return np.stack([x, y], -1), h

    def end_pose(self) -> tuple[float, float, float]:
        x, y, h = _piece_pose(self.pieces[-1], self.pieces[-1][3])
        return float(x), float(y), float(h)

    def straight(self, s0: float, s1: float) -> bool:
        """Whether the path is straight over [s0, s1]."""
        m = (self.s >= s0 - self.DS) & (self.s <= s1 + self.DS)
        return bool(m.any() and np.all(self.curvature[m] == 0.0))

    def offset(self, l: float) -> Path:
        """The parallel path l metres to the left."""
        out = []
        for x0, y0, h0, length, k in self.pieces:
            f = 1.0 - l * k
            if f <= 0:
                raise ValueError(f"offset {l} m crosses the centre of a {1 / k:.1f} m radius curve")
            out.append((x0 - l * math.sin(h0), y0 + l * math.cos(h0), h0, length * f, k / f))
        return Path(out)

    def reverse(self) -> Path:
        out = []
        for p in reversed(self.pieces):
            x, y, h = _piece_pose(p, p[3])
            out.append((float(x), float(y), float(h) + math.pi, p[3], -p[4]))
        return Path(out)

    def sub(self, s0: float, s1: float) -> Path:
        """The part between arclengths s0 < s1."""
        out, start = [], 0.0
        for p in self.pieces:
            a, b = max(s0, start), min(s1, start + p[3])
            if b > a + 1e-9:
                x, y, h = _piece_pose(p, a - start)
                out.append((float(x), float(y), float(h), b - a, p[4]))
            start += p[3]
        return Path(out)

    def __add__(self, other: Path) -> Path:
        return Path(self.pieces + other.pieces)

    def knots(self, step: float = 1.0) -> np.ndarray:
        """Arclengths that trace the path for polygons and lines: piece ends, and every `step` m on curves."""
        out, s0 = [0.0], 0.0
        for p in self.pieces:
            n = 1 if p[4] == 0.0 else int(math.ceil(p[3] / step))
            out += list(s0 + np.linspace(0.0, p[3], n + 1)[1:])
            s0 += p[3]
        return np.asarray(out)

    def line(self, l: float = 0.0) -> LineString:
        return LineString(self.at(self.knots(), l)[0])


def _band(path: Path, l0: float, l1: float) -> Polygon:
    """The polygon between lateral offsets l0 and l1 along a path."""
    s = path.knots()
    a, _ = path.at(s, l0)
    b, _ = path.at(s, l1)
    return _snapped(Polygon(np.concatenate([a, b[::-1]])))


def _snapped(geom):
    """geom on the SNAP grid: valid, no repeated or nearly coincident vertices, no collapsed ring or sliver."""
    return shapely.set_precision(shapely.make_valid(geom), SNAP)


def _dashes(path: Path, l: float) -> list[LineString]:
    """The painted dashes of a dashed line l metres left of a path."""
    starts = np.arange(GAP / 2, path.length, DASH + GAP)
    return [LineString(path.at(np.linspace(a, min(a + DASH, path.length), 5), l)[0]) for a in starts]


# ----------------------------------------------------------------------------- network


@dataclass
class Street:
    """A road between two junctions (through any bends): centreline from a's junction edge to b's."""

    a: int  # junction index at s = 0
    arm_a: int  # direction index (into RoadMap.dirs) of the arm at a
    b: int
    arm_b: int
    path: Path


@dataclass
class Junction:
    xy: np.ndarray
    arms: dict[int, tuple[int, int]]  # direction index -> (street index, +1 if the street starts here else -1)


@dataclass
class RoadMap:
    """One location's network and map geometry (map frame, metres)."""

    location: str
    side: int  # TRAFFIC_SIDE
    dirs: np.ndarray  # (4, 2) unit vectors of the grid directions E, N, W, S (rotated)
    canvas: tuple[float, float]  # map extent (x, y), metres, from the origin
    junctions: list[Junction]
    streets: list[Street]
    layers: dict[str, list[dict]] = field(default_factory=dict)  # nuScenes map-expansion layers
    paint: dict = field(default_factory=dict)  # ground markings for the renderer
    bays: list[tuple[float, float, float]] = field(default_factory=list)  # car-park bay centre x, y and yaw
    driveways: list[tuple[int, int, float, float]] = field(default_factory=list)  # street, side, s0, s1
    buildings: list[tuple[float, float, float, float, float, float]] = field(default_factory=list)  # x, y, yaw, w, l, h
    connectivity: dict[str, dict] = field(default_factory=dict)  # "laneN"/"connectorN" -> incoming, outgoing
    _lanes: dict = field(default_factory=dict, repr=False)

    # --------------------------------------------------------------- lanes and routes
    def lane_offset(self, k: int) -> float:
        """Lateral offset (left of the travel direction) of lane k (0 = inner) centre."""
        return -self.side * (k + 0.5) * LANE_W

    def lane_path(self, street: int, dirn: int, k: int) -> Path:
        """Centre of lane k of a street driven in direction dirn (+1: a -> b), between the two LANE_STARTs."""
        key = street, dirn, k
        if key not in self._lanes:
            p = self.streets[street].path
            p = p.sub(LANE_START - CURB, p.length - (LANE_START - CURB))
            self._lanes[key] = (p if dirn > 0 else p.reverse()).offset(self.lane_offset(k))
        return self._lanes[key]

    def lane_end(self, street: int, dirn: int) -> tuple[int, int]:
        """(junction, arm) a lane of this street and direction drives into."""
        st = self.streets[street]
        return (st.b, st.arm_b) if dirn > 0 else (st.a, st.arm_a)

    def connector(self, junction: int, arm_in: int, arm_out: int, k: int) -> Path:
        """Lane k's path across a junction, from the end of the lane on arm_in to the lane leaving on arm_out."""
        j = self.junctions[junction]
        si, di = j.arms[arm_in]
        so, do = j.arms[arm_out]
        x, y, h = self.lane_path(si, -di, k).end_pose()
        exit_xy = self.lane_path(so, do, k).at(0.0)[0]
        e = np.array([x, y])
        m_in, m_out = -self.dirs[arm_in], self.dirs[arm_out]
        if arm_out == (arm_in + 2) % 4:
            return Path([(x, y, h, float(np.linalg.norm(exit_xy - e)), 0.0)])
        corner = e + m_in * float(np.dot(exit_xy - e, m_in))
        r = float(np.linalg.norm(corner - e))
        turn = float(np.sign(m_in[0] * m_out[1] - m_in[1] * m_out[0]))
        path = Path([(x, y, h, r * math.pi / 2, turn / r)])
        assert np.allclose(path.end_pose()[:2], exit_xy, atol=1e-6), "lane connector does not meet its lane"
        return path

    def route(self, rng: np.random.Generator, street: int, dirn: int, k: int, s: float, length: float) -> Path:
        """A random drive of at least `length` metres in lane k, from arclength s of that lane, turning at junctions."""
        path = self.lane_path(street, dirn, k)
        path = path.sub(s, path.length)
        while path.length < length:
            junction, arm_in = self.lane_end(street, dirn)
            arm_out = int(rng.choice([a for a in sorted(self.junctions[junction].arms) if a != arm_in]))
            street, d = self.junctions[junction].arms[arm_out]
            path = path + self.connector(junction, arm_in, arm_out, k) + self.lane_path(street, d, k)
            dirn = d
        return path


def _location_rng(seed: int, location: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(location.encode())])


def _grid(rng: np.random.Generator):
    """Junction-grid nodes (local frame), kept edges (set of node pairs) after a few removals."""
    xs = np.concatenate([[0.0], np.cumsum(rng.uniform(*BLOCK, GRID - 1))])
    ys = np.concatenate([[0.0], np.cumsum(rng.uniform(*BLOCK, GRID - 1))])
    nodes = {(i, j): np.array([xs[i], ys[j]]) for i in range(GRID) for j in range(GRID)}
    edges = {frozenset([(i, j), (i + 1, j)]) for i in range(GRID - 1) for j in range(GRID)}
    edges |= {frozenset([(i, j), (i, j + 1)]) for i in range(GRID) for j in range(GRID - 1)}

    def degree(n):
        return sum(n in e for e in edges)

    def connected(es):
        seen, todo = set(), [next(iter(nodes))]
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo += [m for e in es if n in e for m in e if m != n]
        return len(seen) == len(nodes)

    for _ in range(int(rng.integers(1, 4))):  # T junctions and bends inside the grid
        cands = sorted((e for e in edges if all(degree(n) >= 3 for n in e)), key=sorted)
        for idx in rng.permutation(len(cands)):
            if connected(edges - {cands[idx]}):
                edges.discard(cands[idx])
                break
    return nodes, edges


@lru_cache(maxsize=8)
def road_map(seed: int, location: str) -> RoadMap:
    """The network and map of `location` for `seed` (deterministic, cached per process)."""
    if location not in TRAFFIC_SIDE:
        raise ValueError(f"unknown location {location!r}; expected one of {sorted(TRAFFIC_SIDE)}")
    rng = _location_rng(seed, location)  # drawn from in this order: grid, rotation, car parks, buildings
    nodes, edges = _grid(rng)
    pos, canvas, dirs = _place_grid(rng, nodes)
    junctions, streets = _network(nodes, edges, pos, dirs)
    road = RoadMap(location, TRAFFIC_SIDE[location], dirs, canvas, junctions, streets)
    _build_layers(road, rng)
    return road


# Grid directions E, N, W, S (direction index d) as steps (di, dj) of the node index; RoadMap.dirs rotates them.
_STEPS = ((1, 0), (0, 1), (-1, 0), (0, -1))


def _place_grid(rng: np.random.Generator, nodes: dict) -> tuple[dict, tuple[float, float], np.ndarray]:
    """The grid turned by a random angle and moved MARGIN inside the canvas: node positions, canvas, dirs."""
    theta = rng.uniform(0.0, math.pi / 2)
    R = np.array([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]])
    local = np.stack(list(nodes.values()))
    corners = local @ R.T
    shift = MARGIN - corners.min(0)
    pos = {n: R @ p + shift for n, p in nodes.items()}
    canvas = tuple(float(v) for v in corners.max(0) + shift + MARGIN)
    dirs = np.array(_STEPS, dtype=np.float64) @ R.T
    return pos, canvas, dirs


def _arms(n: tuple[int, int], edges: set) -> list[int]:
    """Directions in which grid node n has a kept edge."""
    return [d for d in range(len(_STEPS)) if frozenset([n, _step(n, d)]) in edges]


def _step(n: tuple[int, int], d: int) -> tuple[int, int]:
    """The grid node next to n in direction d."""
    return n[0] + _STEPS[d][0], n[1] + _STEPS[d][1]


def _network(nodes: dict, edges: set, pos: dict, dirs: np.ndarray) -> tuple[list[Junction], list[Street]]:
    """Junctions (the nodes of 3 or 4 arms, in node order) and the streets between them."""
    junction_nodes = sorted(n for n in nodes if len(_arms(n, edges)) >= 3)
    jindex = {n: i for i, n in enumerate(junction_nodes)}
    junctions = [Junction(pos[n], {}) for n in junction_nodes]
    streets: list[Street] = []
    for n in junction_nodes:
        for d in _arms(n, edges):
            if d in junctions[jindex[n]].arms:
                continue  # found from its other end
            m, arm_m, path = _trace_street(n, d, edges, pos, dirs, jindex)
            si = len(streets)
            streets.append(Street(jindex[n], d, jindex[m], arm_m, path))
            junctions[jindex[n]].arms[d] = (si, 1)
            junctions[jindex[m]].arms[arm_m] = (si, -1)
    return junctions, streets


def _trace_street(
    n: tuple[int, int], d: int, edges: set, pos: dict, dirs: np.ndarray, jindex: dict
) -> tuple[tuple[int, int], int, Path]:
    """The street leaving junction node n in direction d: the junction node m it reaches, its arm there,
    and the centreline from kerb to kerb (a quarter circle at each bend)."""
    u = dirs[d]
    start = pos[n] + u * CURB
    pieces, p, h = [], start, math.atan2(u[1], u[0])
    m, dd = _step(n, d), d
    while m not in jindex:  # through bends and straight degree-2 nodes
        (nd,) = [a for a in _arms(m, edges) if a != (dd + 2) % 4]
        if nd != dd:  # a bend: straight up to the arc, then a quarter circle that cuts the corner at m
            v = dirs[nd]
            t1 = pos[m] - u * BEND_RADIUS
            pieces.append((p[0], p[1], h, float(np.dot(t1 - p, u)), 0.0))
            turn = float(np.sign(u[0] * v[1] - u[1] * v[0]))
            pieces.append((t1[0], t1[1], h, BEND_RADIUS * math.pi / 2, turn / BEND_RADIUS))
            p, h, u, dd = pos[m] + v * BEND_RADIUS, h + turn * math.pi / 2, v, nd
        m = _step(m, dd)
    end = pos[m] - u * CURB
    pieces.append((p[0], p[1], h, float(np.dot(end - p, u)), 0.0))
    return m, (dd + 2) % 4, Path(pieces)


# ----------------------------------------------------------------------------- map layers


def _square(c: np.ndarray, dirs: np.ndarray, half: float) -> Polygon:
    e, n = dirs[0] * half, dirs[1] * half
    return Polygon([c + e + n, c - e + n, c - e - n, c + e - n])


def _across(path: Path, s: float, l0: float, l1: float) -> LineString:
    """A line across a path at arclength s from lateral offset l0 to l1."""
    return LineString([path.at(s, l0)[0], path.at(s, l1)[0]])


def _carparks(road: RoadMap, rng: np.random.Generator, walk_area) -> list[tuple[int, int, float]]:
    """(street, side, s centre) of up to CARPARKS car parks behind walkways, each inside a block and
    clear of roads, walkways and the other car parks."""
    cands = [(i, sd) for i in range(len(road.streets)) for sd in (-1, 1)]
    sites, taken = [], walk_area
    for idx in rng.permutation(len(cands)):
        i, sd = cands[idx]
        path = road.streets[i].path
        lo, hi = CARPARK_LEN / 2 + 25.0, path.length - CARPARK_LEN / 2 - 25.0
        if hi <= lo:
            continue
        sc = float(rng.uniform(lo, hi))
        if not path.straight(sc - CARPARK_LEN / 2 - 7, sc + CARPARK_LEN / 2 + 7):
            continue
        # The lot and 6 m around it (but on the street side) must be clear of everything placed so far.
        room = _band(
            path.sub(sc - CARPARK_LEN / 2 - 6, sc + CARPARK_LEN / 2 + 6),
            sd * (SIDEWALK_END + 0.01),
            sd * (SIDEWALK_END + CARPARK_DEPTH + 6),
        )
        if room.intersection(taken).area < 0.5:
            sites.append((i, sd, sc))
            taken = taken.union(room)
            if len(sites) == CARPARKS:
                break
    return sites


def _build_layers(road: RoadMap, rng: np.random.Generator) -> None:
    """Fill road.layers and road.paint from the network; car parks and buildings draw from rng."""
    road.layers = {
        name: []
        for name in (
            "drivable_area",
            "road_segment",
            "road_block",
            "lane",
            "lane_connector",
            "ped_crossing",
            "walkway",
            "stop_line",
            "carpark_area",
            "road_divider",
            "lane_divider",
            "traffic_light",
        )
    }
    road.paint = {"white": [], "dashes": [], "yellow": [], "zebra": [], "bays": []}

    # Surfaces: streets and junction squares.
    street_surf = [_band(st.path, -CURB, CURB) for st in road.streets]
    junction_surf = [_square(j.xy, road.dirs, CURB) for j in road.junctions]
    walk_area = _snapped(
        unary_union(
            [_band(st.path, -SIDEWALK_END, SIDEWALK_END) for st in road.streets]
            + [_square(j.xy, road.dirs, SIDEWALK_END) for j in road.junctions]
        )
    )
    roads = _snapped(unary_union(street_surf + junction_surf))

    lots, driveways = _add_carparks(road, rng, walk_area)
    drivable = _add_drivable(road, roads, lots, driveways, walk_area)
    # Road segments: streets, then junctions (intersections).
    for g in street_surf:
        road.layers["road_segment"].append({"geom": g, "is_intersection": False})
    for g in junction_surf:
        road.layers["road_segment"].append({"geom": g, "is_intersection": True})
    # Street by street, in this order: records refer to each other by their index in a layer.
    lane_index = {}
    for i in range(len(road.streets)):
        blocks = _add_lanes(road, i, lane_index)
        _add_street_lines(road, i)
        for end in (0, 1):
            _add_street_end(road, i, end, blocks)
    _add_lane_connectors(road, lane_index)
    _place_buildings(road, rng, unary_union([walk_area, drivable] + lots).buffer(1.0))


def _add_carparks(road: RoadMap, rng: np.random.Generator, walk_area) -> tuple[list[Polygon], list[Polygon]]:
    """Car parks behind the walkways, each reached by a driveway; returns the lot and driveway polygons."""
    lots, driveways = [], []
    for i, sd, sc in _carparks(road, rng, walk_area):
        path = road.streets[i].path
        lot_path = path.sub(sc - CARPARK_LEN / 2, sc + CARPARK_LEN / 2)
        lots.append(_band(lot_path, sd * SIDEWALK_END, sd * (SIDEWALK_END + CARPARK_DEPTH)))
        driveways.append(_band(path.sub(sc - 3.0, sc + 3.0), sd * (CURB - 0.05), sd * (SIDEWALK_END + 0.05)))
        road.driveways.append((i, sd, sc - 3.0, sc + 3.0))
        h = float(lot_path.at(0.0)[1])
        _add_bays(road, lot_path, sd, h)
        road.layers["carpark_area"].append(
            {"geom": lots[-1], "orientation": float((h + sd * math.pi / 2) % (2 * math.pi)), "block": None}
        )
    return lots, driveways


def _add_bays(road: RoadMap, lot_path: Path, sd: int, h: float) -> None:
    """A car park's two rows of bays: separators painted, bay centres and yaws added to road.bays."""
    rows = [
        (SIDEWALK_END + 0.5, SIDEWALK_END + 0.5 + BAY_D),
        (SIDEWALK_END + CARPARK_DEPTH - 0.5 - BAY_D, SIDEWALK_END + CARPARK_DEPTH - 0.5),
    ]
    n_bays = int(CARPARK_LEN // BAY_W)
    for r, (l0, l1) in enumerate(rows):
        for b in range(n_bays + 1):  # bay separators
            s = (CARPARK_LEN - n_bays * BAY_W) / 2 + b * BAY_W
            road.paint["bays"].append(_across(lot_path, s, sd * l0, sd * l1))
        for b in range(n_bays):
            s = (CARPARK_LEN - n_bays * BAY_W) / 2 + (b + 0.5) * BAY_W
            if r == 0 and abs(s - CARPARK_LEN / 2) < 3.0 + BAY_W / 2:
                continue  # the driveway enters the aisle here
            c = lot_path.at(s, sd * (l0 + l1) / 2)[0]
            road.bays.append((float(c[0]), float(c[1]), h + sd * math.pi / 2))


def _add_drivable(road: RoadMap, roads, lots: list, driveways: list, walk_area):
    """The drivable_area and walkway layers and the kerb paint; returns the drivable area."""
    drivable = _snapped(unary_union([roads] + lots + driveways))
    shapely.prepare(drivable)  # fast point queries
    road.layers["drivable_area"].append({"geom": drivable})
    walk = _snapped(walk_area.difference(drivable))
    for g in getattr(walk, "geoms", [walk]):
        if g.area > 1.0:
            road.layers["walkway"].append({"geom": g})
    road.paint["kerb"] = roads.boundary.difference(unary_union(driveways).buffer(0.3)) if driveways else roads.boundary
    return drivable


# The line on the inner side of lane k is of kind _LINE_KINDS[k], on its outer side _LINE_KINDS[k + 1].
_LINE_KINDS = ("DOUBLE_SOLID_YELLOW", "DOUBLE_DASHED_WHITE", "SINGLE_SOLID_WHITE")


def _add_lanes(road: RoadMap, i: int, lane_index: dict) -> dict[int, int]:
    """Street i's road blocks and lanes, one block per travel direction; returns direction -> block index."""
    L, side, p = road.layers, road.side, road.streets[i].path
    blocks = {}
    for dirn in (1, -1):
        travel = p if dirn > 0 else p.reverse()
        half = _band(travel, 0.0, -side * CURB)
        blocks[dirn] = block = len(L["road_block"])
        L["road_block"].append(
            {
                "geom": half,
                "segment": i,
                "from_edge": _across(travel, 0.0, 0.0, -side * CURB),
                "to_edge": _across(travel, p.length, 0.0, -side * CURB),
                "key": (i, dirn),
            }
        )
        for k in range(LANES):
            lane_index[i, dirn, k] = len(L["lane"])
            L["lane"].append(_lane(road, road.lane_path(i, dirn, k), k, block))
    return blocks


def _lane(road: RoadMap, lane: Path, k: int, block: int) -> dict:
    """The lane layer's record of lane k (centre path `lane`) in road block `block`."""
    side = road.side
    inner, outer = lane.offset(side * LANE_W / 2), lane.offset(-side * LANE_W / 2)
    inner_kind, outer_kind = _LINE_KINDS[k], _LINE_KINDS[k + 1]
    # Left/right in the travel direction: the inner side is on the left when driving on the right.
    left, right = ((inner, inner_kind), (outer, outer_kind)) if side > 0 else ((outer, outer_kind), (inner, inner_kind))
    return {
        "geom": _band(lane, -LANE_W / 2, LANE_W / 2),
        "path": lane,
        "block": block,
        "from_edge": _across(lane, 0.0, -LANE_W / 2, LANE_W / 2),
        "to_edge": _across(lane, lane.length, -LANE_W / 2, LANE_W / 2),
        "left": (left[0].line(), left[1]),
        "right": (right[0].line(), right[1]),
        "offset": road.lane_offset(k),
    }


def _add_street_lines(road: RoadMap, i: int) -> None:
    """Street i's centre line (road divider, double yellow) and lane dividers (solid edge, dashed middle)."""
    L, paint, p = road.layers, road.paint, road.streets[i].path
    length = p.length
    seg_path = p.sub(CROSSING[1] - CURB, length - (CROSSING[1] - CURB))
    L["road_divider"].append({"geom": seg_path.line(), "segment": i})
    paint["yellow"] += [seg_path.line(0.12), seg_path.line(-0.12)]
    dash_path = p.sub(STOP_LINE[1] - CURB, length - (STOP_LINE[1] - CURB))
    for sd in (-1, 1):
        edge = seg_path.line(sd * PARKING_EDGE)
        L["lane_divider"].append({"geom": edge, "type": "SINGLE_SOLID_WHITE"})
        paint["white"].append(edge)
        L["lane_divider"].append({"geom": dash_path.line(sd * LANE_W), "type": "DOUBLE_DASHED_WHITE"})
        paint["dashes"] += _dashes(dash_path, sd * LANE_W)


def _from_end(length: float, end: int, d: float) -> float:
    """Arclength along a street `length` m long of the point d metres from its end-0 (a) or end-1 (b) junction node."""
    return d - CURB if end == 0 else length - (d - CURB)


def _add_street_end(road: RoadMap, i: int, end: int, blocks: dict[int, int]) -> None:
    """At end 0 (a) or 1 (b) of street i: the zebra crossing, and the incoming half's traffic light and stop line."""
    L, side, p = road.layers, road.side, road.streets[i].path
    length = p.length

    def span(d0: float, d1: float) -> Path:
        """The street between d0 and d1 metres from this end's junction node."""
        s0, s1 = _from_end(length, end, d0), _from_end(length, end, d1)
        return p.sub(min(s0, s1), max(s0, s1))

    dirn_in = -1 if end == 0 else 1  # the incoming half lies at street-frame offsets -side * dirn_in * [0, CURB]
    block = blocks[dirn_in]
    cpath = span(*CROSSING)
    pc = len(L["ped_crossing"])
    L["ped_crossing"].append({"geom": _band(cpath, -CURB, CURB), "segment": i})
    for b in range(int(2 * CURB)):  # zebra bars, 0.5 m wide, every metre
        road.paint["zebra"].append(_band(cpath, -CURB + b + 0.25, -CURB + b + 0.75))
    # A traffic light on the kerb beside the stop line, facing the incoming traffic.
    kerb_l = -side * dirn_in * (CURB + 0.8)
    s_tl = _from_end(length, end, STOP_LINE[0])
    xy, h = p.at(s_tl, kerb_l)
    face = float(h) + (math.pi if dirn_in > 0 else 0.0)
    tl = len(L["traffic_light"])
    L["traffic_light"].append(
        {
            "geom": _across(p, s_tl, kerb_l - 0.2 * np.sign(kerb_l), kerb_l + 0.2 * np.sign(kerb_l)),
            "block": block,
            "pose": (float(xy[0]), float(xy[1]), 3.5, face),
        }
    )
    inc = -side * dirn_in * LANES * LANE_W
    L["stop_line"].append(
        {
            "geom": _band(span(*STOP_AREA), 0.0, inc),
            "type": "TRAFFIC_LIGHT",
            "ped_crossings": [pc],
            "traffic_lights": [tl],
            "block": block,
        }
    )
    road.paint["white"].append(_band(span(*STOP_LINE), 0.0, inc))  # filled polygons are painted whole


def _add_lane_connectors(road: RoadMap, lane_index: dict) -> None:
    """Lane connectors across every junction, and the connectivity of lanes and connectors."""
    L = road.layers
    road.connectivity = {f"lane{n}": {"incoming": [], "outgoing": []} for n in range(len(L["lane"]))}
    for j, jn in enumerate(road.junctions):
        for arm_in, (si, di) in jn.arms.items():
            for arm_out, (so, do) in jn.arms.items():
                if arm_out == arm_in:
                    continue
                for k in range(LANES):
                    path = road.connector(j, arm_in, arm_out, k)
                    a, b = lane_index[si, -di, k], lane_index[so, do, k]
                    c = len(L["lane_connector"])
                    L["lane_connector"].append(
                        {"geom": _band(path, -LANE_W / 2, LANE_W / 2), "path": path, "from": a, "to": b}
                    )
                    road.connectivity[f"lane{a}"]["outgoing"].append(f"connector{c}")
                    road.connectivity[f"lane{b}"]["incoming"].append(f"connector{c}")
                    road.connectivity[f"connector{c}"] = {"incoming": [f"lane{a}"], "outgoing": [f"lane{b}"]}


def _place_buildings(road: RoadMap, rng: np.random.Generator, keepout) -> None:
    """Buildings behind the walkways of every street, never on roads, walkways, car parks or each other."""
    keepout = prep(keepout)
    placed: list[Polygon] = []
    centres = np.zeros((0, 2))
    radii = np.zeros(0)
    for st in road.streets:
        for sd in (-1, 1):
            s = float(rng.uniform(-10.0, 5.0))
            while s < st.path.length + 10.0:
                length, depth, height = rng.uniform(10, 35), rng.uniform(8, 16), rng.uniform(6, 28)
                l = sd * (BUILDING_START + depth / 2 + rng.uniform(0, 3))
                xy, h = st.path.at(s + length / 2, l)
                c, sn = math.cos(h), math.sin(h)
                corners = xy + np.array(
                    [[length, depth], [-length, depth], [-length, -depth], [length, -depth]]
                ) / 2 @ np.array([[c, sn], [-sn, c]])
                foot = Polygon(corners)
                r = math.hypot(length, depth) / 2
                near = np.linalg.norm(centres - xy, axis=1) < radii + r + 0.5 if len(placed) else np.zeros(0, bool)
                if not keepout.intersects(foot) and not any(
                    placed[n].buffer(0.5).intersects(foot) for n in np.flatnonzero(near)
                ):
                    placed.append(foot)
                    centres = np.vstack([centres, xy])
                    radii = np.append(radii, r)
                    road.buildings.append((float(xy[0]), float(xy[1]), float(h), depth, length, height))
                s += length + rng.uniform(0.0, 8.0)


def fill(mask: np.ndarray, geom, to_px, value: int = 1) -> np.ndarray:
    """Rasterise the polygons of `geom` into `mask` in place (holes left out); to_px maps (N, 2) xy to pixel (col, row)."""
    polys = [g for g in getattr(geom, "geoms", [geom]) if isinstance(g, Polygon) and not g.is_empty]
    for g in sorted(polys, key=lambda g: -g.area):  # each exterior, then its holes cut out (big polygons first)
        cv2.fillPoly(
            mask, [np.round(to_px(np.asarray(g.exterior.coords)[:, :2]) * 16).astype(np.int32)], value, cv2.LINE_8, 4
        )
        holes = [np.round(to_px(np.asarray(r.coords)[:, :2]) * 16).astype(np.int32) for r in g.interiors]
        if holes:
            cv2.fillPoly(mask, holes, 0, cv2.LINE_8, 4)
    return mask


def stroke(mask: np.ndarray, geom, to_px, width_px: int, value: int = 1) -> np.ndarray:
    """Draw the lines of `geom` (and polygon outlines) into `mask` in place, `width_px` pixels wide."""
    lines = []
    for g in getattr(geom, "geoms", [geom]):
        if g.is_empty:
            continue
        if isinstance(g, Polygon):
            lines += [g.exterior] + list(g.interiors)
        elif hasattr(g, "geoms"):
            lines += list(g.geoms)
        else:
            lines.append(g)
    pts = [
        np.round(to_px(np.asarray(line.coords)[:, :2]) * 16).astype(np.int32) for line in lines if len(line.coords) > 1
    ]
    if pts:
        cv2.polylines(mask, pts, False, value, max(1, int(width_px)), cv2.LINE_8, 4)
    return mask
