#!/usr/bin/env python
"""Benchmark the LiDAR branch's pillar scatter and the LiDAR loader (issue 61, section 2).

scatter (--section scatter): a nuScenes-sized 10-sweep cloud (the synthetic LiDAR's 32 beams x 1080 azimuths,
  cast at the ground or at a wall 5-60 m away, the ego moving 0.5 m between sweeps: about 300k points, the
  grid's 0.5 m 200x200 cells) scattered per pillar with C=64 PFN features: bev.ops.voxel_sum (native and torch
  backends), torch.index_add_, scatter_reduce "sum" and "amax" (PointPillars' max) and PillarMax (the same
  forward, the encoder's cheaper backward), forward and forward + backward, median time and peak memory
  (torch's allocations during the call, replayed from torch.profiler events), all outputs checked against a
  float64 index_add_.
loader (--section loader): bev.data.lidar's cost per item (key frame + N sweeps read, moved, augmented, cut to
  the grid) on a synthetic set written with sweeps (--dataroot, or one written to a temporary folder).

Writes benchmarks/results/bench_lidar_cpu.json (--out; one section updates its part) and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when run with runpy
from bench_common import (  # noqa: E402
    RESULTS,
    host_versions,
    processor_name,
    read_report,
    write_report,
)

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench_pool.py: shared machines
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bev.ops as ops  # noqa: E402
from bev.geometry import Grid  # noqa: E402
from bev.models.lidar import PillarMax, pillar_keys  # noqa: E402
from bev.synthetic.lidar import LIDAR_TRANSLATION, MAX_RANGE, beam_directions  # noqa: E402
from bev.utils.malloc import tune_malloc_in_process  # noqa: E402
from bev.utils.profiling import peak_cpu_bytes  # noqa: E402

CHANNELS = 64  # PointPillars' PFN width


def sweep_cloud(sweeps: int, seed: int = 0) -> torch.Tensor:
    """(P, 6) rows (batch 0, x, y, z, intensity, time lag) of `sweeps` spinning-LiDAR sweeps (module doc)."""
    rng = np.random.default_rng(seed)
    dirs = beam_directions().reshape(-1, 3)
    height = float(LIDAR_TRANSLATION[2])
    rows = []
    for k in range(sweeps):
        ground = np.where(dirs[:, 2] < 0, height / np.maximum(-dirs[:, 2], 1e-6), np.inf)
        wall = rng.uniform(5, 60, len(dirs))
        rng_m = np.minimum(ground, wall) + rng.normal(0, 0.02, len(dirs))
        keep = rng_m < MAX_RANGE
        xyz = dirs[keep] * rng_m[keep, None] + np.array([-0.5 * k, 0.0, height])
        feats = np.c_[np.zeros(len(xyz)), xyz, rng.uniform(0, 255, len(xyz)), np.full(len(xyz), 0.05 * k)]
        rows.append(feats)
    return torch.from_numpy(np.concatenate(rows)).float()


def methods(grid: Grid):
    """name -> fn(feats (P, C), cells (P, 3)) -> (B*X*Y, C) or (B, C, 1, X, Y) per-pillar reductions."""
    V = grid.nx * grid.ny

    def flat(cells):
        return (cells[:, 0] * grid.nx + cells[:, 1]) * grid.ny + cells[:, 2]

    def op(backend):
        def run(feats, cells):
            coords = torch.stack([cells[:, 0], torch.zeros_like(cells[:, 0]), cells[:, 1], cells[:, 2]], 1)
            return ops.voxel_sum(feats, coords, (1, 1, grid.nx, grid.ny), backend=backend)

        return run

    def index_add(feats, cells):
        return feats.new_zeros(V, feats.shape[1]).index_add(0, flat(cells), feats)

    def scatter(reduce):
        def run(feats, cells):
            idx = flat(cells)[:, None].expand_as(feats)
            return feats.new_zeros(V, feats.shape[1]).scatter_reduce(0, idx, feats, reduce, include_self=False)

        return run

    return {
        "bev.ops.voxel_sum native (sum)": op("native"),
        "bev.ops.voxel_sum torch (sum)": op("torch"),
        "torch index_add_ (sum)": index_add,
        "torch scatter_reduce sum": scatter("sum"),
        "torch scatter_reduce amax (max)": scatter("amax"),
        "PillarMax amax (max, the encoder's)": lambda feats, cells: PillarMax.apply(feats, flat(cells), V),
    }


def as_rows(out: torch.Tensor, V: int) -> torch.Tensor:
    return out.reshape(out.shape[1], V).T if out.dim() == 5 else out


def time_ms(fn, repeats: int) -> tuple[float, float]:
    """Median and fastest milliseconds of `repeats` calls."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), min(times)


def bench_scatter(repeats: int) -> dict:
    grid = Grid()
    points = sweep_cloud(10)
    cells, kept = pillar_keys(points, grid, 1)
    feats = torch.randn(len(cells), CHANNELS).relu_()  # PFN outputs are after a ReLU
    V = grid.nx * grid.ny
    f64 = torch.zeros(V, CHANNELS, dtype=torch.float64).index_add_(
        0, (cells[:, 1] * grid.ny + cells[:, 2]), feats.double()
    )
    occupied = int((f64.abs().sum(1) > 0).sum())
    info = {
        "points": len(points),
        "points_in_grid": int(kept.sum()),
        "channels": CHANNELS,
        "grid": [grid.nx, grid.ny],
        "cell_m": grid.xbound[2],
        "occupied_pillars": occupied,
        "points_per_occupied_pillar": int(kept.sum()) / max(occupied, 1),
    }
    rows = [measure(name, fn, feats, cells, f64, repeats) for name, fn in methods(grid).items()]
    return {**info, "rows": rows}


def measure(name: str, fn, feats: torch.Tensor, cells: torch.Tensor, f64: torch.Tensor, repeats: int) -> dict:
    """One method's forward and forward + backward: median ms and peak MB, and its difference from f64 (sums)."""
    V = f64.shape[0]
    leaf = feats.clone().requires_grad_()
    out = as_rows(fn(leaf, cells), V)
    diff = None if "max" in name else float((out.double() - f64).abs().max())
    grad = torch.randn_like(out)

    def fwd():
        with torch.no_grad():
            fn(feats, cells)

    def fwd_bwd():
        leaf.grad = None
        as_rows(fn(leaf, cells), V).backward(grad)

    row = {"method": name, "max_abs_diff_vs_float64_index_add": diff}
    for key, call in (("forward", fwd), ("fwd_bwd", fwd_bwd)):
        call()  # warm-up
        row[f"{key}_ms"], row[f"{key}_ms_min"] = time_ms(call, repeats)
        row[f"{key}_peak_mb"] = peak_cpu_bytes(call) / 2**20
    print(
        f"{name:34s} fwd {row['forward_ms']:7.2f} ms {row['forward_peak_mb']:6.1f} MB | fwd+bwd "
        f"{row['fwd_bwd_ms']:7.2f} ms {row['fwd_bwd_peak_mb']:6.1f} MB | diff {diff}",
        flush=True,
    )
    return row


def bench_loader(a) -> list[dict]:
    """bev.data.lidar's cost per item for each --sweeps value, with and without the max_points cap."""
    from bev.data.nuscenes import NuScenesBEVDataset
    from bev.synthetic.writer import make_synthetic

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_lidar_") as tmp:
        options = dict(scenes=2, samples_per_scene=3, lidar_sweeps=9, occupancy=False, progress=False)
        dataroot = a.dataroot or str(make_synthetic(Path(tmp) / "set", **options))
        for sweeps, cap in [(s, 300_000) for s in a.sweeps] + [(max(a.sweeps), 10**9)]:  # the cap's own cost
            lidar = {"enabled": True, "sweeps": sweeps, "max_points": cap}
            ds = NuScenesBEVDataset(dataroot, split="mini_train", lidar=lidar, verbose=False)
            i = 1 if len(ds) > 1 else 0  # a key frame with sweeps before it
            points = len(ds.lidar_item(i, None))  # and a warm-up (the sweep index is built at construction)
            ms, fastest = time_ms(functools.partial(ds.lidar_item, i, None), a.items)
            print(f"loader: {sweeps} sweeps, max_points {cap}: {points} points, {ms:.1f} ms per item", flush=True)
            row = {"sweeps": sweeps, "max_points": cap, "points": points, "ms_per_item": ms, "ms_min": fastest}
            rows.append({"dataroot": a.dataroot or "synthetic (temporary)", **row})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--section", choices=("scatter", "loader", "all"), default="all")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dataroot", default=None, help="a synthetic or nuScenes set with sweeps (default: write one)")
    ap.add_argument("--sweeps", type=int, nargs="+", default=[0, 3, 9], help="loader: sweeps per item")
    ap.add_argument("--items", type=int, default=10)
    ap.add_argument("--out", default=str(RESULTS / "bench_lidar_cpu.json"))
    args = ap.parse_args(argv)
    tune_malloc_in_process()
    report = read_report(args.out)
    report.update(
        {
            **host_versions(),
            "device_name": processor_name(),
            "threads": torch.get_num_threads(),
            "native_cpu": ops.native_available("cpu"),
            "statistic": f"median of {args.repeats} repeats (min also recorded; a shared 2-core machine)",
            "memory_method": "peak of torch allocations during the call (torch.profiler events, inputs excluded)",
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "load_average_at_start": list(os.getloadavg()),
        }
    )
    if args.section in ("scatter", "all"):
        report["scatter"] = bench_scatter(args.repeats)
    if args.section in ("loader", "all"):
        report["loader"] = bench_loader(args)
    report["load_average_at_end"] = list(os.getloadavg())
    write_report(args.out, report)


if __name__ == "__main__":
    main()
