"""CPU ms per sample of the synthetic writer's sample job (samples._sample_files) and its parts, the numpy casters
(BEV_RAYCAST=numpy) against the native ones, one thread, alternating in one process; medians over rounds.

    PYTHONPATH=. python scripts/bench_synthetic.py --rounds 5 --samples 8 --out /tmp/bench_synthetic.json

(The timer lives here, beside what it wraps; scripts/ keeps a 3-line entry point within its line budget.)

CPU time (time.process_time), not wall: these machines are shared. A part's time includes what it calls; a part
entered again from within itself (a group such as "cast") counts once."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from bev.synthetic import lidar, native, raycast, samples, writer

# part -> the functions it times, (module, attribute) each.
PARTS = {
    "job": [(samples, "_sample_files")],
    "parts": [(raycast, "sample_parts")],
    "cameras": [(raycast, "render_sample")],
    "cam_rects": [(raycast, "_part_rects")],
    "cam_ground": [(raycast, "_ground_render")],
    "cast": [(raycast, n) for n in ("_slab", "_front", "_coverage", "zbuffer_numpy")] + [(native, "zbuffer")],
    "cam_shade": [(raycast, "_colours"), (native, "shade")],
    "lidar": [(samples, "lidar_key_frame")],
    "lidar_cast": [(lidar, "cast")],
    "lidar_cloud": [(lidar, "_cloud")],
    "lidar_off_faces": [(lidar, "_off_faces")],
    "lidar_intensity": [(lidar, "intensity")],
    "lidar_counts": [(lidar, "points_in_boxes")],
    "jpeg": [(samples, "camera_jpeg")],
}
spent, depth = defaultdict(float), defaultdict(int)  # part -> CPU seconds, calls open now


def _timed(part: str, fn):  # fn counting its CPU time to `part`, once however deep it nests
    def wrapper(*args, **kwargs):
        depth[part] += 1
        t0 = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            depth[part] -= 1
            if depth[part] == 0:
                spent[part] += time.process_time() - t0

    return wrapper


def _write(samples_per_scene: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        kwargs = dict(workers=1, progress=False, render_scale=4, occupancy=False, image_size="render", lidar_sweeps=0)
        writer.make_synthetic(f"{d}/set", 1, samples_per_scene, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5), ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for part, module, name in ((p, m, n) for p, where in PARTS.items() for m, n in where):
        setattr(module, name, _timed(part, getattr(module, name)))
    backends, runs = ("numpy", "native"), {"numpy": defaultdict(list), "native": defaultdict(list)}
    _write(args.samples)  # warm-up: the map tiles, the world, the cameras' rays
    for _ in range(args.rounds):
        for b in backends:
            spent.clear()
            with native.backend(b):
                _write(args.samples)
            for part in PARTS:
                runs[b][part].append(1e3 * spent[part] / args.samples)
    table = {p: {b: round(statistics.median(runs[b][p]), 2) for b in backends} for p in PARTS}
    for p, v in table.items():
        print(f"{p:16s} numpy {v['numpy']:7.2f}  native {v['native']:7.2f} ms/sample")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "what": __doc__.split("\n\n")[0].replace("\n", " "),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "commands": {"bench": "PYTHONPATH=. python " + " ".join(sys.argv)},
        "parts": {p: ", ".join(f"{m.__name__.split('.')[-1]}.{n}" for m, n in w) for p, w in PARTS.items()},
        "per_sample_cpu_ms": table,
        "speedup": {p: round(v["numpy"] / v["native"], 2) for p, v in table.items() if v["native"] > 0},
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
