#!/usr/bin/env python
"""Loader benchmark: samples/s of NuScenesBEVDataset through a DataLoader for 0, 2, 4 workers,
and windows/s of its temporal windows (past_frames, future_frames).

    .venv/bin/python scripts/bench_loader.py [--dataroot DIR] [--split mini_train] [--past-frames 2 --future-frames 4]

Without --dataroot it writes a small synthetic nuScenes-format set to a temp folder. Each run
times `--batches` batches after one warm-up batch (worker start-up is reported separately),
with the training augmentation (6 full-HD JPEGs per sample). It also times single-process
decoding with and without JPEG draft (DCT-scaled) decoding. Windows (FIERY's baseline, 2 past
and 4 future frames, by default) decode the 3 input frames' JPEGs with the training augmentation;
their labels' share and validation windows served by the input memo are timed single-process.
--windows-only skips the single-frame measurements. --versus DIR times the training items of --dataroot and of
DIR (the same set written with another --image-size, say) alternately in one process, and nothing else:

    .venv/bin/python scripts/bench_loader.py --dataroot data/synthetic --versus /tmp/full --out /tmp/versus.json

Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from bev.data import NuScenesBEVDataset
from bev.data.temporal import collate, window_labels

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when a test runs this file with runpy
from bench_common import host_versions, write_report  # noqa: E402


def time_loader(ds, workers: int, batch_size: int, batches: int, unit: str = "sample") -> dict:
    """samples/s (or windows/s: unit) over `batches` batches after the first (whose start-up time is reported apart)."""
    dl = DataLoader(
        ds,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        drop_last=len(ds) >= batch_size,
        persistent_workers=workers > 0,
        collate_fn=collate,
    )
    t0 = time.perf_counter()
    it = iter(dl)
    n = 0
    first = None
    while n < batches + 1:
        try:
            batch = next(it)
        except StopIteration:  # small split: start another epoch (persistent workers stay up)
            it = iter(dl)
            continue
        if first is None:
            first = time.perf_counter() - t0
            t1 = time.perf_counter()
            samples = 0
        else:
            samples += batch["images"].shape[0]
        n += 1
    dt = time.perf_counter() - t1
    del it, dl
    return {
        "workers": workers,
        f"{unit}s": samples,
        "seconds": round(dt, 3),
        f"{unit}s_per_s": round(samples / dt, 2),
        "first_batch_s": round(first, 3),
    }


def time_decode(final_dim, reps: int = 20) -> dict:
    """ms per image to decode + augment one photo-like 1600x900 JPEG, with and without draft.

    Synthetic renders are flat-shaded and decode unusually fast; this image carries
    nuScenes-like size and detail (noise on smooth structure, ~0.25 MB at quality 90)."""
    import io

    import numpy as np
    from PIL import Image

    from bev.data.transforms import normalize_array, sample_augmentation, warp_image

    rng = np.random.default_rng(0)
    v, u = np.mgrid[0:900, 0:1600].astype(np.float32)
    base = 127 + 60 * np.sin(u[..., None] / np.array([37.0, 53.0, 71.0])) * np.cos(v[..., None] / 29.0)
    img = np.clip(base + rng.normal(0, 4, (900, 1600, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90)
    data = buf.getvalue()
    out = {"jpeg_bytes": len(data)}
    torch.manual_seed(0)
    augs = [sample_augmentation((900, 1600), final_dim, True) for _ in range(reps)]
    for draft in (True, False):
        t = time.perf_counter()
        for aug in augs:
            with Image.open(io.BytesIO(data)) as im:
                normalize_array(warp_image(im, aug, use_draft=draft))
        out["draft_ms" if draft else "full_decode_ms"] = round(1000 * (time.perf_counter() - t) / reps, 2)
    return out


def time_depth_target(ds, rounds: int = 5) -> dict:
    """Single-process samples/s without and with lidar depth targets (data.depth_target), alternating
    the two for `rounds` passes over up to 8 samples; medians."""
    import statistics

    n = min(len(ds), 8)
    rates = {False: [], True: []}
    for _ in range(rounds):
        for on in (False, True):
            ds.depth_target = on
            t = time.perf_counter()
            for i in range(n):
                ds[i]
            rates[on].append(n / (time.perf_counter() - t))
    ds.depth_target = False
    return {"off": round(statistics.median(rates[False]), 2), "on": round(statistics.median(rates[True]), 2)}


def parse_args(argv):
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataroot", default=None, help="nuScenes-format root (default: write a synthetic one)")
    p.add_argument("--version", default="v1.0-mini")
    p.add_argument("--split", default="mini_train")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--batches", type=int, default=10, help="timed batches per setting")
    p.add_argument("--final-dim", type=int, nargs=2, default=[128, 352])
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op threads of the main process (collate runs there with 0 workers)",
    )
    p.add_argument("--past-frames", type=int, default=2, help="windows: input frames before the present")
    p.add_argument("--future-frames", type=int, default=4, help="windows: label-only frames after it")
    p.add_argument("--windows-only", action="store_true", help="time the temporal windows only")
    p.add_argument("--versus", metavar="DIR", help="a second dataroot: single-process items/s of the two alone")
    p.add_argument("--rounds", type=int, default=5, help="--versus: alternated rounds (medians)")
    p.add_argument("--out", default="benchmarks/results/bench_loader_cpu.json")
    return p.parse_args(argv)


def synthetic_root() -> tuple[str, tempfile.TemporaryDirectory]:
    """A small synthetic nuScenes-format set in a temp folder: (dataroot, the folder to keep alive)."""
    from bev.data import make_synthetic

    tmp = tempfile.TemporaryDirectory(prefix="bench_loader_")
    t = time.perf_counter()
    # 3 scenes: mini_train gets 2 of 12 key frames, 12 windows of FIERY's 7 frames
    dataroot = str(make_synthetic(Path(tmp.name) / "nuscenes", scenes=3, samples_per_scene=12, seed=0, progress=False))
    print(f"synthetic dataset (3 scenes x 12 samples) written in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    return dataroot, tmp


def build_dataset(dataroot: str, a, cache_dir: str) -> tuple[NuScenesBEVDataset, float, float]:
    """The training-augmented dataset, with the seconds to build its index and to read it back from the cache."""
    t = time.perf_counter()
    ds = NuScenesBEVDataset(
        dataroot,
        version=a.version,
        split=a.split,
        final_dim=a.final_dim,
        augment=True,
        resize_lim=None,
        cache_dir=cache_dir,
    )
    index_s = time.perf_counter() - t
    t = time.perf_counter()
    NuScenesBEVDataset(dataroot, version=a.version, split=a.split, cache_dir=cache_dir, verbose=False)
    return ds, index_s, time.perf_counter() - t


def time_draft_decoding(ds) -> dict:
    """Single-process samples/s over up to 8 samples with and without JPEG draft decoding (leaves draft on)."""
    torch.manual_seed(0)
    decode = {}
    for draft in (True, False):
        ds.use_draft = draft
        ds[0]  # warm-up
        t = time.perf_counter()
        n = min(len(ds), 8)
        for i in range(n):
            ds[i]
        decode["draft" if draft else "full_decode"] = round(n / (time.perf_counter() - t), 2)
    ds.use_draft = True
    return decode


def time_loaders(ds, a) -> list[dict]:
    """time_loader for each --workers setting, each reported on stderr as it finishes."""
    results = []
    for w in a.workers:
        r = time_loader(ds, w, a.batch_size, a.batches)
        print(
            f"workers={w}: {r['samples_per_s']:.2f} samples/s (first batch {r['first_batch_s']:.2f}s)", file=sys.stderr
        )
        results.append(r)
    return results


def time_windows(dataroot: str, a, cache_dir: str) -> dict:
    """windows/s of the training-augmented temporal dataset (single process and DataLoaders), the labels'
    ms per window, and validation windows/s on a first pass and from the input memo (second pass)."""
    kw = {
        "version": a.version,
        "split": a.split,
        "final_dim": a.final_dim,
        "cache_dir": cache_dir,
        "verbose": False,
        "past_frames": a.past_frames,
        "future_frames": a.future_frames,
    }
    try:
        train = NuScenesBEVDataset(dataroot, augment=True, **kw)
    except ValueError as e:  # no scene of the split is long enough
        return {"skipped": str(e)}
    torch.manual_seed(0)
    out = {
        "past_frames": a.past_frames,
        "future_frames": a.future_frames,
        "windows_in_split": len(train),
        "jpegs_per_window": (a.past_frames + 1) * 6,
        "train_single_process_windows_per_s": _rate(train),
    }
    t = time.perf_counter()
    n = min(len(train), 8)
    for w in range(n):
        window_labels(train.index, train.window_frames(w), a.past_frames, train.grid)
    out["labels_ms_per_window"] = round(1000 * (time.perf_counter() - t) / n, 1)
    val = NuScenesBEVDataset(dataroot, augment=False, input_memo_mb=1024, **kw)
    out["val_single_process_windows_per_s"] = {"first_pass": _rate(val, len(val)), "from_memo": _rate(val, len(val))}
    print(f"windows ({a.past_frames} + 1 + {a.future_frames}), single process: {out}", file=sys.stderr)
    out["loader"] = []
    for w in a.workers:
        r = time_loader(train, w, a.batch_size, a.batches, unit="window")
        print(
            f"workers={w}: {r['windows_per_s']:.2f} windows/s (first batch {r['first_batch_s']:.2f}s)", file=sys.stderr
        )
        out["loader"].append(r)
    return out


def _rate(ds, n: int = 8) -> float:
    """Items per second over ds[0 .. min(n, len(ds)) - 1], in this process."""
    n = min(n, len(ds))
    t = time.perf_counter()
    for i in range(n):
        ds[i]
    return round(n / (time.perf_counter() - t), 2)


def host() -> dict:
    """CPUs, the affinity mask's size, the load at the end, and versions."""
    return {
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        **host_versions(),
    }


def single_frame(dataroot: str, a, cache_dir: str) -> dict:
    """The single-frame measurements: indexing, draft decoding, depth targets, a photo-like JPEG, loaders."""
    ds, index_s, cached_s = build_dataset(dataroot, a, cache_dir)
    decode = time_draft_decoding(ds)
    depth = time_depth_target(ds)
    print(f"single process, depth_target off / on: {depth}", file=sys.stderr)
    photo = time_decode(a.final_dim)
    print(f"photo-like JPEG: {photo}", file=sys.stderr)
    return {
        "samples_in_split": len(ds),
        "index_build_s": round(index_s, 3),
        "index_from_cache_s": round(cached_s, 3),
        "single_process_samples_per_s": decode,
        "depth_target_single_process_samples_per_s": depth,
        "photo_like_jpeg_decode_plus_augment_ms_per_image": photo,
        "loader": time_loaders(ds, a),
    }


def versus(a) -> dict:
    """Single-process training items/s (ms of CPU per item) of --dataroot and --versus, alternated over --rounds
    rounds of the same items and augmentations; medians."""
    import statistics

    roots = {"dataroot": a.dataroot, "versus": a.versus}
    sets = {}
    with tempfile.TemporaryDirectory(prefix="bench_cache_") as cache:
        for k, root in roots.items():
            sets[k] = build_dataset(root, a, str(Path(cache) / k))[0]
        n = min(16, *(len(ds) for ds in sets.values()))
        cpu = {k: [] for k in sets}
        for _ in range(a.rounds):
            for k, ds in sets.items():
                torch.manual_seed(0)
                t = time.process_time()
                for i in range(n):
                    ds[i]
                cpu[k].append(1000 * (time.process_time() - t) / n)
    out = {k: {"root": roots[k], "cpu_ms_per_item": round(statistics.median(v), 2)} for k, v in cpu.items()}
    out["items"], out["rounds"] = n, a.rounds
    out["ratio_versus_over_dataroot"] = round(out["versus"]["cpu_ms_per_item"] / out["dataroot"]["cpu_ms_per_item"], 3)
    return out


def main(argv=None) -> int:
    """Time indexing, decoding, the DataLoader settings and the windows, then write and print the report."""
    a = parse_args(argv)
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    if a.versus:
        if a.dataroot is None:
            raise SystemExit("bench_loader.py: --versus needs --dataroot too")
        report = {
            "benchmark": "training items of two datasets, alternated in one process (ms of CPU per item, medians)",
            "command": "python scripts/bench_loader.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "split": a.split,
            "final_dim": list(a.final_dim),
            **versus(a),
            "main_torch_threads": torch.get_num_threads(),
            "host": host(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        write_report(Path(a.out), report)
        print(json.dumps(report, indent=2))
        return 0
    # Both temp folders must outlive the dataset, which reads from them: keep them until main returns.
    dataroot, tmp = synthetic_root() if a.dataroot is None else (a.dataroot, None)
    cache = tempfile.TemporaryDirectory(prefix="bench_cache_")
    report = {
        "benchmark": "bev.data.NuScenesBEVDataset via torch DataLoader, training augmentation",
        "dataset": "synthetic (bev.data.make_synthetic, 3 scenes x 12 samples)" if tmp else dataroot,
        "version": a.version,
        "split": a.split,
        "batch_size": a.batch_size,
        "final_dim": list(a.final_dim),
        "cameras": 6,
        "raw_image": "1600x900 JPEG",
        **({} if a.windows_only else single_frame(dataroot, a, cache.name)),
        "windows": time_windows(dataroot, a, cache.name),
        "main_torch_threads": torch.get_num_threads(),
        "host": host(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_report(Path(a.out), report)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
