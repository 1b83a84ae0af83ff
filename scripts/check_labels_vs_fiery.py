#!/usr/bin/env python
"""Temporal labels (bev.data.temporal) vs FIERY's own loader and label warp, window by window.

    .venv/bin/python scripts/check_labels_vs_fiery.py --fiery-src /tmp/fiery [--dataroot DIR] [--split mini_train]

FIERY's FuturePredictionDataset (a checkout of github.com/wayveai/fiery, read-only; one stand-in module for its
lyft import) reads the same dataroot with its baseline settings, its labels moved into the present frame by its
cumulative_warp_features_reverse; its camera decoding is skipped. Reported over every window, with its visibility
filter on and off: instance IoU for label_warp "fiery" and "exact" and before any warp, the present frame's
centerness and offset differences, and the flow labels' error against the annotated motion (ours and FIERY's).
Without --dataroot a synthetic set is written to a temp folder first.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bev.data import NuScenesBEVDataset
from bev.data.maps import ego_yaw
from bev.tasks.motion import IGNORE
from bev.utils.io import atomic_write

PAST, FUTURE = 2, 4  # FIERY's baseline: TIME_RECEPTIVE_FIELD=3, N_FUTURE_FRAMES=4
BOUNDS = {
    "X_BOUND": [-50.0, 50.0, 0.5],
    "Y_BOUND": [-50.0, 50.0, 0.5],
    "Z_BOUND": [-10.0, 10.0, 20.0],
    "D_BOUND": [2.0, 50.0, 1.0],
}


def _ns(**kw) -> types.SimpleNamespace:
    return types.SimpleNamespace(**kw)


def fiery_dataset(fiery_src: Path, nusc, is_train: bool, filter_invisible: bool):
    """FIERY's FuturePredictionDataset over `nusc` at its baseline settings, images not decoded."""
    if "fiery.data" not in sys.modules:  # FIERY's checkout and a stand-in for the Lyft SDK it imports
        stub = Path(tempfile.mkdtemp(prefix="fiery_stubs_"))
        (stub / "lyft_dataset_sdk").mkdir()
        (stub / "lyft_dataset_sdk" / "__init__.py").write_text("")
        (stub / "lyft_dataset_sdk" / "lyftdataset.py").write_text("class LyftDataset:\n    pass\n")
        sys.path[:0] = [str(fiery_src), str(stub)]
    from fiery.data import FuturePredictionDataset

    FuturePredictionDataset.get_input_data = lambda self, rec: (
        torch.zeros(1, 1, 1),
        torch.zeros(1, 1, 1),
        torch.zeros(1, 1, 1),
    )
    cfg = _ns(
        TIME_RECEPTIVE_FIELD=PAST + 1,
        N_FUTURE_FRAMES=FUTURE,
        IMAGE=_ns(
            FINAL_DIM=(224, 480), RESIZE_SCALE=0.3, TOP_CROP=46, ORIGINAL_HEIGHT=900, ORIGINAL_WIDTH=1600, NAMES=[]
        ),
        LIFT=_ns(**BOUNDS),
        DATASET=_ns(FILTER_INVISIBLE_VEHICLES=filter_invisible, IGNORE_INDEX=IGNORE),
        MODEL=_ns(SUBSAMPLE=False),
    )
    return FuturePredictionDataset(nusc, is_train, cfg)


def fiery_present_labels(item: dict) -> dict[str, np.ndarray]:
    """FIERY's labels of one window moved into the present frame, as its trainer's prepare_future_labels."""
    from fiery.utils.geometry import cumulative_warp_features_reverse

    ego = item["future_egomotion"][None, PAST:]
    out = {}
    for key in ("instance", "centerness", "offset", "flow"):
        x = item[key][None, PAST:].float()
        x = x.unsqueeze(2) if key == "instance" else x
        warped = cumulative_warp_features_reverse(x, ego, mode="nearest", spatial_extent=(50.0, 50.0))
        out[key] = (warped[0, :, 0].long() if key == "instance" else warped[0]).numpy()
    out["own_frames"] = item["instance"][PAST:].numpy()
    return out


def annotated_motion(ds: NuScenesBEVDataset, frames: np.ndarray) -> list[dict[bytes, np.ndarray]]:
    """Per frame of the present + future: instance token -> box centre (x, y) in the present level frame, cells."""
    present = frames[PAST]
    R = ds.index["ego_rotation"][present]
    c, s = np.cos(ego_yaw(R)), np.sin(ego_yaw(R))
    level = np.array([[c, s], [-s, c]])
    out = []
    for i in frames[PAST:]:
        a, b = ds.index["box_offsets"][i], ds.index["box_offsets"][i + 1]
        g = ds.index["box_center"][a:b] @ ds.index["ego_rotation"][i].T + ds.index["ego_translation"][i]
        xy = (g[:, :2] - ds.index["ego_translation"][present][:2]) @ level.T / ds.grid.xbound[2]
        out.append(dict(zip(ds.index["box_instance"][a:b], xy)))
    return out


def flow_errors(instance: np.ndarray, flow: np.ndarray, ids: dict[bytes, int], motion: list[dict]) -> list[float]:
    """|flow - annotated motion| (cells) per instance and frame t whose flow label is defined."""
    errs = []
    for t in range(len(motion) - 1):
        for tok, k in ids.items():
            cells = instance[t] == k
            if not cells.any() or tok not in motion[t] or tok not in motion[t + 1]:
                continue
            f = flow[t][:, cells]
            if (f == IGNORE).any():
                continue
            errs.append(float(np.linalg.norm(f.mean(1) - (motion[t + 1][tok] - motion[t][tok]))))
    return errs


def window_ids(ds: NuScenesBEVDataset, frames: np.ndarray) -> dict[bytes, int]:
    """instance token -> id in the window (first appearance, as both loaders number them)."""
    ids: dict[bytes, int] = {}
    for i in frames:
        rows = np.arange(ds.index["box_offsets"][i], ds.index["box_offsets"][i + 1])
        if ds.filter_invisible:
            rows = rows[ds.index["box_visibility"][rows] != 1]
        for tok in ds.index["box_instance"][rows]:
            ids.setdefault(tok, len(ids) + 1)
    return ids


def compare(a: argparse.Namespace, nusc, cache_dir: str, filter_invisible: bool) -> dict:
    """The report's numbers for one setting of the visibility filter (both loaders the same)."""
    from bev.data.temporal import window_labels

    kw = {
        "version": a.version,
        "split": a.split,
        "past_frames": PAST,
        "future_frames": FUTURE,
        "filter_invisible": filter_invisible,
        "cache_dir": cache_dir,
        "verbose": False,
    }
    ours = {w: NuScenesBEVDataset(nusc.dataroot, label_warp=w, **kw) for w in ("fiery", "exact")}
    fiery = fiery_dataset(Path(a.fiery_src), nusc, a.split.endswith("train"), filter_invisible)
    ds = ours["exact"]
    by_tokens = {tuple(ds.index["sample_token"][ds.window_frames(w)]): w for w in range(len(ds))}
    inter, union = {"fiery": 0, "exact": 0, "own_frames": 0}, {"fiery": 0, "exact": 0, "own_frames": 0}
    cen_diff = off_diff = 0.0
    errs = {"ours": [], "fiery": []}
    n = 0
    for j in range(len(fiery))[: a.windows]:
        item = fiery[j]
        w = by_tokens[tuple(item["sample_token"])]
        ref = fiery_present_labels(item)
        frames = ds.window_frames(w)
        labels = {
            k: window_labels(d.index, frames, PAST, d.grid, d.filter_invisible, d.label_warp) for k, d in ours.items()
        }
        for k in ("fiery", "exact"):
            inter[k] += int(((labels[k]["instance"] == ref["instance"]) & (ref["instance"] > 0)).sum())
            union[k] += int(((labels[k]["instance"] > 0) | (ref["instance"] > 0)).sum())
        own = _own_frames(ds, frames)
        inter["own_frames"] += int(((own == ref["own_frames"]) & (own > 0)).sum())
        union["own_frames"] += int(((own > 0) | (ref["own_frames"] > 0)).sum())
        cen_diff = max(cen_diff, float(np.abs(labels["exact"]["centerness"][0] - ref["centerness"][0]).max()))
        off_diff = max(off_diff, float(np.abs(labels["exact"]["offset"][0] - ref["offset"][0]).max()))
        motion, ids = annotated_motion(ds, frames), window_ids(ds, frames)
        errs["ours"] += flow_errors(labels["exact"]["instance"], labels["exact"]["flow"], ids, motion)
        errs["fiery"] += flow_errors(ref["instance"], ref["flow"], ids, motion)
        n += 1
    return {
        "windows": n,
        "windows_ours": len(ds),
        "windows_fiery": len(fiery),
        "instance_iou": {k: round(inter[k] / max(union[k], 1), 5) for k in inter},
        "present_centerness_max_abs_diff": round(cen_diff, 6),
        "present_offset_max_abs_diff": round(off_diff, 6),
        "flow_error_cells": {k: _summary(v) for k, v in errs.items()},
    }


def _own_frames(ds: NuScenesBEVDataset, frames: np.ndarray) -> np.ndarray:
    """Our instance maps of the present + future frames, each in its own level frame (no warp)."""
    from bev.data.temporal import frame_instances, level_footprints

    ids, out = window_ids(ds, frames), []
    for i in frames[PAST:]:
        rows = np.arange(ds.index["box_offsets"][i], ds.index["box_offsets"][i + 1])
        rows = rows[np.isin(ds.index["box_instance"][rows], list(ids))]  # without the boxes filtered out
        if ds.filter_invisible:
            rows = rows[ds.index["box_visibility"][rows] != 1]
        feet = level_footprints(
            ds.index["box_center"][rows],
            ds.index["box_size"][rows],
            ds.index["box_rotation"][rows],
            ds.index["ego_rotation"][i],
        )
        out.append(frame_instances(feet, [ids[t] for t in ds.index["box_instance"][rows]], ds.grid))
    return np.stack(out)


def _summary(errs: list[float]) -> dict:
    e = np.asarray(errs)
    if not len(e):
        return {"pairs": 0}
    return {
        "pairs": len(e),
        "median": round(float(np.median(e)), 4),
        "p90": round(float(np.percentile(e, 90)), 4),
        "max": round(float(e.max()), 4),
    }


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fiery-src", required=True, help="a checkout of github.com/wayveai/fiery (outside this repo)")
    p.add_argument("--dataroot", default=None, help="nuScenes-format root (default: write a synthetic one)")
    p.add_argument("--version", default="v1.0-mini")
    p.add_argument("--split", default="mini_train")
    p.add_argument("--scenes", type=int, default=6, help="synthetic set only: scenes to write")
    p.add_argument("--samples", type=int, default=16, help="synthetic set only: key frames per scene")
    p.add_argument("--windows", type=int, default=None, help="compare at most this many windows")
    p.add_argument("--out", default="benchmarks/results/labels_vs_fiery.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    tmp = tempfile.TemporaryDirectory(prefix="labels_vs_fiery_")
    dataroot = a.dataroot
    if dataroot is None:
        from bev.data import make_synthetic

        dataroot = str(
            make_synthetic(
                Path(tmp.name) / "nuscenes", scenes=a.scenes, samples_per_scene=a.samples, seed=0, progress=False
            )
        )
    from nuscenes.nuscenes import NuScenes

    t = time.perf_counter()
    nusc = NuScenes(version=a.version, dataroot=dataroot, verbose=False)
    # FIERY's default drops visibility-1 boxes (FILTER_INVISIBLE_VEHICLES); both settings, both loaders alike
    report = {
        f"filter_invisible_{f}".lower(): compare(a, nusc, str(Path(tmp.name) / "cache"), f) for f in (True, False)
    }
    report.update(
        {
            "what": "bev.data.temporal labels vs FIERY's FuturePredictionDataset + cumulative_warp_features_reverse",
            "dataset": f"synthetic (bev.data.make_synthetic, {a.scenes} scenes x {a.samples} key frames, seed 0)"
            if a.dataroot is None
            else dataroot,
            "version": a.version,
            "split": a.split,
            "past_frames": PAST,
            "future_frames": FUTURE,
            "grid_xy": BOUNDS["X_BOUND"],
            "seconds": round(time.perf_counter() - t, 1),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    )
    atomic_write(Path(a.out), json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
