"""The one home of the target channels' names: object classes from `data.categories`, then map classes
from `data.map_layers`. Plain Python (no torch, no numpy), so that composing a config can call it."""

from __future__ import annotations

from typing import Any

POLYGON_LAYERS = (
    "drivable_area",
    "road_segment",
    "road_block",
    "lane",
    "ped_crossing",
    "walkway",
    "stop_line",
    "carpark_area",
)
LINE_LAYERS = ("road_divider", "lane_divider")
# The nuScenes detection classes (the devkit's category_to_detection_name), ordered so that the
# detection head's class groups (CenterPoint's, as BEVDet and BEVFusion use them) are contiguous.
DETECTION_CLASSES = (
    "car",
    "truck",
    "construction_vehicle",
    "bus",
    "trailer",
    "barrier",
    "motorcycle",
    "bicycle",
    "pedestrian",
    "traffic_cone",
)
DETECTION_GROUPS = (
    ("car",),
    ("truck", "construction_vehicle"),
    ("bus", "trailer"),
    ("barrier",),
    ("motorcycle", "bicycle"),
    ("pedestrian", "traffic_cone"),
)
MAP_CLASSES: dict[str, tuple[str, ...]] = {
    **{name: (name,) for name in POLYGON_LAYERS + LINE_LAYERS},
    "divider": ("road_divider", "lane_divider"),
}
PRESETS: dict[str, tuple[str, ...]] = {
    "bevfusion": ("drivable_area", "ped_crossing", "walkway", "stop_line", "carpark_area", "divider"),
    "lss": ("drivable_area", "divider"),
}


def normalize_categories(categories: Any) -> tuple[tuple[str, ...], ...]:
    """Category config -> one tuple of name prefixes per output class.

    "vehicle." or ["vehicle."] or ["vehicle.car", "vehicle.truck"] -> one class (bev (1, X, Y));
    [["vehicle."], ["human.pedestrian."]] -> K classes (bev (K, X, Y), channel k = group k).
    """
    if isinstance(categories, str):
        return ((categories,),)
    items = list(categories)
    if not items:
        raise ValueError("categories is empty: give prefixes such as ['vehicle.']")
    if all(isinstance(c, str) for c in items):
        return (tuple(items),)
    if any(isinstance(c, str) for c in items):
        raise ValueError(f"categories mixes prefixes and groups: {items}; use a list of prefixes or a list of lists")
    groups = tuple(tuple(str(p) for p in g) for g in items)
    if any(not g for g in groups):
        raise ValueError(f"categories has an empty group: {items}")
    return groups


def object_class_names(groups: tuple[tuple[str, ...], ...]) -> tuple[str, ...]:
    """One name per category group: ("vehicle.",) -> "vehicle", ("vehicle.car", "vehicle.bus") -> "vehicle_car+vehicle_bus"."""
    return tuple("+".join(p.strip(".").replace(".", "_") for p in g) for g in groups)


def class_names(categories: Any, map_layers: Any = None) -> tuple[str, ...]:
    """Target channel names: object classes, then map classes."""
    return object_class_names(normalize_categories(categories)) + normalize_map_layers(map_layers)


def normalize_map_layers(spec: Any) -> tuple[str, ...]:
    """data.map_layers -> tuple of map class names: a preset name, a class name, a list of class
    names, or None / [] / "none" for no map channels."""
    if spec is None or (isinstance(spec, str) and spec.lower() in ("", "none", "null")):
        return ()
    if isinstance(spec, str):
        spec = PRESETS[spec] if spec in PRESETS else [spec]
    names = tuple(str(s) for s in spec)
    unknown = [n for n in names if n not in MAP_CLASSES]
    if unknown:
        raise ValueError(
            f"unknown map layer(s) {unknown} in data.map_layers; valid names: {', '.join(MAP_CLASSES)}; "
            f"presets: {', '.join(f'{k} = {list(v)}' for k, v in PRESETS.items())}; or null for none"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"data.map_layers lists a class twice: {list(names)}")
    return names
