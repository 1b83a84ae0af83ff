#!/usr/bin/env python
"""Boxes scored with the head's velocities and with velocities from tracks over the key frame before (0.5 s, inside
the nuScenes detection rules) and over two (1 s, outside them: labelled so wherever printed).

    .venv/bin/python scripts/track_velocity_scores.py INPUT ... --dataroot data/synthetic --out scores.json \
        [--version v1.0-mini] [--split mini_val] [--overwrite]

An INPUT is a results file (bev-eval's results_nusc.json, boxes as they are) or a detection checkpoint (or its run
folder): its val split run once, the maps decoded two ways, maxpool_circle (3x3 max-pool peaks, top 500, circle
NMS) and bevdet (bevdet_nuscenes's: no max-pool, Scale-NMS, 500 / 83 per group). Tracks take synthetic_det_cpu's
options. Writes mAP, NDS, TP errors, car AVE and per-class AP per variant to --out (JSON; replaced only with
--overwrite)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))  # bench_common, also when loaded by path

from bench_common import checkout_commit, processor_name  # noqa: E402

from bev.tasks.detection.nusc_eval import DEVKIT_CLASS_ORDER, evaluate  # noqa: E402
from bev.tasks.detection.tracking import TrackVelocity, sample_links, track_velocity  # noqa: E402
from bev.utils.io import atomic_write, check_output  # noqa: E402

MAXPOOL_CIRCLE = {"score_threshold": 0.1, "top_k": 500, "max_pool": True, "nms": "circle"}
OUTSIDE = "outside the nuScenes detection rules ({:g} s of past)"


def experiment_detection(name: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(REPO / "configs/experiment" / f"{name}.yaml").model.detection)


def decodings() -> dict[str, dict]:
    return {"maxpool_circle": MAXPOOL_CIRCLE, "bevdet": experiment_detection("bevdet_nuscenes")["decoding"]}


def velocities() -> dict[str, TrackVelocity | None]:
    """Velocity variant -> its tracks (None: the head's)."""
    options = {
        k: v for k, v in experiment_detection("synthetic_det_cpu")["track_velocity"].items() if k != "past_frames"
    }
    return {
        "head": None,
        "tracks_1_frame": TrackVelocity(past_frames=1, **options),
        "tracks_2_frames": TrackVelocity(past_frames=2, outside_rules=True, **options),
    }


def checkpoint_results(ckpt: str, dataroot: str) -> tuple[dict[str, dict], str]:
    """({decoding: {token: [result box, ...]}}, split) of a checkpoint's val split, run once."""
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from bev.inference import build_data_config, load_checkpoint, trained_on
    from bev.tasks.detection.scoring import DetectionScore

    # The scoring here replaces the checkpoint's own velocity setting.
    loaded = load_checkpoint(ckpt, model_config=OmegaConf.create({"detection": {"track_velocity": None}}))
    data_cfg = build_data_config(OmegaConf.create({"dataroot": dataroot}), loaded.run_config, trained_on(loaded))
    datamodule = instantiate(data_cfg)
    datamodule.setup("validate")
    frame = {"velocity_frame": loaded.model.task_modules.detection.decoding.get("velocity_frame", "ego")}
    scorers = {k: DetectionScore(loaded.model.grid, {**v, **frame}) for k, v in decodings().items()}
    with torch.no_grad():
        for batch in datamodule.val_dataloader():
            maps = loaded.model(batch)["detection"]  # {"heatmap", "regression"}
            for scorer in scorers.values():
                scorer.update(maps, batch["sample_token"])
    return {k: s.results(datamodule.val_set) for k, s in scorers.items()}, datamodule.val_set.split


def _row(metrics: dict, track: TrackVelocity | None) -> dict:
    row = {k: metrics[k] for k in ("mAP", "NDS", "mATE", "mAOE", "mAVE", "mAAE")}
    row.update(car_AVE=metrics["vel_err/car"], AP={c: metrics[f"AP/{c}"] for c in DEVKIT_CLASS_ORDER})
    row["past_seconds"] = 0.0 if track is None else track.past_seconds
    if track is not None and track.outside_rules:
        row["note"] = OUTSIDE.format(track.past_seconds)
    return row


def score(name: str, results: dict, nusc, args) -> dict[str, dict]:
    rows = {}
    for velocity, track in velocities().items():
        boxes = results if track is None else track_velocity(results, sample_links(nusc), track)
        with tempfile.TemporaryDirectory(prefix="bev-track-") as tmp:
            metrics = evaluate(boxes, args.dataroot, args.version, args.split, tmp, nusc=nusc)
        row = rows[f"{name}/{velocity}"] = _row(metrics, track)
        print(
            f"{name}, {velocity}: mAP {row['mAP']:.3f} NDS {row['NDS']:.3f} mAVE {row['mAVE']:.3f} car AVE "
            f"{row['car_AVE']:.2f} mAAE {row['mAAE']:.3f}" + (f"  [{row['note']}]" if "note" in row else ""),
            flush=True,
        )
    return rows


def _run_name(path: Path) -> str:
    """A run's folder for bev-eval's <run>/eval/results_nusc.json, else the path."""
    return path.parent.parent.name if path.parent.name == "eval" else str(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="+", type=Path, help="results files or detection checkpoints")
    ap.add_argument("--dataroot", required=True)
    ap.add_argument("--version", default="v1.0-mini")
    ap.add_argument("--split", default="mini_val")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = ap.parse_args(argv)
    try:  # before minutes of work, not after
        check_output(args.out, args.overwrite, "--out")
    except FileExistsError:
        sys.exit(
            f"track_velocity_scores.py: --out {args.out} exists: pass --overwrite to replace it, or write elsewhere"
        )
    except OSError as e:  # not a regular file
        sys.exit(f"track_velocity_scores.py: {e}")
    from nuscenes import NuScenes

    nusc = NuScenes(version=args.version, dataroot=args.dataroot, verbose=False)
    rows: dict[str, dict] = {}
    for path in args.inputs:
        if path.suffix == ".json":
            rows.update(score(_run_name(path), json.loads(path.read_text())["results"], nusc, args))
            continue
        results, args.split = checkpoint_results(str(path), args.dataroot)
        for decoding, boxes in results.items():
            rows.update(score(decoding, boxes, nusc, args))
    record = {
        "commit": checkout_commit(),
        "machine": processor_name(),
        "inputs": [str(p) for p in args.inputs],
        "split": args.split,
        "decodings": decodings(),
        "tracks": {k: None if v is None else vars(v) for k, v in velocities().items()},
        "variants": rows,
    }
    atomic_write(args.out, json.dumps(record, indent=2), args.overwrite)
    return 0


if __name__ == "__main__":
    sys.exit(main())
