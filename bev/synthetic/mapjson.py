"""A location's road map (bev.synthetic.roads) as a nuScenes map-expansion v1.3 JSON record.

`map_expansion(road, seed)` returns the dict written to `<dataroot>/maps/expansion/<location>.json`,
which the unmodified devkit loads with `NuScenesMap(dataroot, location)`. Schema as in the real
v1.3 files: geometric tables `node` (x, y), `line` (node_tokens), `polygon`
(exterior_node_tokens, holes: [{node_tokens}]); polygon layers drivable_area (polygon_tokens),
road_segment, road_block, lane, ped_crossing, walkway, stop_line, carpark_area, lane_connector
(polygon_token); line layers road_divider, lane_divider, traffic_light (line_token); plus
arcline_path_3 (lane/connector token -> Dubins-style pieces), connectivity and canvas_edge.
Coordinates are metres in the map (global) frame, the frame of ego_pose translations.
"""

from __future__ import annotations

import hashlib
import math
import uuid

from shapely.geometry import LineString, Polygon

from bev.synthetic.roads import Path, RoadMap

VERSION = "1.3"
STRAIGHT_RADIUS = 999.999  # what the real files store as the radius of a straight piece


def _polygons(geom) -> list[Polygon]:
    """The non-degenerate polygons of a Polygon or MultiPolygon."""
    return [g for g in getattr(geom, "geoms", [geom]) if isinstance(g, Polygon) and g.area > 1e-6]


def _arcline(path: Path) -> list[dict]:
    """One arcline record per piece: an arc ('LSL' left / 'RSR' right, length in the first segment)
    or a straight ('LSL' with radius 999.999, length in the middle segment)."""
    out = []
    for x0, y0, h0, length, k in path.pieces:
        end = Path([(x0, y0, h0, length, k)]).end_pose()
        wrap = lambda a: (a + math.pi) % (2 * math.pi) - math.pi  # noqa: E731
        out.append(
            {
                "start_pose": [x0, y0, wrap(h0)],
                "end_pose": [end[0], end[1], wrap(end[2])],
                "shape": "LSL" if k >= 0 else "RSR",
                "radius": STRAIGHT_RADIUS if k == 0 else 1.0 / abs(k),
                "segment_length": [0.0, length, 0.0] if k == 0 else [length, 0.0, 0.0],
            }
        )
    return out


class _Geometry:
    """The geometric tables (node, line, polygon) of one location's map and its token maker.

    A node, line or polygon token numbers its record within its table, so the layers must
    add their geometry in one fixed order (map_expansion's) for the tokens to stay the same.
    """

    def __init__(self, location: str, seed: int):
        """Empty tables; tokens keyed by the seed and the location."""
        self.location, self.seed = location, seed
        self.tables: dict[str, list[dict]] = {"node": [], "line": [], "polygon": []}

    def tok(self, *key) -> str:
        """A deterministic UUID token (the real map files use UUIDs)."""
        h = hashlib.md5("/".join(map(str, ("bev-synthetic-map", self.seed, self.location) + key)).encode()).hexdigest()
        return str(uuid.UUID(h))

    def node(self, x: float, y: float) -> str:
        """Add a node; return its token."""
        t = self.tok("node", len(self.tables["node"]))
        self.tables["node"].append({"token": t, "x": float(x), "y": float(y)})
        return t

    def ring(self, coords) -> list[str]:
        """Add the nodes of a closed ring; return their tokens."""
        pts = list(coords)
        if len(pts) > 1 and pts[0] == pts[-1]:
            pts = pts[:-1]  # the real files do not repeat the first node
        return [self.node(x, y) for x, y, *_ in pts]

    def polygon(self, g: Polygon) -> str:
        """Add a polygon (its exterior, then its holes); return its token."""
        t = self.tok("polygon", len(self.tables["polygon"]))
        self.tables["polygon"].append(
            {
                "token": t,
                "exterior_node_tokens": self.ring(g.exterior.coords),
                "holes": [{"node_tokens": self.ring(r.coords)} for r in g.interiors],
            }
        )
        return t

    def one_polygon(self, geom) -> str:
        """Add the largest polygon of `geom`; return its token."""
        parts = _polygons(geom)
        return self.polygon(max(parts, key=lambda g: g.area))  # bands are single polygons; drop any numerical sliver

    def line(self, g: LineString) -> tuple[str, list[str]]:
        """Add a line; return its token and its node tokens."""
        t = self.tok("line", len(self.tables["line"]))
        nodes = [self.node(x, y) for x, y, *_ in g.coords]
        self.tables["line"].append({"token": t, "node_tokens": nodes})
        return t, nodes

    def divider_segments(self, g: LineString, kind: str) -> list[dict]:
        """Add a lane's divider as bare nodes; return its segment records."""
        return [{"node_token": self.node(x, y), "segment_type": kind} for x, y, *_ in g.coords]


def map_expansion(road: RoadMap, seed: int) -> dict:
    """The map-expansion JSON dict of one location (deterministic tokens)."""
    geo = _Geometry(road.location, seed)
    L = road.layers
    ids = {name: [geo.tok(name, i) for i in range(len(L[name]))] for name in L}
    # Built in the real files' key order, which is also the order that numbers the geometry tokens.
    layers = {
        **_road_layers(geo, L, ids),
        **_lane_layers(geo, L, ids),
        **_area_layers(geo, L, ids),
        **_line_layers(geo, L, ids),
    }
    return {
        "version": VERSION,
        "canvas_edge": [float(road.canvas[0]), float(road.canvas[1])],
        **geo.tables,
        **layers,
        **_lane_graph(road, ids),
    }


def _road_layers(geo: _Geometry, L: dict, ids: dict) -> dict:
    """The drivable_area, road_segment and road_block layers."""
    da = ids["drivable_area"][0]
    return {
        "drivable_area": [
            {"token": da, "polygon_tokens": [geo.polygon(g) for g in _polygons(L["drivable_area"][0]["geom"])]}
        ],
        "road_segment": [
            {
                "token": t,
                "polygon_token": geo.one_polygon(r["geom"]),
                "is_intersection": r["is_intersection"],
                "drivable_area_token": da,
            }
            for t, r in zip(ids["road_segment"], L["road_segment"])
        ],
        "road_block": [
            {
                "token": t,
                "polygon_token": geo.one_polygon(r["geom"]),
                "from_edge_line_token": geo.line(r["from_edge"])[0],
                "to_edge_line_token": geo.line(r["to_edge"])[0],
                "road_segment_token": ids["road_segment"][r["segment"]],
            }
            for t, r in zip(ids["road_block"], L["road_block"])
        ],
    }


def _lane_layers(geo: _Geometry, L: dict, ids: dict) -> dict:
    """The lane and lane_connector layers."""
    return {
        "lane": [
            {
                "token": t,
                "polygon_token": geo.one_polygon(r["geom"]),
                "lane_type": "CAR",
                "from_edge_line_token": geo.line(r["from_edge"])[0],
                "to_edge_line_token": geo.line(r["to_edge"])[0],
                "left_lane_divider_segments": geo.divider_segments(*r["left"]),
                "right_lane_divider_segments": geo.divider_segments(*r["right"]),
            }
            for t, r in zip(ids["lane"], L["lane"])
        ],
        "lane_connector": [
            {"token": t, "polygon_token": geo.one_polygon(r["geom"])}
            for t, r in zip(ids["lane_connector"], L["lane_connector"])
        ],
    }


def _area_layers(geo: _Geometry, L: dict, ids: dict) -> dict:
    """The ped_crossing, walkway, stop_line and carpark_area layers."""
    return {
        "ped_crossing": [
            {
                "token": t,
                "polygon_token": geo.one_polygon(r["geom"]),
                "road_segment_token": ids["road_segment"][r["segment"]],
            }
            for t, r in zip(ids["ped_crossing"], L["ped_crossing"])
        ],
        "walkway": [
            {"token": t, "polygon_token": geo.one_polygon(r["geom"])} for t, r in zip(ids["walkway"], L["walkway"])
        ],
        "stop_line": [
            {
                "token": t,
                "polygon_token": geo.one_polygon(r["geom"]),
                "stop_line_type": r["type"],
                "ped_crossing_tokens": [ids["ped_crossing"][i] for i in r["ped_crossings"]],
                "traffic_light_tokens": [ids["traffic_light"][i] for i in r["traffic_lights"]],
                "road_block_token": ids["road_block"][r["block"]],
            }
            for t, r in zip(ids["stop_line"], L["stop_line"])
        ],
        "carpark_area": [
            {
                "token": t,
                "polygon_token": geo.one_polygon(r["geom"]),
                "orientation": r["orientation"],
                "road_block_token": "",
            }
            for t, r in zip(ids["carpark_area"], L["carpark_area"])
        ],
    }


def _line_layers(geo: _Geometry, L: dict, ids: dict) -> dict:
    """The road_divider, lane_divider and traffic_light layers."""
    return {
        "road_divider": [
            {"token": t, "line_token": geo.line(r["geom"])[0], "road_segment_token": ids["road_segment"][r["segment"]]}
            for t, r in zip(ids["road_divider"], L["road_divider"])
        ],
        "lane_divider": [_lane_divider(geo, t, r) for t, r in zip(ids["lane_divider"], L["lane_divider"])],
        "traffic_light": [_traffic_light(geo, t, r, ids) for t, r in zip(ids["traffic_light"], L["traffic_light"])],
    }


def _lane_divider(geo: _Geometry, t: str, r: dict) -> dict:
    """One lane_divider record: its line, each node a segment of the divider's type."""
    lt, nodes = geo.line(r["geom"])
    return {
        "token": t,
        "line_token": lt,
        "lane_divider_segments": [{"node_token": n, "segment_type": r["type"]} for n in nodes],
    }


def _traffic_light(geo: _Geometry, t: str, r: dict, ids: dict) -> dict:
    """One traffic_light record: a vertical red-yellow-green head at the light's pose."""
    x, y, z, yaw = r["pose"]
    items = [
        {
            "color": c,
            "shape": "CIRCLE",
            "rel_pos": {"tx": 0.0, "ty": 0.0, "tz": dz, "rx": 0.0, "ry": 0.0, "rz": 0.0},
            "to_road_block_tokens": [],
        }
        for c, dz in (("RED", 0.3), ("YELLOW", 0.0), ("GREEN", -0.3))
    ]
    return {
        "token": t,
        "line_token": geo.line(r["geom"])[0],
        "traffic_light_type": "VERTICAL",
        "from_road_block_token": ids["road_block"][r["block"]],
        "items": items,
        "pose": {"tx": x, "ty": y, "tz": z, "rx": 0.0, "ry": 0.0, "rz": yaw},
    }


def _lane_graph(road: RoadMap, ids: dict) -> dict:
    """arcline_path_3 (each lane's and connector's centre line) and connectivity, by token."""
    L = road.layers
    arclines = {
        **{t: _arcline(r["path"]) for t, r in zip(ids["lane"], L["lane"])},
        **{t: _arcline(r["path"]) for t, r in zip(ids["lane_connector"], L["lane_connector"])},
    }
    name = {f"lane{i}": t for i, t in enumerate(ids["lane"])} | {
        f"connector{i}": t for i, t in enumerate(ids["lane_connector"])
    }
    connectivity = {
        name[k]: {"incoming": [name[x] for x in v["incoming"]], "outgoing": [name[x] for x in v["outgoing"]]}
        for k, v in road.connectivity.items()
    }
    return {"arcline_path_3": arclines, "connectivity": connectivity}
