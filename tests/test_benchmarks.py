"""The benchmark scripts run as a user runs them (a subprocess each: the scripts are tools, not modules the
tests import). Smoke tests only: one step or round each, no timing checked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
pytestmark = pytest.mark.e2e  # every test runs a script in a new process


def run_script(name: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python scripts/<name> args...` from the repository root; fails the test with its output on an error."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        cwd=SCRIPTS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{name} {' '.join(args)}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.slow  # a Python start with torch per script: about a minute on 2 cores
def test_every_script_answers_help():
    """Each script's imports (of the package and of bench_common) resolve and its command line parses."""
    for path in sorted(SCRIPTS.glob("*.py")):
        if path.name != "bench_common.py":  # the scripts' shared module, no command line
            assert "usage" in run_script(path.name, "--help").stdout.lower(), path.name


@pytest.mark.slow  # composes the embedded configs and trains one step of each: about a minute
def test_bench_train_times_the_embedded_step_and_its_detection_head(tmp_path):
    out = tmp_path / "train.json"
    args = ["--configs", "embedded", "embedded_det", "--variants", "fp32", "--steps", "1", "--warmup", "1"]
    printed = run_script("bench_train.py", *args, "--no-loader", "--profile", "1", "--out", str(out)).stdout
    report = json.loads(out.read_text())
    for key in ("embedded", "embedded_det"):
        config = report["configs"][key]
        rec = config["variants"]["fp32"]
        assert rec["step_s"] > 0 and rec["profile"]["steps"] == 1 and rec["profile"]["gpu_kernel_ms"] is None
        assert rec["gflop_per_s"] == pytest.approx(config["gflop_per_step"] / rec["step_s"], rel=0.01)
    # the detection head's layers add to the step's arithmetic
    assert report["configs"]["embedded_det"]["gflop_per_step"] > report["configs"]["embedded"]["gflop_per_step"]
    assert "profiled:" in printed


@pytest.mark.slow  # decodes the JPEGs of every setting: about half a minute
def test_bench_loader_times_frames_and_windows(synthetic_root, tmp_path):
    out = tmp_path / "loader.json"
    caches_before = sorted((synthetic_root / ".bev_cache").glob("*"))  # other tests may have cached there
    args = ["--dataroot", str(synthetic_root), "--workers", "0", "--batches", "2", "--batch-size", "2"]
    run_script("bench_loader.py", *args, "--past-frames", "1", "--future-frames", "1", "--out", str(out))
    r = json.loads(out.read_text())
    assert [x["workers"] for x in r["loader"]] == [0] and all(x["samples_per_s"] > 0 for x in r["loader"])
    windows = r["windows"]
    assert windows["jpegs_per_window"] == 12 and [x["workers"] for x in windows["loader"]] == [0]
    assert windows["loader"][0]["windows_per_s"] > 0
    assert sorted((synthetic_root / ".bev_cache").glob("*")) == caches_before  # its index cache is its own


def test_bench_loader_versus_times_two_sets_alone(synthetic_root, tmp_path):
    out = tmp_path / "versus.json"
    args = ["--dataroot", str(synthetic_root), "--versus", str(synthetic_root), "--rounds", "1", "--out", str(out)]
    run_script("bench_loader.py", *args)
    r = json.loads(out.read_text())
    assert r["items"] == 3 and r["dataroot"]["cpu_ms_per_item"] > 0 and r["versus"]["cpu_ms_per_item"] > 0
    assert r["ratio_versus_over_dataroot"] > 0 and "loader" not in r and "windows" not in r


@pytest.mark.slow  # one round of the user-level section in its own process (it tunes malloc process-wide)
def test_bench_pool_user_level_reports_the_memory_traffic_floor(tmp_path):
    out = tmp_path / "pool.json"
    args = ["--device", "cpu", "--section", "user", "--rounds", "1", "--threads", "2"]
    run_script("bench_pool.py", *args, "--skip", "quickcumsum voxel_sum", "torch voxel_sum", "--out", str(out))
    lss = json.loads(out.read_text())["user_level"]["malloc_tuned"]["lss"]
    floor = next(r for r in lss["rows"] if r["method"] == "memory traffic only (floor)")
    assert floor["fwd_bwd_ms"] > 0 and lss["ratios"]["index_add_ / memory traffic only (floor)"] > 0
    assert {"index_add_ / native voxel_sum", "index_add_ / native bev_pool"} <= set(lss["ratios"])


def test_bench_synthetic_reads_make_trains_data_step_from_a_makefile(tmp_path):
    """--make-train-step times what each Makefile's `make train` writes: the arguments of its bev-make-synthetic."""
    if shutil.which("make") is None:
        pytest.skip("no make here")
    sys.path.insert(0, str(SCRIPTS))
    try:
        import bench_synthetic
    finally:
        sys.path.remove(str(SCRIPTS))
    flags = bench_synthetic._make_train_flags(SCRIPTS.parent / "Makefile")
    assert flags == ["--samples-per-scene", "192", "--render-scale", "4", "--image-size", "render", "--no-occupancy"]
    older = tmp_path / "Makefile"  # a Makefile of before --image-size and --no-occupancy
    text = (SCRIPTS.parent / "Makefile").read_text()
    older.write_text(text.replace("$(SYNTHETIC_ARGS) --no-occupancy", "$(SYNTHETIC_SET)", 1))
    assert bench_synthetic._make_train_flags(older) == ["--samples-per-scene", "192", "--render-scale", "4"]
    rows = [
        {
            "tree": t,
            "variant": "make train",
            "make_train_flags": t,
            "wall_s": w,
            "cpu_s": w,
            "samples_per_s": 1.0,
            "cpu_ms_per_sample": w,
        }
        for t, w in (("before", 3.0), ("after", 1.0), ("before", 5.0), ("after", 2.0))
    ]
    summary = bench_synthetic._summary(rows)
    assert summary["before: make train's data step"]["wall_s"] == 4.0
    assert summary["after: make train's data step"]["cpu_ms_per_sample"] == 1.5
