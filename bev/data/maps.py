"""HD-map BEV targets from the nuScenes map expansion (v1.3): the one home of map classes and presets.

A map class is a target channel made of one or more devkit layers (MAP_CLASSES); `divider` is
BEVFusion's union of road_divider and lane_divider lines. Presets (PRESETS):
  bevfusion: drivable_area, ped_crossing, walkway, stop_line, carpark_area, divider (BEVFusion's
             map segmentation classes);
  lss:       drivable_area, divider. "Lane boundaries" of the LSS paper are taken as the painted
             road_divider + lane_divider lines (what LSS draws as lane lines), not lane polygon edges.

Geometry is read once per split with the devkit (NuScenesMap) and cached in the split index as
flat global-frame arrays (see load_map_geometry), so DataLoader workers never load the devkit map.
rasterize_map then draws one sample's patch the way the devkit's get_map_mask does (which
BEVFusion uses), on the bev.geometry grid and in the same ego frame as the boxes:
  - frame: the LIDAR_TOP ego pose, yaw only (the devkit's patch_angle = ego yaw in degrees);
    arrays [x_index, y_index] (the devkit canvas is [y, x]: BEVFusion transposes it);
  - polygons: vertices at continuous cell coordinates (p - lo) / step, rounded to the nearest
    cell corner, filled with cv2.fillPoly (boundary cells included) and holes cleared. This is
    also the `raster: lss` rule for boxes, so both can follow one rule;
  - lines: vertices floored (the devkit truncates), drawn with cv2.polylines LINE_WIDTH_M wide
    (2 cells on the 0.5 m grid, as the devkit's thickness 2).
"""

from __future__ import annotations

import inspect
import json
import os
import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from bev.classes import LINE_LAYERS, MAP_CLASSES, POLYGON_LAYERS, PRESETS, normalize_map_layers  # noqa: F401
from bev.geometry import Grid

LINE_WIDTH_M = 1.0  # drawn width of divider lines: the devkit's 2 px at BEVFusion's 0.5 m cells
_NON_FINITE = "non-finite or non-numeric nodes"  # why a shape with a NaN, infinite or non-number node is skipped
MAP_DOWNLOAD = (
    "Download the map expansion pack (nuScenes-map-expansion-v1.3.zip, from https://www.nuscenes.org/download) "
    "and unpack it into DATAROOT/maps/ so that DATAROOT/maps/expansion/<location>.json exist"
)


def map_file(dataroot: str | os.PathLike, location: str) -> Path:
    return Path(dataroot) / "maps" / "expansion" / f"{location}.json"


def check_map_files(dataroot: str | os.PathLike, locations: Sequence[str]) -> None:
    missing = [str(map_file(dataroot, loc)) for loc in locations if not map_file(dataroot, loc).is_file()]
    if missing:
        raise FileNotFoundError(
            f"map layers were requested but the map expansion file(s) {missing} are missing. "
            f"{MAP_DOWNLOAD}, or set data.map_layers=null."
        )


class _Dangling(KeyError):
    """A map record names a token that its table does not hold."""


def _get(nmap, table: str, token: str) -> dict:
    """The map's `table` record of `token`; a missing one is _Dangling, naming both."""
    try:
        return nmap.get(table, token)
    except KeyError:
        raise _Dangling(f"names a missing {table} {token}") from None


def _vertices(nmap, node_tokens: Sequence[str]) -> np.ndarray:
    """(N, 2) float64 global x, y of map nodes; a coordinate that is missing or not a number is NaN (the shape
    is then skipped and named with the other non-finite ones)."""
    xy = [(_coordinate(n.get("x")), _coordinate(n.get("y"))) for n in (_get(nmap, "node", t) for t in node_tokens)]
    return np.array(xy, dtype=np.float64).reshape(-1, 2)


def _coordinate(value) -> float:
    """A node coordinate as a float; NaN for a string, null, true/false or a list (NumPy would refuse or convert them)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else float("nan")


def _rings_of_polygon(nmap, polygon_token: str) -> list[np.ndarray]:
    """A map polygon's rings: the exterior, then its non-empty holes."""
    rec = _get(nmap, "polygon", polygon_token)
    try:
        rings = [_vertices(nmap, rec["exterior_node_tokens"])]
        rings += [_vertices(nmap, h["node_tokens"]) for h in rec["holes"] if len(h["node_tokens"])]
    except _Dangling as e:
        raise _Dangling(f"its polygon {polygon_token} {e.args[0]}") from None
    return rings


def load_map_geometry(
    dataroot: str | os.PathLike, locations: Sequence[str], classes: Sequence[str], verbose: bool = True
) -> dict[str, np.ndarray]:
    """Global-frame geometry of the map classes at `locations`, as flat arrays (no pickle, cacheable).

    A "shape" is one polygon (exterior ring + holes) or one polyline of one map class:
      map_locations (L,) str; map_xy (V, 2) float64 vertices; map_ring_offsets (R+1,) into map_xy;
      map_shape_rings (S+1,) into the rings (first ring = exterior); map_shape_class (S,) channel;
      map_shape_line (S,) bool; map_shape_location (S,) into map_locations; map_shape_bbox (S, 4)
      xmin, ymin, xmax, ymax. Polygons the devkit skips (invalid, outside drivable_area) are skipped.
    """
    from tqdm import tqdm

    check_map_files(dataroot, locations)
    table = _ShapeTable()
    for li, loc in enumerate(tqdm(locations, desc="loading map expansion", unit="map", disable=not verbose)):
        nmap, skipped = _open_map(dataroot, loc), []
        for c, name in enumerate(classes):
            for layer in MAP_CLASSES[name]:
                for rec in getattr(nmap, layer):
                    for rings in _record_shapes(nmap, layer, rec, skipped):
                        table.add(rings, c, layer in LINE_LAYERS, li)
        if skipped:
            shown = "; ".join(skipped[:5]) + (f"; and {len(skipped) - 5} more" if len(skipped) > 5 else "")
            warnings.warn(
                f"map expansion {str(map_file(dataroot, loc))!r}: {len(skipped)} shape(s): {shown}. To draw them, fix "
                "those records of the map file, or re-download the map expansion",
                stacklevel=2,
            )
    return table.arrays(locations)


def _map_api():
    """The devkit's map_api module, imported without its side effect: it calls plt.style.use(...) at import,
    which would draw every later picture of the process with another style (grid lines on white)."""
    import matplotlib

    with matplotlib.rc_context():
        from nuscenes.map_expansion import map_api
    return map_api


def _open_map(dataroot: str | os.PathLike, location: str):
    """The devkit's NuScenesMap of one location; any failure to read it names the file."""
    try:
        return _map_api().NuScenesMap(dataroot=str(dataroot), map_name=location)
    except Exception as e:  # outdated version, unknown location, missing layer: name the file
        # The devkit resolves each layer's polygon and line when it loads the map: a dangling one is a KeyError.
        referrer = _referrer(map_file(dataroot, location), e.args[0]) if isinstance(e, KeyError) and e.args else None
        if referrer:
            raise ValueError(
                f"map expansion {str(map_file(dataroot, location))!r}: {referrer} names a missing token "
                f"{e.args[0]!r}. Fix that record, or download the map expansion again. {MAP_DOWNLOAD} (v1.3)."
            ) from None
        raise ValueError(
            f"cannot read the map expansion {str(map_file(dataroot, location))!r} with the nuScenes devkit "
            f"({type(e).__name__}: {e}). {MAP_DOWNLOAD} (v1.3)."
        ) from None


def _referrer(path: Path, token) -> str | None:
    """'<table> record <token>' of the first map record that names `token` (for an error), else None."""
    try:
        tables = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    for table, records in tables.items():
        for rec in records if isinstance(records, list) else ():
            if isinstance(rec, dict) and token in (v for v in rec.values() if isinstance(v, str)):
                return f"{table} record {rec.get('token')}"
    return None


def _record_shapes(nmap, layer: str, rec: dict, skipped: list[str]) -> list[list[np.ndarray]]:
    """The drawable shapes of one record of a devkit layer, each a list of rings (a line: one ring).
    What cannot be drawn is left out and named in `skipped`: lines of < 2 points, rings of < 3 distinct
    points, non-finite nodes, and (as the devkit's get_map_mask) invalid polygons other than
    drivable_area, whose self-intersecting polygons are repaired instead (shapely's make_valid), and records
    naming a node, line or polygon that the map does not hold."""
    try:
        return _drawable_shapes(nmap, layer, rec, skipped)
    except _Dangling as e:  # a dangling reference: this record cannot be drawn, the others can
        skipped.append(f"{layer} {rec.get('token')}: {e.args[0]}")
        return []


def _drawable_shapes(nmap, layer: str, rec: dict, skipped: list[str]) -> list[list[np.ndarray]]:
    """_record_shapes, which see; a dangling reference raises _Dangling."""
    if layer in LINE_LAYERS:
        line = _vertices(nmap, _get(nmap, "line", rec["line_token"])["node_tokens"])
        problem = "fewer than 2 points" if len(line) < 2 else None if np.isfinite(line).all() else _NON_FINITE
        if problem:
            skipped.append(f"{layer} {rec['token']}: {problem}")
            return []
        return [[line]]
    tokens = rec["polygon_tokens"] if layer == "drivable_area" else [rec["polygon_token"]]
    shapes = []
    for token in tokens:
        rings, problem = _checked_rings(_rings_of_polygon(nmap, token))
        polygon = _polygon(rings) if problem is None else None
        if polygon is not None and not polygon.is_valid:
            if layer != "drivable_area":
                problem = "self-intersecting (not drawn, as the devkit does)"
            else:
                skipped.append(f"{layer} polygon {token}: self-intersecting, repaired")
                shapes += _valid_parts(polygon)
                continue
        if problem:
            skipped.append(f"{layer} polygon {token}: {problem}")
        else:
            shapes.append(rings)
    return shapes


def _checked_rings(rings: list[np.ndarray]) -> tuple[list[np.ndarray], str | None]:
    """(rings without holes of < 3 distinct points, why the polygon cannot be drawn or None)."""
    if not all(np.isfinite(r).all() for r in rings):
        return rings, _NON_FINITE
    if len(np.unique(rings[0], axis=0)) < 3:
        return rings, "fewer than 3 distinct points"
    return [rings[0]] + [h for h in rings[1:] if len(np.unique(h, axis=0)) >= 3], None


def _polygon(rings: list[np.ndarray]):
    from shapely.geometry import Polygon

    return Polygon(rings[0], rings[1:])


def _valid_parts(polygon) -> list[list[np.ndarray]]:
    """The polygons of shapely's make_valid of `polygon`, as lists of rings."""
    from shapely.validation import make_valid

    fixed = make_valid(polygon)
    parts = [g for g in getattr(fixed, "geoms", [fixed]) if g.geom_type == "Polygon" and not g.is_empty]
    return [[np.asarray(g.exterior.coords)[:, :2]] + [np.asarray(h.coords)[:, :2] for h in g.interiors] for g in parts]


class _ShapeTable:
    """load_map_geometry's flat arrays, filled one shape at a time."""

    def __init__(self) -> None:
        self.xy: list[np.ndarray] = []
        self.ring_off, self.shape_rings = [0], [0]
        self.cls, self.line, self.loc_of, self.bbox = [], [], [], []

    def add(self, rings: list[np.ndarray], c: int, line: bool, li: int) -> None:
        """Append one shape (rings, first = exterior) of map class c at location li."""
        for r in rings:
            self.xy.append(r)
            self.ring_off.append(self.ring_off[-1] + len(r))
        self.shape_rings.append(self.shape_rings[-1] + len(rings))
        self.cls.append(c)
        self.line.append(line)
        self.loc_of.append(li)
        self.bbox.append((*rings[0].min(0), *rings[0].max(0)))

    def arrays(self, locations: Sequence[str]) -> dict[str, np.ndarray]:
        """The shapes as load_map_geometry's arrays."""
        return {
            "map_locations": np.asarray(list(locations), dtype=str),
            "map_xy": np.concatenate(self.xy) if self.xy else np.zeros((0, 2)),
            "map_ring_offsets": np.asarray(self.ring_off, dtype=np.int64),
            "map_shape_rings": np.asarray(self.shape_rings, dtype=np.int64),
            "map_shape_class": np.asarray(self.cls, dtype=np.int64),
            "map_shape_line": np.asarray(self.line, dtype=bool),
            "map_shape_location": np.asarray(self.loc_of, dtype=np.int64),
            "map_shape_bbox": np.asarray(self.bbox, dtype=np.float64).reshape(-1, 4),
        }


def ego_yaw(rotation: np.ndarray) -> float:
    """Heading of the ego x axis in the global frame (the devkit's patch_angle, in radians)."""
    return float(np.arctan2(rotation[1, 0], rotation[0, 0]))


def rasterize_map(
    geom: dict[str, np.ndarray],
    location: str,
    rotation: np.ndarray,
    translation: np.ndarray,
    grid: Grid,
    num_classes: int,
) -> np.ndarray:
    """(num_classes, X, Y) uint8 {0, 1} map target of one ego pose (rotation 3x3, translation 3, global)."""
    # Drawn on the devkit's canvas layout [y_index, x_index] (cv2 fills are not symmetric under a
    # transpose, so this keeps the devkit's cells) and returned transposed to [x_index, y_index].
    out = np.zeros((num_classes, grid.ny, grid.nx), dtype=np.uint8)
    locs = geom["map_locations"].tolist()
    if num_classes == 0 or location not in locs:
        return out.transpose(0, 2, 1).copy()
    yaw = ego_yaw(rotation)
    c, s = np.cos(yaw), np.sin(yaw)
    t = np.asarray(translation, dtype=np.float64)[:2]
    (xlo, xhi, xs), (ylo, yhi, ys) = grid.xbound, grid.ybound
    corners = np.array([[xlo, ylo], [xlo, yhi], [xhi, ylo], [xhi, yhi]])
    to_global = np.array([[c, s], [-s, c]])  # ego (x, y) rows -> global offset
    to_cells = np.array([[c / xs, -s / ys], [s / xs, c / ys]])  # global offset -> (x, y) cell coordinates
    origin = np.array([xlo / xs, ylo / ys])
    thickness = max(1, int(round(LINE_WIDTH_M / min(xs, ys))))
    scratch = np.zeros((grid.ny, grid.nx), dtype=np.uint8)
    patch = None  # the devkit's patch polygons, built on the first line that crosses the border
    g = corners @ to_global + t  # grid corners in the global frame
    for k in _shapes_near(geom, locs.index(location), g):
        is_line = bool(geom["map_shape_line"][k])
        global_rings = _shape_rings(geom, k)
        rings = [(r - t) @ to_cells - origin for r in global_rings]
        inside = _inside(rings, grid.nx, grid.ny)
        if is_line and not inside:
            patch = patch or _devkit_patch(corners.mean(0) @ to_global + t, yhi - ylo, xhi - xlo, np.degrees(yaw))
            parts = _devkit_clip_line(global_rings[0], patch, grid)
        else:
            parts = [rings] if inside else _clip(rings, is_line, grid.nx, grid.ny)
        _draw_parts(out[geom["map_shape_class"][k]], parts, is_line, thickness, scratch)
    return out.transpose(0, 2, 1).copy()


def _shapes_near(geom: dict[str, np.ndarray], li: int, g: np.ndarray) -> np.ndarray:
    """Indices of the shapes at location li whose bounding box meets the bounding box of the points g (N, 2)."""
    bb = geom["map_shape_bbox"]
    near = (
        (geom["map_shape_location"] == li)
        & (bb[:, 0] <= g[:, 0].max())
        & (bb[:, 2] >= g[:, 0].min())
        & (bb[:, 1] <= g[:, 1].max())
        & (bb[:, 3] >= g[:, 1].min())
    )
    return np.flatnonzero(near)


def _shape_rings(geom: dict[str, np.ndarray], k: int) -> list[np.ndarray]:
    """The global x, y rings of shape k (first: the exterior, or the line), views into map_xy."""
    ring_off, shape_rings, xy = geom["map_ring_offsets"], geom["map_shape_rings"], geom["map_xy"]
    return [xy[ring_off[r] : ring_off[r + 1]] for r in range(shape_rings[k], shape_rings[k + 1])]


def _inside(rings: list[np.ndarray], nx: int, ny: int) -> bool:
    """Whether rings in cell coordinates lie within [0, nx] x [0, ny]."""
    return all(r.min() >= 0 and r[:, 0].max() <= nx and r[:, 1].max() <= ny for r in rings)


def _draw_parts(
    layer: np.ndarray, parts: list[list[np.ndarray]], is_line: bool, thickness: int, scratch: np.ndarray
) -> None:
    """Draw a shape's parts (lists of rings in cell coordinates) into its class's canvas, in place."""
    import cv2

    for part in parts:
        # Vertices rounded (lines: floored) after clipping, as the devkit; cv2 (col, row) = (x, y).
        pts = [
            np.ascontiguousarray(np.floor(p) if is_line else np.round(p), dtype=np.int32).reshape(-1, 1, 2)
            for p in part
        ]
        if is_line:
            cv2.polylines(layer, pts, False, 1, thickness)
        elif len(pts) == 1:
            cv2.fillPoly(layer, pts, 1)
        else:  # holes clear only their own polygon, not others drawn before
            scratch[:] = 0
            cv2.fillPoly(scratch, pts[:1], 1)
            cv2.fillPoly(scratch, pts[1:], 0)
            layer |= scratch


def devkit_map_mask(nusc_map, translation: np.ndarray, yaw: float, classes: Sequence[str], grid: Grid) -> np.ndarray:
    """(len(classes), X, Y) bool: the devkit's own NuScenesMap.get_map_mask of the grid around an ego
    pose, in the [x_index, y_index] layout; a class of several layers ("divider") is their union.

    BEVFusion's call: the patch centred on the grid centre, patch_angle the ego yaw in degrees,
    canvas (ny, nx), the canvas [y, x] transposed. The independent reference rasterize_map is
    checked against (tests, scripts/check_map_targets.py); slow (shapely per call).
    """
    (xlo, xhi, _), (ylo, yhi, _) = grid.xbound, grid.ybound
    c, s = np.cos(yaw), np.sin(yaw)
    centre = np.array([[c, -s], [s, c]]) @ np.array([(xlo + xhi) / 2, (ylo + yhi) / 2]) + np.asarray(translation)[:2]
    layers = sorted({layer for name in classes for layer in MAP_CLASSES[name]})
    with _devkit_multiline_fix():
        m = nusc_map.get_map_mask(
            (centre[0], centre[1], yhi - ylo, xhi - xlo), float(np.degrees(yaw)), layers, canvas_size=(grid.ny, grid.nx)
        ).astype(bool)
    per_layer = dict(zip(layers, m.transpose(0, 2, 1)))
    return np.stack([np.logical_or.reduce([per_layer[layer] for layer in MAP_CLASSES[name]]) for name in classes])


@contextmanager
def _swapped(owner, name: str, value):
    """owner.name = value within the block, restored after (the devkit fixes below). The original is
    read statically, so a class's staticmethod is put back as a staticmethod."""
    original = inspect.getattr_static(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def devkit_render_fix():
    """descartes 1.1, which draws the devkit's polygon layers (render_map_patch, render_layers, ...),
    reads shapely polygons as arrays, which shapely >= 2 refuses: every polygon layer of every map
    fails to draw. Within the block (`with devkit_render_fix():`), descartes gets GeoJSON instead."""
    import descartes
    from shapely.geometry import mapping

    original = descartes.PolygonPatch

    def polygon_patch(polygon, **kwargs):
        return original(mapping(polygon) if hasattr(polygon, "geom_type") else polygon, **kwargs)

    return _swapped(descartes, "PolygonPatch", polygon_patch)


def _devkit_multiline_fix():
    """nuscenes-devkit 1.2's mask_for_lines iterates a MultiLineString (a divider cut in pieces by the
    patch), which shapely >= 2 refuses with a TypeError; within the block, the same drawing over `.geoms`."""
    import cv2

    NuScenesMapExplorer = _map_api().NuScenesMapExplorer

    def mask_for_lines(lines, mask):
        for line in getattr(lines, "geoms", [lines]):
            cv2.polylines(mask, [np.asarray(line.coords, np.int32).reshape(-1, 2)], False, 1, 2)
        return mask

    return _swapped(NuScenesMapExplorer, "mask_for_lines", staticmethod(mask_for_lines))


def _devkit_patch(centre, ph: float, pw: float, angle: float) -> tuple:
    """The devkit's rotated global patch and its local box (get_patch_coord), for _devkit_clip_line."""
    from shapely import affinity
    from shapely.geometry import box

    cx, cy = float(centre[0]), float(centre[1])
    rotated = affinity.rotate(
        box(cx - pw / 2, cy - ph / 2, cx + pw / 2, cy + ph / 2), angle, origin=(cx, cy), use_radians=False
    )
    return cx, cy, ph, pw, angle, rotated, box(-pw / 2, -ph / 2, pw / 2, ph / 2)


def _devkit_clip_line(line: np.ndarray, patch: tuple, grid: Grid) -> list[list[np.ndarray]]:
    """A global polyline crossing the patch border, clipped and moved to cell coordinates by the
    devkit's own sequence of shapely operations: its border vertex comes out a hair above or below
    the border by float noise, which decides the truncated cell, so only the same steps give the same cells."""
    from shapely import affinity
    from shapely.geometry import LineString

    cx, cy, ph, pw, angle, rotated, local = patch
    g = LineString(line).intersection(rotated)
    if g.is_empty:
        return []
    g = affinity.affine_transform(
        affinity.rotate(g, -angle, origin=(cx, cy), use_radians=False), [1, 0, 0, 1, -cx, -cy]
    )
    g = g.intersection(local)
    g = affinity.scale(
        affinity.affine_transform(g, [1, 0, 0, 1, pw / 2, ph / 2]),
        xfact=grid.nx / pw,
        yfact=grid.ny / ph,
        origin=(0, 0),
    )
    return [[np.asarray(p.coords)] for p in getattr(g, "geoms", [g]) if p.geom_type == "LineString" and not p.is_empty]


def _clip(rings: list[np.ndarray], is_line: bool, nx: int, ny: int) -> list[list[np.ndarray]]:
    """Shape in cell coordinates -> its parts inside [0, nx] x [0, ny], each a list of rings.

    The devkit clips to the patch before rounding; a clipped edge gets a new vertex on the border,
    which rounds differently than the far vertex it replaces, so clipping first keeps the same cells.
    """
    if _inside(rings, nx, ny):
        return [rings]
    import shapely
    from shapely.geometry import LineString, Polygon

    if not is_line:
        # A ring of fewer than 3 distinct vertices (a sliver the map file may hold) has no area
        # and makes GEOS refuse the whole polygon: drop it.
        rings = [r for r in rings if len(np.unique(r, axis=0)) >= 3]
        if not rings or len(np.unique(rings[0], axis=0)) < 3:
            return []
    shape = LineString(rings[0]) if is_line else Polygon(rings[0], rings[1:])
    if not is_line and not shape.is_valid:
        shape = shape.buffer(0)
    try:
        clipped = shapely.clip_by_rect(shape, 0.0, 0.0, float(nx), float(ny))
    except shapely.errors.GEOSException:  # GEOS's rectangle clip can build a 3-point ring: use a general intersection
        clipped = shape.intersection(shapely.box(0.0, 0.0, float(nx), float(ny)))
    parts = []
    for g in getattr(clipped, "geoms", [clipped]):
        if g.is_empty:
            continue
        if g.geom_type == "LineString":
            parts.append([np.asarray(g.coords)])
        elif g.geom_type == "Polygon":
            parts.append([np.asarray(g.exterior.coords)] + [np.asarray(h.coords) for h in g.interiors])
    return parts
