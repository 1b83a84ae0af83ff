#!/usr/bin/env python
"""Map targets as training sees them vs the devkit's own get_map_mask, per class, over a split.

    .venv/bin/python scripts/check_map_targets.py --dataroot data/synthetic [--split mini_val] [--samples 48]

For evenly spaced samples of the split, the dataset's map channels (NuScenesBEVDataset.targets,
the cached geometry + bev.data.maps.rasterize_map) are compared with
bev.data.maps.devkit_map_mask (NuScenesMap.get_map_mask, BEVFusion's call) at the same ego pose.
Prints IoU per class (cells summed over the samples) and writes JSON to --out atomically.
Grids: "lss" is BEVFusion's 0.5 m grid, where the devkit's 2-pixel lines are the documented 1 m
divider width; "embedded" is synthetic_cpu's 1 m grid, where dividers stay 1 m wide but the
devkit draws 2 pixels (2 m), so only its polygon classes are expected to agree.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bev.data import NuScenesBEVDataset  # noqa: E402
from bev.data.maps import devkit_map_mask, ego_yaw  # noqa: E402
from bev.geometry import Grid  # noqa: E402
from bev.utils.io import atomic_write  # noqa: E402

GRIDS = {"lss": Grid(), "embedded": Grid(xbound=(-50, 50, 1.0), ybound=(-50, 50, 1.0), dbound=(4, 52, 2))}


def compare(dataroot: str, split: str, grid: Grid, samples: int, version: str = "v1.0-mini", cache_dir=None) -> dict:
    """{class: {"iou", "ours_cells", "devkit_cells"}} summed over `samples` evenly spaced samples."""
    from nuscenes.map_expansion.map_api import NuScenesMap

    ds = NuScenesBEVDataset(
        dataroot, version=version, split=split, grid=grid, map_layers="bevfusion", verbose=False, cache_dir=cache_dir
    )
    maps, k0 = {}, ds.num_object_classes
    inter, union = np.zeros(len(ds.map_layers)), np.zeros(len(ds.map_layers))
    ours_n, ref_n = np.zeros(len(ds.map_layers)), np.zeros(len(ds.map_layers))
    for i in np.unique(np.linspace(0, len(ds) - 1, min(samples, len(ds))).round().astype(int)):
        loc = str(ds.index["location"][i])
        nmap = maps.setdefault(loc, NuScenesMap(dataroot, loc))
        ours = ds.targets(int(i))[0][k0:].astype(bool)
        ref = devkit_map_mask(
            nmap, ds.index["ego_translation"][i], ego_yaw(ds.index["ego_rotation"][i]), ds.map_layers, grid
        )
        inter += (ours & ref).sum((1, 2))
        union += (ours | ref).sum((1, 2))
        ours_n += ours.sum((1, 2))
        ref_n += ref.sum((1, 2))
    return {
        name: {
            "iou": round(float(inter[k] / union[k]), 4) if union[k] else None,
            "ours_cells": int(ours_n[k]),
            "devkit_cells": int(ref_n[k]),
        }
        for k, name in enumerate(ds.map_layers)
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataroot", default="data/synthetic")
    p.add_argument("--version", default="v1.0-mini")
    p.add_argument("--split", default="mini_val")
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--cache-dir", default=None, help="split index cache (default <dataroot>/.bev_cache)")
    p.add_argument("--grids", nargs="+", choices=list(GRIDS), default=list(GRIDS))
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "map_targets_vs_devkit.json"))
    args = p.parse_args(argv)
    result = {
        "dataroot": args.dataroot,
        "split": args.split,
        "samples": args.samples,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "grids": {},
    }
    for name in args.grids:
        grid = GRIDS[name]
        per_class = compare(args.dataroot, args.split, grid, args.samples, args.version, args.cache_dir)
        result["grids"][name] = {"bounds": [grid.xbound, grid.ybound], "classes": per_class}
        print(f"{name} grid ({grid.xbound[2]} m cells), {args.split}, {args.samples} samples:")
        for cls, r in per_class.items():
            iou = "-" if r["iou"] is None else f"{r['iou']:.4f}"
            print(f"  {cls:14s} IoU {iou:>7s}  cells ours {r['ours_cells']:8d}  devkit {r['devkit_cells']:8d}")
    atomic_write(args.out, json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
