"""A tiny hand-made nuScenes-format dataset for reader tests (independent of bev.synthetic).

Two scenes (scene-0061 from mini_train, scene-0103 from mini_val), `samples` key frames each,
all 13 tables, smooth-textured 1600x900 JPEGs, a 6-camera rig from yaw angles, an ego pose
that moves and turns, cameras timestamped (and posed) slightly after LIDAR_TOP, and a few
vehicle / pedestrian boxes placed at known EGO-frame positions of each sample.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from PIL import Image

from bev.geometry import CAMERA_NAMES, quaternion_to_matrix

CAM_YAWS = {  # degrees, camera optical axis in the ego xy plane
    "CAM_FRONT_LEFT": 55.0, "CAM_FRONT": 0.0, "CAM_FRONT_RIGHT": -55.0,
    "CAM_BACK_LEFT": 110.0, "CAM_BACK": 180.0, "CAM_BACK_RIGHT": -110.0,
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
    """Smooth but non-repetitive colours, so warped pixels can be compared after resampling."""
    v, u = np.mgrid[0:H, 0:W].astype(np.float32)
    rng = np.random.default_rng(seed)
    ph = rng.uniform(0, 2 * np.pi, 6)
    r = 127 + 100 * np.sin(u / 97.0 + ph[0]) * np.cos(v / 71.0 + ph[1])
    g = 127 + 100 * np.sin((u + 2 * v) / 131.0 + ph[2])
    b = 127 + 100 * np.cos((u - v) / 57.0 + ph[3]) * np.sin(u / 203.0 + ph[4])
    return np.clip(np.stack([r, g, b], -1), 0, 255).astype(np.uint8)


def write_tiny(root: Path, samples: int = 2) -> Path:
    root = Path(root)
    tables: dict[str, list] = {t: [] for t in (
        "attribute", "calibrated_sensor", "category", "ego_pose", "instance", "log", "map",
        "sample", "sample_annotation", "sample_data", "scene", "sensor", "visibility")}
    for lvl, name in enumerate(["v0-40", "v40-60", "v60-80", "v80-100"], 1):
        tables["visibility"].append({"token": str(lvl), "level": name, "description": name})
    cats = sorted({b[0] for b in BOXES})
    for c in cats:
        tables["category"].append({"token": f"cat-{c}", "name": c, "description": c})
    tables["log"].append({"token": "log0", "logfile": "log0", "vehicle": "v", "date_captured": "2018-07-18",
                          "location": "singapore-onenorth"})
    tables["map"].append({"token": "map0", "log_tokens": ["log0"], "category": "semantic_prior",
                          "filename": "maps/map0.png"})
    (root / "maps").mkdir(parents=True, exist_ok=True)
    Image.new("L", (8, 8)).save(root / "maps" / "map0.png")
    channels = list(CAMERA_NAMES) + ["LIDAR_TOP"]
    for ch in channels:
        tables["sensor"].append({"token": f"sensor-{ch}", "channel": ch,
                                 "modality": "lidar" if ch == "LIDAR_TOP" else "camera"})
        if ch == "LIDAR_TOP":
            cs = {"translation": [0.9, 0.0, 1.8], "rotation": [1.0, 0, 0, 0], "camera_intrinsic": []}
        else:
            R = cam_to_ego_rotation(CAM_YAWS[ch])
            cs = {"translation": [1.0 * math.cos(math.radians(CAM_YAWS[ch])), 0.5 * math.sin(math.radians(CAM_YAWS[ch])), 1.5],
                  "rotation": _mat_to_quat(R), "camera_intrinsic": K}
        tables["calibrated_sensor"].append({"token": f"cs-{ch}", "sensor_token": f"sensor-{ch}", **cs})
    instances: dict[tuple, dict] = {}
    seed = 0
    for si, (scene_name, x0) in enumerate([("scene-0061", 100.0), ("scene-0103", 500.0)]):
        scene_tok = f"scene{si}"
        sample_toks = [f"s{si}-{k}" for k in range(samples)]
        for k, stok in enumerate(sample_toks):
            t0 = 1_531_000_000_000_000 + si * 10**9 + k * 500_000
            ego_yaw = 0.3 + 0.2 * k
            ego_t = np.array([x0 + 5.0 * k, 200.0 + 2.0 * k, 0.0])
            tables["sample"].append({"token": stok, "timestamp": t0, "scene_token": scene_tok,
                                     "prev": sample_toks[k - 1] if k else "",
                                     "next": sample_toks[k + 1] if k + 1 < samples else ""})
            for ci, ch in enumerate(channels):
                dt = 0 if ch == "LIDAR_TOP" else 10_000 * (ci + 1)
                # Each camera has its own ego pose (the ego moved and turned since LIDAR_TOP).
                ep = {"token": f"ep-{stok}-{ch}", "timestamp": t0 + dt,
                      "translation": (ego_t + np.array([0.4 * dt / 1e4, 0.1 * dt / 1e4, 0.0])).tolist(),
                      "rotation": _mat_to_quat(_rz(ego_yaw + 0.01 * dt / 1e4))}
                tables["ego_pose"].append(ep)
                if ch == "LIDAR_TOP":
                    fn, fmt, h, w = f"samples/LIDAR_TOP/{stok}.pcd.bin", "pcd", 0, 0
                else:
                    fn, fmt, h, w = f"samples/{ch}/{stok}__{ch}.jpg", "jpg", H, W
                    (root / "samples" / ch).mkdir(parents=True, exist_ok=True)
                    Image.fromarray(texture(seed)).save(root / fn, quality=90)
                    seed += 1
                tables["sample_data"].append({
                    "token": f"sd-{stok}-{ch}", "sample_token": stok, "ego_pose_token": ep["token"],
                    "calibrated_sensor_token": f"cs-{ch}", "timestamp": t0 + dt, "fileformat": fmt,
                    "is_key_frame": True, "height": h, "width": w, "filename": fn, "prev": "", "next": ""})
            Re = _rz(ego_yaw)
            for bi, (cat, ex, ey, yaw, size, vis) in enumerate(BOXES):
                centre = Re @ np.array([ex, ey, size[2] / 2]) + ego_t
                itok = f"inst{si}-{bi}"
                atok = f"ann-{stok}-{bi}"
                inst = instances.setdefault(itok, {"token": itok, "category_token": f"cat-{cat}", "nbr_annotations": 0,
                                                   "first_annotation_token": atok, "last_annotation_token": atok})
                inst["nbr_annotations"] += 1
                inst["last_annotation_token"] = atok
                tables["sample_annotation"].append({
                    "token": atok, "sample_token": stok, "instance_token": itok, "visibility_token": vis,
                    "attribute_tokens": [], "translation": centre.tolist(), "size": list(size),
                    "rotation": _mat_to_quat(_rz(ego_yaw + yaw)), "prev": "", "next": "",
                    "num_lidar_pts": 10, "num_radar_pts": 0})
        tables["scene"].append({"token": scene_tok, "log_token": "log0", "nbr_samples": samples,
                                "first_sample_token": sample_toks[0], "last_sample_token": sample_toks[-1],
                                "name": scene_name, "description": "tiny"})
    tables["instance"] = list(instances.values())
    (root / "samples" / "LIDAR_TOP").mkdir(parents=True, exist_ok=True)
    ver = root / "v1.0-mini"
    ver.mkdir(parents=True, exist_ok=True)
    for name, rows in tables.items():
        (ver / f"{name}.json").write_text(json.dumps(rows))
    return root


def ego_box(i: int) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """(category, centre, wlh, box->ego rotation) of BOXES[i] in the ego frame, as written."""
    cat, ex, ey, yaw, size, _ = BOXES[i]
    return cat, np.array([ex, ey, size[2] / 2]), np.array(size), quaternion_to_matrix(_mat_to_quat(_rz(yaw)))
