"""Where the time of `make train`'s data step (bev-make-synthetic) goes, and the step end to end.

Two parts, both for this checkout and, with --before REV, for the writer of git revision REV (its bev/
extracted to a temporary folder and run with PYTHONPATH), in the same run:

- stages: one in-process `make_synthetic(workers=1)` over --stage-scenes scenes x --stage-samples samples,
  with the writer's own functions wrapped in timers that count exclusive CPU time of this process
  (time.process_time: other processes' load does not count; nested timed calls are taken out of their
  callers). Per-sample stages are reported as the median and mean per sample; world building, tables, maps
  and JSON per run (and per scene for the worlds).
- end to end: `python -m bev.synthetic.writer` as a subprocess per variant (tree x --workers x --occupancy),
  alternated over --repeats rounds so that load changes hit every variant alike: wall, CPU (the writer and its
  worker processes), samples/s, the load average, and an md5 of every file written (the variants' outputs
  compared). `--occupancy with without` writes the set with and without the Occ3D labels (--no-occupancy, as
  `make train` does), then adds them to the latter (--occupancy-only, as `make train-occ` does): its md5 must be
  the full write's.

    python scripts/bench_synthetic.py --before HEAD~1                      # make train's set, 10 x 192 samples
    python scripts/bench_synthetic.py --e2e-samples 24 --stage-samples 24   # quicker
    python scripts/bench_synthetic.py --skip-stages --workers 2 --occupancy with without   # the labels' cost
    python scripts/bench_synthetic.py --workers 2 --occupancy without --image-size full render   # the JPEGs' size

--image-size variants write the JPEGs at 1600x900 (full, the renders upscaled) or at the render resolution
(render, what `make train` writes); the md5s are compared within one image size.

--make-train-step with --before REV times `make train`'s data step as each tree's Makefile writes it (the
bev-make-synthetic arguments of `make -n train`), instead of the variants above:

    python scripts/bench_synthetic.py --before 543fc06 --make-train-step --skip-stages --repeats 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
REPO = Path(__file__).resolve().parents[1]

# Stage of each timed function: (module attribute path, stage name). render_camera and render_depth count as
# the occupancy's lidar views when called from occupancy_sample, else as the cameras.
TIMED = [
    ("writer.build_world", "world"),
    ("writer._add_scene", "tables: scenes, samples, sample_data, ego_pose"),
    ("writer._add_annotations", "tables: sample_annotation, instance"),
    ("writer.map_expansion", "maps: expansion"),
    ("writer._map_task", "maps: drivable-area PNG"),
    ("writer._render_task", "sample: other (float -> uint8, results)"),
    ("raycast._object_parts_ego", "cameras: object parts"),
    ("raycast.render_sample", "cameras: ray casting"),
    ("raycast.render_camera", "cameras: ray casting"),
    ("raycast.render_depth", "occupancy: lidar views"),
    ("occupancy.occupancy_sample", "occupancy: other"),
    ("occupancy.observed", "occupancy: camera and lidar masks"),
    ("occupancy.semantics", "occupancy: semantics"),
    ("occupancy.write_labels", "occupancy: labels.npz"),
    ("writer.lidar_points", "lidar"),
]
PER_RUN = ("world", "tables", "maps", "json")  # stage name prefixes counted per run, not per sample


def _stages(scenes: int, samples: int, scale: int, out: Path, image_size: str = "full") -> dict:
    """Exclusive CPU time per stage of one in-process make_synthetic(workers=1) (module docstring)."""

    from bev.synthetic import occupancy, raycast, writer

    modules = {"writer": writer, "raycast": raycast, "occupancy": occupancy}
    stack: list[list] = []  # [stage, start, time of timed calls inside]
    per_sample: list[dict] = []
    per_run: dict[str, float] = {}
    worlds: list[float] = []

    def add(stage: str, dt: float) -> None:
        if stage.startswith(PER_RUN):
            per_run[stage] = per_run.get(stage, 0.0) + dt
        elif per_sample:
            per_sample[-1][stage] = per_sample[-1].get(stage, 0.0) + dt

    def timed(fn, stage):
        def run(*a, **k):
            name = stage
            if stage.startswith("cameras") and any(s[0].startswith("occupancy") for s in stack):
                name = "occupancy: lidar views" if stage.endswith("ray casting") else "occupancy: object parts"
            if fn.__name__ == "_render_task":
                per_sample.append({})
            stack.append([name, time.process_time(), 0.0])
            try:
                return fn(*a, **k)
            finally:
                name, start, inner = stack.pop()
                dt = time.process_time() - start
                add(name, dt - inner)
                if stack:
                    stack[-1][2] += dt
                if name == "world":
                    worlds.append(dt)

        return run

    saved = []
    for path, stage in TIMED:
        mod, attr = path.split(".")
        if hasattr(modules[mod], attr):  # an older writer may lack some (render_depth)
            saved.append((modules[mod], attr, getattr(modules[mod], attr)))
            setattr(modules[mod], attr, timed(getattr(modules[mod], attr), stage))
    real_cv2, real_json, real_write = writer.cv2, writer.json, Path.write_bytes

    class _Cv2:  # the writer's cv2 and json with their heavy calls timed
        def __getattr__(self, name):
            return getattr(real_cv2, name)

    class _Json:
        def __getattr__(self, name):
            return getattr(real_json, name)

    fake_cv2, fake_json = _Cv2(), _Json()
    fake_cv2.resize = timed(real_cv2.resize, "jpeg: upscale to 1600x900")
    fake_cv2.imencode = timed(real_cv2.imencode, "jpeg: encode")
    fake_cv2.cvtColor = timed(real_cv2.cvtColor, "jpeg: RGB -> BGR")
    fake_json.dumps = timed(real_json.dumps, "json: tables and map expansions")
    writer.cv2, writer.json = fake_cv2, fake_json
    Path.write_bytes = timed(real_write, "files: images and lidar")
    start = time.process_time()
    try:
        size = {} if image_size == "full" else {"image_size": image_size}  # (an older writer has full alone)
        writer.make_synthetic(
            out, scenes=scenes, samples_per_scene=samples, workers=1, render_scale=scale, progress=False, **size
        )
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)
        writer.cv2, writer.json, Path.write_bytes = real_cv2, real_json, real_write
    total = time.process_time() - start
    names = sorted({k for s in per_sample for k in s})
    rows = {
        k: {
            "median_ms": 1e3 * statistics.median(s.get(k, 0.0) for s in per_sample),
            "mean_ms": 1e3 * statistics.fmean(s.get(k, 0.0) for s in per_sample),
        }
        for k in names
    }
    sums = [sum(s.values()) for s in per_sample]
    rows["sample: all"] = {"median_ms": 1e3 * statistics.median(sums), "mean_ms": 1e3 * statistics.fmean(sums)}
    return {
        "scenes": scenes,
        "samples_per_scene": samples,
        "render_scale": scale,
        "image_size": image_size,
        "cpu_s": total,
        "per_sample": rows,
        "per_run_s": per_run,
        "world_s_each": worlds,
    }


def _tree_md5(root: Path) -> tuple[str, int]:
    """One md5 over every file's path and bytes (sorted), and the number of files."""
    h, n = hashlib.md5(), 0
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + b"\0")
            with open(p, "rb") as f:
                h.update(hashlib.md5(f.read()).digest())
            n += 1
    return h.hexdigest(), n


def _end_to_end(
    src: Path, workers: int, scenes: int, samples: int, scale: int, out: Path, flags: tuple = (), keep: bool = False
) -> dict:
    """One `python -m bev.synthetic.writer [flags]` run from the package in `src`: wall, CPU, samples/s, output
    md5 (the output removed after unless `keep`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "bev.synthetic.writer", "--out", str(out), "--scenes", str(scenes)]
    cmd += ["--samples-per-scene", str(samples), "--render-scale", str(scale), "--workers", str(workers), *flags]
    before, load = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    md5, files = _tree_md5(out)
    if not keep:
        shutil.rmtree(out)
    n = scenes * samples
    return {
        "workers": workers,
        "wall_s": wall,
        "cpu_s": cpu,
        "samples_per_s": n / wall,
        "cpu_ms_per_sample": 1e3 * cpu / n,
        "load_before": load,
        "load_after": os.getloadavg()[0],
        "files": files,
        "md5": md5,
    }


def _make_train_flags(makefile: Path) -> list[str]:
    """The bev-make-synthetic arguments, less --out, of `make train`'s data step in this Makefile."""
    cmd = ["make", "--no-print-directory", "-n", "-f", str(makefile), "train", "DATA=/nonexistent/set"]
    recipe = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in recipe.splitlines() if "bev-make-synthetic" in ln)
    words = line.split("bev-make-synthetic", 1)[1].split(";")[0].split()
    out = words.index("--out")
    return words[:out] + words[out + 2 :]


def _make_train_step(src: Path, makefile: Path, workers: int, out: Path) -> dict:
    """One run of `make train`'s data step of the tree in `src` (its Makefile's arguments), as _end_to_end."""
    flags = _make_train_flags(makefile)
    words = dict(zip(flags, flags[1:]))
    scenes, samples = int(words.get("--scenes", 10)), int(words["--samples-per-scene"])
    res = _end_to_end(src, workers, scenes, samples, int(words["--render-scale"]), out, tuple(flags))
    return {"make_train_flags": " ".join(flags), **res}


def _extract(rev: str, into: Path) -> Path:
    """bev/ of git revision `rev` under `into` (a package folder to put first on PYTHONPATH)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, "bev"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", metavar="REV", help="also measure the writer of this git revision (e.g. HEAD~1)")
    p.add_argument("--scenes", type=int, default=10)
    p.add_argument("--e2e-samples", type=int, default=192, help="samples per scene end to end (make train: 192)")
    p.add_argument("--render-scale", type=int, default=4)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="end-to-end variants")
    p.add_argument("--repeats", type=int, default=1, help="end-to-end rounds (variants alternated in each)")
    p.add_argument(
        "--occupancy",
        nargs="+",
        choices=OCCUPANCY,
        default=["with"],
        help="end-to-end variants: with the occupancy labels, and/or without them (--no-occupancy) and then "
        "the labels added (--occupancy-only)",
    )
    p.add_argument(
        "--image-size", nargs="+", choices=("full", "render"), default=["full"], help="variants (module docstring)"
    )
    p.add_argument("--stage-scenes", type=int, default=2, help="scenes of the in-process stage profile")
    p.add_argument("--stage-samples", type=int, default=48, help="samples per scene of the stage profile")
    p.add_argument("--skip-stages", action="store_true")
    p.add_argument(
        "--make-train-step", action="store_true", help="time make train's data step of each tree (module docstring)"
    )
    p.add_argument("--skip-end-to-end", action="store_true")
    p.add_argument("--stages-only-json", action="store_true", help=argparse.SUPPRESS)  # the --before tree's stages
    p.add_argument("--out", default=str(REPO / "benchmarks/results/synthetic_data_step_cpu.json"))
    args = p.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="bench_synthetic_"))
    try:
        if args.stages_only_json:
            size = args.image_size[0]
            print(json.dumps(_stages(args.stage_scenes, args.stage_samples, args.render_scale, scratch / "s", size)))
            return 0
        trees = {"after": REPO}
        makefiles = {"after": REPO / "Makefile"}
        if args.before:
            trees = {"before": _extract(args.before, scratch / "before"), **trees}
            makefiles["before"] = scratch / "Makefile.before"
            makefiles["before"].write_bytes(
                subprocess.run(
                    ["git", "show", f"{args.before}:Makefile"], cwd=REPO, capture_output=True, check=True
                ).stdout
            )
        report = _report_header(args)
        if not args.skip_stages:
            for name, src in trees.items():
                for size in args.image_size:
                    key = name if size == "full" else f"{name} image_size={size}"
                    report["stages"][key] = _stages_in(src, args, scratch, size)
                    _print_stages(key, report["stages"][key])
        if args.make_train_step:
            for r in range(args.repeats):
                for name, src in trees.items():
                    res = _make_train_step(src, makefiles[name], args.workers[-1], scratch / "e2e")
                    report["end_to_end"].append({"tree": name, "round": r, "variant": "make train", **res})
                    print(
                        f"{name:6s} make train's data step ({res['make_train_flags']}): wall {res['wall_s']:6.1f} s, "
                        f"CPU {res['cpu_s']:6.1f} s ({res['cpu_ms_per_sample']:.1f} ms/sample), load "
                        f"{res['load_before']:.1f}-{res['load_after']:.1f}",
                        flush=True,
                    )
            report["summary"] = _summary(report["end_to_end"])
            print(json.dumps(report["summary"], indent=1))
        elif not args.skip_end_to_end:
            for r in range(args.repeats):
                for w in args.workers:
                    for occ, size in ((o, z) for o in args.occupancy for z in args.image_size):
                        for name, src in trees.items():
                            for res in _variant(src, w, occ, args, scratch / "e2e", size):
                                report["end_to_end"].append({"tree": name, "round": r, **res})
                                print(
                                    f"{name:6s} workers={w} occupancy={res['occupancy']} image_size={size}: "
                                    f"wall {res['wall_s']:6.1f} s, "
                                    f"CPU {res['cpu_s']:6.1f} s ({res['cpu_ms_per_sample']:.1f} ms/sample), "
                                    f"{res['samples_per_s']:.2f} samples/s, load {res['load_before']:.1f}-"
                                    f"{res['load_after']:.1f}, {res['files']} files md5 {res['md5'][:8]}",
                                    flush=True,
                                )
            report["summary"] = _summary(report["end_to_end"])
            print(json.dumps(report["summary"], indent=1))
        from bench_common import write_report

        write_report(args.out, report)
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


OCCUPANCY = ("with", "without")


def _variant(src: Path, workers: int, occupancy: str, args, out: Path, image_size: str = "full") -> list[dict]:
    """The end-to-end runs of one variant: the set with its labels, or without them and then the labels added."""
    run = (src, workers, args.scenes, args.e2e_samples, args.render_scale, out)
    size = () if image_size == "full" else ("--image-size", image_size)
    if occupancy == "with":
        return [{"occupancy": "with", "image_size": image_size, **_end_to_end(*run, flags=size)}]
    bare = {
        "occupancy": "without",
        "image_size": image_size,
        **_end_to_end(*run, flags=("--no-occupancy", *size), keep=True),
    }
    try:
        added = {"occupancy": "added", "image_size": image_size, **_end_to_end(*run, flags=("--occupancy-only", *size))}
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return [bare, added]


def _report_header(args) -> dict:
    from bench_common import checkout_commit, host_versions, processor_name

    return {
        "benchmark": "bev-make-synthetic, make train's data step",
        "command": "python scripts/bench_synthetic.py " + " ".join(sys.argv[1:]),
        "commit": checkout_commit(),
        "before": args.before,
        "host": {**host_versions(), "cpu": processor_name(), "cpus": len(os.sched_getaffinity(0))},
        "load_at_start": os.getloadavg(),
        "end_to_end_set": {
            "scenes": args.scenes,
            "samples_per_scene": args.e2e_samples,
            "render_scale": args.render_scale,
        },
        "stages": {},
        "end_to_end": [],
    }


def _stages_in(src: Path, args, scratch: Path, image_size: str = "full") -> dict:
    """The stage profile of the writer in `src`, in a fresh process (its own imports and caches)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(src), str(REPO / "scripts"), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, os.path.abspath(__file__), "--stages-only-json", "--render-scale", str(args.render_scale)]
    cmd += ["--stage-scenes", str(args.stage_scenes), "--stage-samples", str(args.stage_samples)]
    cmd += ["--image-size", image_size]
    done = subprocess.run(cmd, env=env, cwd=scratch, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the stage profile of {src} failed:\n{done.stderr[-3000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "load_after": os.getloadavg()[0]}


def _print_stages(name: str, s: dict) -> None:
    print(
        f"\n{name}: {s['scenes']} scenes x {s['samples_per_scene']} samples, render scale {s['render_scale']}, "
        f"CPU {s['cpu_s']:.1f} s; per sample (ms of CPU, median / mean):"
    )
    for k, v in sorted(s["per_sample"].items(), key=lambda kv: -kv[1]["mean_ms"]):
        print(f"  {k:42s} {v['median_ms']:7.2f} / {v['mean_ms']:7.2f}")
    print("  per run (s of CPU):")
    for k, v in sorted(s["per_run_s"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:42s} {v:7.2f}")


def _summary(rows: list[dict]) -> dict:
    """Medians per (tree, workers, occupancy) and the md5s seen (equal md5s: byte-identical datasets)."""
    out = {}
    steps = [r for r in rows if r.get("variant") == "make train"]
    if steps:
        for tree in sorted({r["tree"] for r in steps}):
            rs = [r for r in steps if r["tree"] == tree]
            out[f"{tree}: make train's data step"] = {
                "flags": rs[0]["make_train_flags"],
                **{
                    k: statistics.median(r[k] for r in rs)
                    for k in ("wall_s", "cpu_s", "samples_per_s", "cpu_ms_per_sample")
                },
            }
        return out
    variant = lambda r: (r["tree"], r["workers"], r.get("occupancy", "with"), r.get("image_size", "full"))  # noqa: E731
    for key in sorted({variant(r) for r in rows}):
        rs = [r for r in rows if variant(r) == key]
        name = f"{key[0]} workers={key[1]}" + ("" if key[2] == "with" else f" occupancy={key[2]}")
        out[name + ("" if key[3] == "full" else f" image_size={key[3]}")] = {
            k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s", "samples_per_s", "cpu_ms_per_sample")
        }
    # The full sets' md5s, per image size: a set written with its labels, or without them and the labels added after.
    for size in sorted({r.get("image_size", "full") for r in rows}):
        md5s = {
            r["md5"] for r in rows if r.get("occupancy", "with") != "without" and r.get("image_size", "full") == size
        }
        out["outputs_identical" + ("" if size == "full" else f" image_size={size}")] = len(md5s) <= 1
    return out


if __name__ == "__main__":
    sys.exit(main())
