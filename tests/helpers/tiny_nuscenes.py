"""A tiny hand-made nuScenes-format dataset for reader tests (independent of bev.synthetic).

Two scenes (scene-0061 from mini_train, scene-0103 from mini_val), `samples` key frames each,
all 13 tables, smooth-textured 1600x900 JPEGs, a 6-camera rig from yaw angles, an ego pose
that moves and turns, cameras timestamped (and posed) slightly after LIDAR_TOP, and a few
vehicle / pedestrian boxes placed at known EGO-frame positions of each sample.

The log's location is singapore-onenorth and maps/expansion/singapore-onenorth.json is a small
map expansion (v1.3 schema, readable by the devkit's NuScenesMap): an intersection centred at
(110, 205) next to scene-0061's ego poses, a straight road under scene-0103's, and one parking
spot (carpark_area) exactly under the truck (BOXES[1]) of scene-0061's first sample.
"""

from __future__ import annotations

import atexit
import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from bev.geometry import CAMERA_NAMES, quaternion_to_matrix

CAM_YAWS = {  # degrees, camera optical axis in the ego xy plane
    "CAM_FRONT_LEFT": 55.0,
    "CAM_FRONT": 0.0,
    "CAM_FRONT_RIGHT": -55.0,
    "CAM_BACK_LEFT": 110.0,
    "CAM_BACK": 180.0,
    "CAM_BACK_RIGHT": -110.0,
}
W, H = 1600, 900
K = [[1260.0, 0.0, 800.0], [0.0, 1260.0, 450.0], [0.0, 0.0, 1.0]]

# (category, ego x, ego y, yaw rad in ego, (w, l, h), visibility token)
BOXES = [
    ("vehicle.car", 12.3, 2.1, 0.0, (1.9, 4.5, 1.6), "4"),
    ("vehicle.truck", -15.0, -4.0, 0.6, (2.5, 7.0, 3.0), "2"),
    ("human.pedestrian.adult", 8.0, -3.0, 0.0, (0.6, 0.6, 1.7), "3"),
    ("vehicle.bus.rigid", 3.0, 14.0, math.pi / 2, (2.9, 11.0, 3.5), "1"),
]


def _ground_sweep() -> np.ndarray:
    """A LIDAR_TOP file's points (x, y, z, intensity, ring) float32: a ground grid 1.8 m below the sensor."""
    xs, ys = np.meshgrid(np.arange(-40.0, 40.0, 1.0), np.arange(-40.0, 40.0, 1.0))
    n = xs.size
    return np.stack([xs.ravel(), ys.ravel(), np.full(n, -1.8), np.full(n, 10.0), np.zeros(n)], 1).astype(np.float32)


def _mat_to_quat(R: np.ndarray) -> list[float]:
    w = math.sqrt(max(0.0, 1 + R[0, 0] + R[1, 1] + R[2, 2])) / 2
    x = math.copysign(math.sqrt(max(0.0, 1 + R[0, 0] - R[1, 1] - R[2, 2])) / 2, R[2, 1] - R[1, 2])
    y = math.copysign(math.sqrt(max(0.0, 1 - R[0, 0] + R[1, 1] - R[2, 2])) / 2, R[0, 2] - R[2, 0])
    z = math.copysign(math.sqrt(max(0.0, 1 - R[0, 0] - R[1, 1] + R[2, 2])) / 2, R[1, 0] - R[0, 1])
    return [w, x, y, z]


def _rz(yaw: float) -> np.ndarray:
    c, s = math.cos(yaw), math.sin(yaw)
    return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1.0]])


def cam_to_ego_rotation(yaw_deg: float) -> np.ndarray:
    # Camera axes (x right, y down, z forward) -> ego (x fwd, y left, z up), then yaw.
    base = np.array([[0, 0, 1], [-1, 0, 0], [0, -1, 0]], dtype=np.float64)
    return _rz(math.radians(yaw_deg)) @ base


def texture(seed: int) -> np.ndarray:
    """Smooth but non-repetitive colours, so warped pixels can be compared after resampling. Each channel
    is a sum of products of a row and a column wave (sin(a + b) expanded), so no full-image trigonometry."""
    v, u = np.arange(H, dtype=np.float32)[:, None], np.arange(W, dtype=np.float32)[None, :]
    ph = np.random.default_rng(seed).uniform(0, 2 * np.pi, 6).astype(np.float32)
    r = np.sin(u / 97 + ph[0]) * np.cos(v / 71 + ph[1])
    # sin((u + 2v) / 131 + ph2), cos((u - v) / 57 + ph3):
    g = np.sin(u / 131 + ph[2]) * np.cos(2 * v / 131) + np.cos(u / 131 + ph[2]) * np.sin(2 * v / 131)
    b = (np.cos(u / 57 + ph[3]) * np.cos(v / 57) + np.sin(u / 57 + ph[3]) * np.sin(v / 57)) * np.sin(u / 203 + ph[4])
    out = np.empty((H, W, 3), np.uint8)
    for k, channel in enumerate((r, g, b)):
        out[..., k] = np.clip(127 + 100 * channel, 0, 255)
    return out


LOCATION = "singapore-onenorth"
SCENES = [("scene-0061", 100.0), ("scene-0103", 500.0)]  # (name, x of the first ego pose)


def ego_pose(scene: int, k: int) -> tuple[np.ndarray, float]:
    """Global translation and yaw (rad) of the LIDAR_TOP ego pose of sample k of SCENES[scene]."""
    return np.array([SCENES[scene][1] + 5.0 * k, 200.0 + 2.0 * k, 0.0]), 0.3 + 0.2 * k


def _rect(x0, x1, y0, y1):
    return [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]


def parking_spot() -> list[tuple[float, float]]:
    """Global footprint of the truck (BOXES[1]) in sample 0 of scene-0061."""
    _, ex, ey, yaw, (w, l, _h), _ = BOXES[1]
    t, ego_yaw = ego_pose(0, 0)
    R = _rz(ego_yaw)[:2, :2]
    c = R @ np.array([ex, ey]) + t[:2]
    h = _rz(ego_yaw + yaw)[:2, :2]
    return [tuple(c + h @ np.array([sx * l / 2, sy * w / 2])) for sx, sy in [(1, 1), (-1, 1), (-1, -1), (1, -1)]]


# Polygons: layer -> list of (exterior ring, [holes]); drivable_area records group polygons.
MAP_POLYGONS = {
    "drivable_area": [
        (_rect(40, 180, 198, 212), []),  # east-west road
        (_rect(103, 117, 130, 280), []),  # north-south road
        (_rect(130, 150, 225, 245), [_rect(136, 144, 231, 239)]),  # a square around an island (hole)
        (_rect(440, 570, 193, 211), []),  # scene-0103's road
    ],
    "road_segment": [(_rect(103, 117, 198, 212), []), (_rect(40, 103, 198, 212), [])],
    "lane": [(_rect(40, 103, 205, 212), [])],
    "ped_crossing": [(_rect(97, 102, 198, 212), []), ([(103, 214), (117, 215.5), (117, 219.5), (103, 218)], [])],
    "walkway": [([(40, 212), (101, 212), (101, 222), (97, 222), (97, 216), (40, 216)], [])],  # an L
    "stop_line": [(_rect(95, 96, 198, 205), [])],
    "carpark_area": [(_rect(60, 80, 225, 240), [])],  # + parking_spot()
}
MAP_LINES = {
    "road_divider": [
        [(40, 205), (103, 205)],
        [(117, 205), (180, 205)],
        [(110, 130), (110, 198)],
        [(440, 202), (570, 202)],
    ],
    "lane_divider": [[(40, 208.5), (103, 208.5)], [(120, 215), (160, 250)]],
}


def write_map(root: Path, location: str = LOCATION) -> Path:
    """maps/expansion/<location>.json in the nuScenes map expansion v1.3 schema."""
    m: dict[str, Any] = {
        "version": "1.3",
        "canvas_edge": [3000.0, 3000.0],
        "node": [],
        "line": [],
        "polygon": [],
        "traffic_light": [],
        "arcline_path_3": {},
        "connectivity": {},
        "lane_connector": [],
        "road_block": [],
    }

    def nodes(pts):
        toks = []
        for x, y in pts:
            toks.append(f"n{len(m['node'])}")
            m["node"].append({"token": toks[-1], "x": float(x), "y": float(y)})
        return toks

    def polygon(ext, holes):
        tok = f"p{len(m['polygon'])}"
        m["polygon"].append(
            {"token": tok, "exterior_node_tokens": nodes(ext), "holes": [{"node_tokens": nodes(h)} for h in holes]}
        )
        return tok

    polys = {k: list(v) for k, v in MAP_POLYGONS.items()}
    polys["carpark_area"].append((parking_spot(), []))
    m["drivable_area"] = [{"token": "da0", "polygon_tokens": [polygon(*p) for p in polys["drivable_area"]]}]
    for layer, items in polys.items():
        if layer == "drivable_area":
            continue
        m[layer] = []
        for k, p in enumerate(items):
            rec = {"token": f"{layer}{k}", "polygon_token": polygon(*p)}
            rec.update(
                {
                    "road_segment": {"is_intersection": k == 0, "drivable_area_token": "da0"},
                    "lane": {
                        "lane_type": "CAR",
                        "from_edge_line_token": None,
                        "to_edge_line_token": None,
                        "left_lane_divider_segments": [],
                        "right_lane_divider_segments": [],
                    },
                    "ped_crossing": {"road_segment_token": "road_segment0"},
                    "stop_line": {
                        "stop_line_type": "STOP_SIGN",
                        "ped_crossing_tokens": [],
                        "traffic_light_tokens": [],
                        "road_block_token": None,
                    },
                    "carpark_area": {"orientation": 0.0, "road_block_token": None},
                }.get(layer, {})
            )
            m[layer].append(rec)
    for layer, items in MAP_LINES.items():
        m[layer] = []
        for k, pts in enumerate(items):
            tok = f"l{len(m['line'])}"
            m["line"].append({"token": tok, "node_tokens": nodes(pts)})
            rec = {"token": f"{layer}{k}", "line_token": tok}
            rec.update(
                {"road_divider": {"road_segment_token": None}, "lane_divider": {"lane_divider_segments": []}}[layer]
            )
            m[layer].append(rec)
    path = root / "maps" / "expansion" / f"{location}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(m))
    return path


_WRITTEN: dict[tuple[int, bool], Path] = {}  # one pristine set per parameters and process, copied from


def write_tiny(root: Path, samples: int = 2, with_map: bool = True) -> Path:
    """The tiny set at root: written once per (samples, with_map) in this process, then copied (tests edit
    their copy's tables, images and map freely)."""
    key = (samples, with_map)
    if key not in _WRITTEN:
        cache = Path(tempfile.mkdtemp(prefix="bev_tiny_"))
        atexit.register(shutil.rmtree, cache, True)
        _WRITTEN[key] = _write_tiny(cache / "nuscenes", samples, with_map)
    shutil.copytree(_WRITTEN[key], root, dirs_exist_ok=True)
    return Path(root)


def _write_tiny(root: Path, samples: int, with_map: bool) -> Path:
    tables: dict[str, list] = {
        t: []
        for t in (
            "attribute",
            "calibrated_sensor",
            "category",
            "ego_pose",
            "instance",
            "log",
            "map",
            "sample",
            "sample_annotation",
            "sample_data",
            "scene",
            "sensor",
            "visibility",
        )
    }
    for lvl, name in enumerate(["v0-40", "v40-60", "v60-80", "v80-100"], 1):
        tables["visibility"].append({"token": str(lvl), "level": name, "description": name})
    cats = sorted({b[0] for b in BOXES})
    for c in cats:
        tables["category"].append({"token": f"cat-{c}", "name": c, "description": c})
    tables["log"].append(
        {"token": "log0", "logfile": "log0", "vehicle": "v", "date_captured": "2018-07-18", "location": LOCATION}
    )
    tables["map"].append(
        {"token": "map0", "log_tokens": ["log0"], "category": "semantic_prior", "filename": "maps/map0.png"}
    )
    (root / "maps").mkdir(parents=True, exist_ok=True)
    Image.new("L", (8, 8)).save(root / "maps" / "map0.png")
    channels = list(CAMERA_NAMES) + ["LIDAR_TOP"]
    for ch in channels:
        tables["sensor"].append(
            {"token": f"sensor-{ch}", "channel": ch, "modality": "lidar" if ch == "LIDAR_TOP" else "camera"}
        )
        if ch == "LIDAR_TOP":
            cs = {"translation": [0.9, 0.0, 1.8], "rotation": [1.0, 0, 0, 0], "camera_intrinsic": []}
        else:
            R = cam_to_ego_rotation(CAM_YAWS[ch])
            cs = {
                "translation": [
                    1.0 * math.cos(math.radians(CAM_YAWS[ch])),
                    0.5 * math.sin(math.radians(CAM_YAWS[ch])),
                    1.5,
                ],
                "rotation": _mat_to_quat(R),
                "camera_intrinsic": K,
            }
        tables["calibrated_sensor"].append({"token": f"cs-{ch}", "sensor_token": f"sensor-{ch}", **cs})
    instances: dict[tuple, dict] = {}
    seed = 0
    for si, (scene_name, _x0) in enumerate(SCENES):
        scene_tok = f"scene{si}"
        sample_toks = [f"s{si}-{k}" for k in range(samples)]
        for k, stok in enumerate(sample_toks):
            t0 = 1_531_000_000_000_000 + si * 10**9 + k * 500_000
            ego_t, ego_yaw = ego_pose(si, k)
            tables["sample"].append(
                {
                    "token": stok,
                    "timestamp": t0,
                    "scene_token": scene_tok,
                    "prev": sample_toks[k - 1] if k else "",
                    "next": sample_toks[k + 1] if k + 1 < samples else "",
                }
            )
            for ci, ch in enumerate(channels):
                dt = 0 if ch == "LIDAR_TOP" else 10_000 * (ci + 1)
                # Each camera has its own ego pose (the ego moved and turned since LIDAR_TOP).
                ep = {
                    "token": f"ep-{stok}-{ch}",
                    "timestamp": t0 + dt,
                    "translation": (ego_t + np.array([0.4 * dt / 1e4, 0.1 * dt / 1e4, 0.0])).tolist(),
                    "rotation": _mat_to_quat(_rz(ego_yaw + 0.01 * dt / 1e4)),
                }
                tables["ego_pose"].append(ep)
                if ch == "LIDAR_TOP":
                    fn, fmt, h, w = f"samples/LIDAR_TOP/{stok}.pcd.bin", "pcd", 0, 0
                    (root / "samples" / ch).mkdir(parents=True, exist_ok=True)
                    _ground_sweep().tofile(root / fn)
                else:
                    fn, fmt, h, w = f"samples/{ch}/{stok}__{ch}.jpg", "jpg", H, W
                    (root / "samples" / ch).mkdir(parents=True, exist_ok=True)
                    Image.fromarray(texture(seed)).save(root / fn, quality=90)
                    seed += 1
                tables["sample_data"].append(
                    {
                        "token": f"sd-{stok}-{ch}",
                        "sample_token": stok,
                        "ego_pose_token": ep["token"],
                        "calibrated_sensor_token": f"cs-{ch}",
                        "timestamp": t0 + dt,
                        "fileformat": fmt,
                        "is_key_frame": True,
                        "height": h,
                        "width": w,
                        "filename": fn,
                        "prev": "",
                        "next": "",
                    }
                )
            Re = _rz(ego_yaw)
            for bi, (cat, ex, ey, yaw, size, vis) in enumerate(BOXES):
                centre = Re @ np.array([ex, ey, size[2] / 2]) + ego_t
                itok = f"inst{si}-{bi}"
                atok = f"ann-{stok}-{bi}"
                inst = instances.setdefault(
                    itok,
                    {
                        "token": itok,
                        "category_token": f"cat-{cat}",
                        "nbr_annotations": 0,
                        "first_annotation_token": atok,
                        "last_annotation_token": atok,
                    },
                )
                inst["nbr_annotations"] += 1
                inst["last_annotation_token"] = atok
                tables["sample_annotation"].append(
                    {
                        "token": atok,
                        "sample_token": stok,
                        "instance_token": itok,
                        "visibility_token": vis,
                        "attribute_tokens": [],
                        "translation": centre.tolist(),
                        "size": list(size),
                        "rotation": _mat_to_quat(_rz(ego_yaw + yaw)),
                        "prev": "",
                        "next": "",
                        "num_lidar_pts": 10,
                        "num_radar_pts": 0,
                    }
                )
        tables["scene"].append(
            {
                "token": scene_tok,
                "log_token": "log0",
                "nbr_samples": samples,
                "first_sample_token": sample_toks[0],
                "last_sample_token": sample_toks[-1],
                "name": scene_name,
                "description": "tiny",
            }
        )
    tables["instance"] = list(instances.values())
    (root / "samples" / "LIDAR_TOP").mkdir(parents=True, exist_ok=True)
    ver = root / "v1.0-mini"
    ver.mkdir(parents=True, exist_ok=True)
    for name, rows in tables.items():
        (ver / f"{name}.json").write_text(json.dumps(rows))
    if with_map:
        write_map(root)
    return root


def ego_box(i: int) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """(category, centre, wlh, box->ego rotation) of BOXES[i] in the ego frame, as written."""
    cat, ex, ey, yaw, size, _ = BOXES[i]
    return cat, np.array([ex, ey, size[2] / 2]), np.array(size), quaternion_to_matrix(_mat_to_quat(_rz(yaw)))
