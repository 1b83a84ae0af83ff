#!/usr/bin/env python
"""Where a detector's boxes go wrong: centre errors by range, split along the line of sight and across it.

    .venv/bin/python scripts/det_range_errors.py outputs/synthetic_det_cpu/eval/results_nusc.json \
        --dataroot data/synthetic [--version v1.0-mini] [--split mini_val] [--classes car pedestrian]

Each ground-truth box the devkit scores (its class ranges, boxes with points) is matched to the nearest
predicted box of its class above --min-score within --max-dist metres, in the LIDAR_TOP frame of its sample.
Per range bin: how many were found, the median radial error (along the ray from the sensor: depth) and
tangential error (across it), the mean radial bias and the share within 0.5 m (the devkit's strictest
match). A camera model's depth is the usual culprit; this tells whether it is. Writes JSON to --out atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bev.geometry import quaternion_to_matrix  # noqa: E402
from bev.utils.io import atomic_write  # noqa: E402

BINS = ((0, 10), (10, 20), (20, 30), (30, 40), (40, 50))


def _lidar_frame(nusc, sample_token: str):
    """Global xyz -> the sample's LIDAR_TOP frame."""
    sd = nusc.get("sample_data", nusc.get("sample", sample_token)["data"]["LIDAR_TOP"])
    pose, cs = nusc.get("ego_pose", sd["ego_pose_token"]), nusc.get("calibrated_sensor", sd["calibrated_sensor_token"])
    r_pose, r_cs = quaternion_to_matrix(pose["rotation"]), quaternion_to_matrix(cs["rotation"])

    def to_lidar(p):
        return ((np.asarray(p) - pose["translation"]) @ r_pose - cs["translation"]) @ r_cs

    return to_lidar


def centre_errors(results: dict, nusc, split: str, cls: str, min_score: float, max_dist: float) -> np.ndarray:
    """Rows (range, radial error, tangential error) per scored ground-truth box; NaN errors when not found."""
    from nuscenes.eval.common.config import config_factory
    from nuscenes.eval.common.loaders import add_center_dist, filter_eval_boxes, load_gt
    from nuscenes.eval.detection.data_classes import DetectionBox

    gt = load_gt(nusc, split, DetectionBox, verbose=False)
    gt = filter_eval_boxes(nusc, add_center_dist(nusc, gt), config_factory("detection_cvpr_2019").class_range)
    rows = []
    for tok in gt.sample_tokens:
        to_lidar = _lidar_frame(nusc, tok)
        preds = [b for b in results.get(tok, []) if b["detection_name"] == cls and b["detection_score"] >= min_score]
        found = np.array([to_lidar(b["translation"])[:2] for b in preds]).reshape(-1, 2)
        for box in gt[tok]:
            if box.detection_name != cls:
                continue
            c = to_lidar(box.translation)[:2]
            r = float(np.linalg.norm(c))
            e = found - c
            k = int(np.argmin(np.linalg.norm(e, axis=1))) if len(e) else -1
            if k < 0 or np.linalg.norm(e[k]) > max_dist:
                rows.append((r, np.nan, np.nan))
                continue
            u = c / max(r, 1e-6)
            rows.append((r, float(e[k] @ u), float(e[k][1] * u[0] - e[k][0] * u[1])))
    return np.array(rows, dtype=np.float64).reshape(-1, 3)


def summarize(rows: np.ndarray) -> list[dict]:
    out = []
    for lo, hi in BINS:
        inbin = rows[(rows[:, 0] >= lo) & (rows[:, 0] < hi)]
        hit = inbin[~np.isnan(inbin[:, 1])]
        if not len(inbin):
            continue
        rec = {"range_m": [lo, hi], "boxes": len(inbin), "found": round(len(hit) / len(inbin), 3)}
        if len(hit):
            rec |= {
                "radial_median_m": round(float(np.median(np.abs(hit[:, 1]))), 3),
                "radial_bias_m": round(float(np.mean(hit[:, 1])), 3),
                "tangential_median_m": round(float(np.median(np.abs(hit[:, 2]))), 3),
                "within_0.5m": round(float(np.mean(np.hypot(hit[:, 1], hit[:, 2]) < 0.5)), 3),
            }
        out.append(rec)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a results_nusc.json (bev-eval writes one)")
    ap.add_argument("--dataroot", default="data/synthetic")
    ap.add_argument("--version", default="v1.0-mini")
    ap.add_argument("--split", default="mini_val")
    ap.add_argument("--classes", nargs="+", default=["car", "pedestrian"])
    ap.add_argument("--min-score", type=float, default=0.25)
    ap.add_argument("--max-dist", type=float, default=2.0, help="metres: farther is not found (the devkit's 2 m)")
    ap.add_argument("--out", default=None, help="JSON (default: range_errors.json beside the results)")
    args = ap.parse_args()
    from nuscenes import NuScenes

    results = json.loads(Path(args.results).read_text())["results"]
    nusc = NuScenes(args.version, args.dataroot, verbose=False)
    report = {"results": str(args.results), "min_score": args.min_score, "max_dist_m": args.max_dist, "classes": {}}
    for cls in args.classes:
        table = summarize(centre_errors(results, nusc, args.split, cls, args.min_score, args.max_dist))
        report["classes"][cls] = table
        print(f"{cls}:  range  boxes  found  |radial|  bias  |tangential|  within 0.5 m")
        for t in table:
            print(
                f"  {t['range_m'][0]:2d}-{t['range_m'][1]:2d} m {t['boxes']:6d} {t['found']:6.2f}"
                f"  {t.get('radial_median_m', float('nan')):7.2f} {t.get('radial_bias_m', float('nan')):+5.2f}"
                f"  {t.get('tangential_median_m', float('nan')):10.2f}  {t.get('within_0.5m', float('nan')):8.2f}"
            )
    out = Path(args.out or Path(args.results).with_name("range_errors.json"))
    atomic_write(out, json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
