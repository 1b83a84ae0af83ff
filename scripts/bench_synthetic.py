#!/usr/bin/env python
"""What writing the synthetic set costs per sample, on one core: seconds and bytes.

    .venv/bin/python scripts/bench_synthetic.py [--samples 24] [--rounds 2] [--sweeps 0 3]

Writes one scene (make_synthetic, one worker) as `make train` does (--render-scale 4 --image-size render
--no-occupancy) once per round and per --sweeps value, timing the whole write, each sample's own work (its
renders, JPEGs, LiDAR and sweeps) and the LiDAR alone (the functions bev.synthetic.samples calls, wrapped here);
and the bytes of the files per sample: JPEGs, key-frame clouds (samples/LIDAR_TOP) and sweeps (sweeps/LIDAR_TOP).
Reports the median over rounds; writes JSON to --out atomically.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import checkout_commit, host_versions, processor_name, write_report  # noqa: E402

LIDAR_FUNCTIONS = ("lidar_points", "lidar_key_frame", "lidar_sweep")  # whichever this checkout's samples.py calls


class Timer:
    """Wraps module functions, adding their wall seconds to `seconds`."""

    def __init__(self, module, names):
        self.module, self.names, self.seconds, self.saved = module, [n for n in names if hasattr(module, n)], 0.0, {}

    def __enter__(self):
        for name in self.names:
            fn = self.saved[name] = getattr(self.module, name)
            setattr(self.module, name, self._timed(fn))
        return self

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.module, name, fn)


def folder_bytes(root: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in root.glob(pattern) if p.is_file())


def one_write(samples: int, sweeps: int | None, seed: int) -> dict:
    """Write one scene of `samples` key frames; seconds and bytes per sample."""
    from bev.synthetic import samples as sample_module
    from bev.synthetic.writer import make_synthetic

    kwargs = dict(scenes=1, samples_per_scene=samples, seed=seed, workers=1, progress=False)
    kwargs.update(render_scale=4, image_size="render", occupancy=False)
    if sweeps is not None:
        kwargs["lidar_sweeps"] = sweeps
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set"
        with Timer(sample_module, ["_sample_files"]) as job, Timer(sample_module, LIDAR_FUNCTIONS) as lidar:
            start, cpu = time.perf_counter(), time.process_time()
            make_synthetic(out, **kwargs)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        return {
            "write_s_per_sample": wall / samples,
            "write_cpu_s_per_sample": cpu / samples,
            "sample_job_s": job.seconds / samples,
            "lidar_s": lidar.seconds / samples,
            "jpeg_bytes": folder_bytes(out, "samples/CAM_*/*.jpg") / samples,
            "key_cloud_bytes": folder_bytes(out, "samples/LIDAR_TOP/*") / samples,
            "sweep_bytes": folder_bytes(out, "sweeps/LIDAR_TOP/*") / samples,
            "sweep_files": len(list(out.glob("sweeps/LIDAR_TOP/*"))),
        }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=24, help="key frames of the one scene written")
    p.add_argument("--rounds", type=int, default=2, help="writes per setting (medians)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweeps", type=int, nargs="*", default=None, help="lidar_sweeps values (this checkout's writer)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bench_synthetic_cpu.json"))
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from bev.synthetic.writer import make_synthetic

    has_sweeps = "lidar_sweeps" in inspect.signature(make_synthetic).parameters
    settings = (a.sweeps or [0]) if has_sweeps else [None]
    report = {
        "host": {**host_versions(), "processor": processor_name(), "threads": 1},
        "load_average_at_start": os.getloadavg()[0],
        "commit": checkout_commit(),
        "command": "python scripts/bench_synthetic.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "set": f"1 scene x {a.samples} key frames, seed {a.seed}, render scale 4, image size render, no occupancy",
        "sweeps": {},
    }
    for sweeps in settings:
        rounds = [one_write(a.samples, sweeps, a.seed) for _ in range(a.rounds)]
        rec = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        report["sweeps"][str(sweeps if sweeps is not None else 0)] = rec
        print(
            f"sweeps {sweeps}: {rec['write_s_per_sample'] * 1e3:.0f} ms a sample written "
            f"(its own work {rec['sample_job_s'] * 1e3:.0f} ms, LiDAR {rec['lidar_s'] * 1e3:.1f} ms); "
            f"bytes a sample: JPEGs {rec['jpeg_bytes']:.0f}, cloud {rec['key_cloud_bytes']:.0f}, "
            f"sweeps {rec['sweep_bytes']:.0f}"
        )
    report["load_average_at_end"] = os.getloadavg()[0]
    write_report(a.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
