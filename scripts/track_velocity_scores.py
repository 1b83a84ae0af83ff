#!/usr/bin/env python
"""The same boxes scored with the head's velocities and with velocities from their tracks (bev.detection.tracking).

    .venv/bin/python scripts/track_velocity_scores.py outputs/synthetic_det_cpu/eval/results_nusc.json ... \
        --dataroot data/synthetic [--version v1.0-mini] [--split mini_val] --out scores.json [--overwrite]

Each results file (bev-eval's, from a checkpoint trained with or without model.detection.track_velocity) is
scored by DetectionEval as it is, then again with every velocity and attribute replaced from the tracks, with
experiment=synthetic_det_cpu's track_velocity options (or --options JSON: one key frame of past at most, the nuScenes
detection rules'; scripts/det_rules_scores.py measures more). Positions, sizes, headings and scores
are untouched, so mAP stays and only the velocity and attribute errors (and NDS through them) move.
Writes JSON to --out atomically (an existing file only with --overwrite).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bev.detection.nusc_eval import evaluate  # noqa: E402
from bev.detection.tracking import TrackVelocity, sample_links, track_velocity  # noqa: E402
from bev.utils.io import atomic_write, check_output  # noqa: E402

KEYS = ("mAP", "NDS", "mAVE", "mAAE", "AP/car", "vel_err/car")
VELOCITY_CLASSES = ("car", "truck", "bus", "trailer", "construction_vehicle", "pedestrian", "motorcycle", "bicycle")


def experiment_options() -> dict:
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(REPO / "configs/experiment/synthetic_det_cpu.yaml")
    return OmegaConf.to_container(cfg.model.detection.track_velocity)


def _run_name(path: Path) -> str:
    """A run's folder for bev-eval's <run>/eval/results_nusc.json, else the path."""
    return path.parent.parent.name if path.parent.name == "eval" else str(path)


def _row(metrics: dict) -> dict:
    row = {k: metrics[k] for k in KEYS}
    row["vel_err"] = {c: metrics.get(f"vel_err/{c}") for c in VELOCITY_CLASSES}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--dataroot", required=True)
    ap.add_argument("--version", default="v1.0-mini")
    ap.add_argument("--split", default="mini_val")
    ap.add_argument("--options", type=json.loads, default=None, help="TrackVelocity options as JSON")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = ap.parse_args(argv)
    try:  # before minutes of scoring, not after
        check_output(args.out, args.overwrite, "--out")
    except FileExistsError:
        sys.exit(
            f"track_velocity_scores.py: --out {args.out} exists: pass --overwrite to replace it, or write elsewhere"
        )
    except OSError as e:  # not a regular file
        sys.exit(f"track_velocity_scores.py: {e}")
    options = args.options or experiment_options()
    try:
        track = TrackVelocity.from_config(options)
    except ValueError as e:  # e.g. more past than the detection rules allow
        sys.exit(f"track_velocity_scores.py: --options: {e}")
    from nuscenes import NuScenes

    nusc = NuScenes(version=args.version, dataroot=args.dataroot, verbose=False)
    rows = {}
    for path in args.results:
        results = json.loads(path.read_text())["results"]
        scores = {}
        for source, res in (("head", results), ("tracks", track_velocity(results, sample_links(nusc), track))):
            with tempfile.TemporaryDirectory(prefix="bev-track-") as tmp:
                scores[source] = _row(evaluate(res, args.dataroot, args.version, args.split, tmp, nusc=nusc))
        rows[_run_name(path)] = scores
        h, t = scores["head"], scores["tracks"]
        print(
            f"{_run_name(path)}: mAP {h['mAP']:.3f}; head NDS {h['NDS']:.3f} mAVE {h['mAVE']:.3f} car AVE {h['vel_err/car']:.2f}"
            f" mAAE {h['mAAE']:.3f} | tracks NDS {t['NDS']:.3f} mAVE {t['mAVE']:.3f} car AVE {t['vel_err/car']:.2f}"
            f" mAAE {t['mAAE']:.3f}"
        )
    atomic_write(
        args.out, json.dumps({"options": options, "split": args.split, "runs": rows}, indent=2), args.overwrite
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
