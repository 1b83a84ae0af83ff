"""What each speed setting gives where a user meets it: short `bev-train` runs of the embedded
default (experiment=synthetic_cpu, as `make train` runs it) with one setting changed, alternated
with the defaults, `--rounds` times. Each run trains two whole epochs of a small synthetic set
(`--samples-per-scene`, written to a temporary directory: the same model, images and grid as
`make train`, fewer frames), so the input memo fills in the first epoch and serves the second, as
in `make train`; the time budget's own measurement gives the seconds per step of the second epoch
(validation excluded). Prints a table and writes benchmarks/results/bench_knobs_busy<N>_cpu.json.

    python scripts/bench_knobs.py                  # the idle machine
    python scripts/bench_knobs.py --busy 1 --variants default threads_2   # beside a CPU-bound process

Variants: default (threads auto, the allocator tuning, the input memo); threads_2 / threads_1
(a fixed thread count: no load following); no_malloc_tuning (BEV_MALLOC_TUNING=0: glibc's
defaults); no_memo (data.input_memo_mb=0: the images decoded every step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_common import checkout_commit, host_versions, processor_name, write_report  # noqa: E402

from bev.utils.precision import cpu_bf16_support  # noqa: E402

TRAIN_SCENES, BATCH_SIZE = 8, 4  # the mini_train split's scenes; synthetic_cpu's batch
VARIANTS = {  # name -> (extra overrides, extra environment)
    "default": ([], {}),
    "threads_2": (["threads=2"], {}),
    "threads_1": (["threads=1"], {}),
    "no_malloc_tuning": ([], {"BEV_MALLOC_TUNING": "0"}),
    "no_memo": (["data.input_memo_mb=0"], {}),
}


def overrides(data: Path, run_dir: Path, batches: int) -> list[str]:  # batches: per epoch
    """A short run of `make train`'s config whose time budget never binds but measures the pace."""
    return [
        "experiment=synthetic_cpu",
        f"data.dataroot={data}",
        f"hydra.run.dir={run_dir}",
        "trainer.max_epochs=2",
        "+trainer.limit_val_batches=2",
        "trainer.check_val_every_n_epoch=1",
        "callbacks.time_budget.budget=10:00:00",
        f"+callbacks.time_budget.measure_steps={batches - 10}",
        "callbacks.bev_png.every_n_steps=1000000",
    ]


def run_once(name: str, data: Path, batches: int, work: Path) -> float:
    """Seconds per training step of one bev-train run of variant `name`."""
    extra, env = VARIANTS[name]
    run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
    cmd = [str(Path(sys.executable).parent / "bev-train"), *overrides(data, run_dir, batches), *extra]
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"bev-train ({name}) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    record = json.loads((run_dir / "metrics.json").read_text())
    return float(record["time_budget"]["s_per_step"])


def write_synthetic(out: Path, samples_per_scene: int) -> Path:
    """A synthetic set like make train's, with fewer key frames per scene."""
    cmd = [str(Path(sys.executable).parent / "bev-make-synthetic"), "--out", str(out), "--render-scale", "4"]
    subprocess.run([*cmd, "--samples-per-scene", str(samples_per_scene)], check=True, capture_output=True)
    return out


def busy_loops(n: int) -> list[subprocess.Popen]:
    """n CPU-bound processes (another user's job on a shared machine)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def summarise(times: dict[str, list[float]]) -> dict:
    base = statistics.median(times["default"])
    return {
        name: {
            "s_per_step": [round(t, 4) for t in ts],
            "median_s": round(statistics.median(ts), 4),
            "default_vs_this": round(statistics.median(ts) / base, 3),
        }
        for name, ts in times.items()
    }


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--samples-per-scene", type=int, default=40, help="of the synthetic set written for the runs (>= 20)"
    )
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--busy", type=int, default=0, help="CPU-bound processes running beside")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.samples_per_scene < 20:
        p.error("--samples-per-scene must be >= 20 (the pace is measured over the second epoch's batches after 5)")
    if "default" not in a.variants:
        a.variants.insert(0, "default")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    times: dict[str, list[float]] = {name: [] for name in a.variants}
    loops = busy_loops(a.busy)
    t0 = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="bench_knobs-") as work:
            data = write_synthetic(Path(work) / "data", a.samples_per_scene)
            batches = TRAIN_SCENES * a.samples_per_scene // BATCH_SIZE
            for r in range(a.rounds):
                for name in a.variants:
                    times[name].append(run_once(name, data, batches, Path(work)))
                    print(f"round {r + 1}/{a.rounds} {name:18s} {times[name][-1]:.3f} s/step", flush=True)
    finally:
        for p in loops:
            p.kill()
    variants = summarise(times)
    for name, v in variants.items():
        print(f"{name:18s} median {v['median_s']:.3f} s/step   x{v['default_vs_this']:.2f} the default's time")
    report = {
        "script": "scripts/bench_knobs.py",
        "commit": checkout_commit(),
        "device_name": processor_name(),
        "what": "s/step of make train's config (second epoch), one setting changed per variant, alternated",
        "busy_processes": a.busy,
        "samples_per_scene": a.samples_per_scene,
        "rounds": a.rounds,
        "wall_s": round(time.time() - t0, 1),
        "host": {**host_versions(), "cpus": len(os.sched_getaffinity(0)), "cpu_bf16": cpu_bf16_support()},
        "variants": variants,
    }
    out = a.out or ROOT / "benchmarks" / "results" / f"bench_knobs_busy{a.busy}_cpu.json"
    write_report(out, report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
