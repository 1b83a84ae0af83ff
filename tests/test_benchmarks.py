"""The benchmark scripts run as a user runs them (a subprocess each: the scripts are tools, not modules the
tests import). Smoke tests only: one step or round each, no timing checked."""

from __future__ import annotations

import json
import os
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
    printed = run_script("bench_train.py", *args, "--profile", "1", "--out", str(out)).stdout
    report = json.loads(out.read_text())
    for key in ("embedded", "embedded_det"):
        config = report["configs"][key]
        rec = config["variants"]["fp32"]
        assert rec["step_s"] > 0 and rec["profile"]["steps"] == 1 and rec["profile"]["gpu_kernel_ms"] is None
        rate = config["gflop_per_step"] / rec["step_s"]
        assert rec["gflop_per_s"] == pytest.approx(rate, rel=0.01, abs=0.05)  # reported to 0.1 GFLOP/s
    # the detection head's layers add to the step's arithmetic
    assert report["configs"]["embedded_det"]["gflop_per_step"] > report["configs"]["embedded"]["gflop_per_step"]
    assert "profiled:" in printed and "by family (ms): convolution" in printed
    families = rec["profile"]["families_ms"]
    assert next(iter(families)) == "convolution" and sum(families.values()) <= rec["profile"]["wall_ms"] * 1.05
    assert report["matmul_gflop_per_s"]["fp32"] > 0
    assert rec["of_matmul_rate"] == pytest.approx(rec["gflop_per_s"] / report["matmul_gflop_per_s"]["fp32"], abs=2e-3)


def test_op_families_of_profiled_names():
    from bev.utils.profiling import op_family

    names = ["aten::mkldnn_convolution", "aten::convolution_backward", "aten::native_batch_norm", "bev::_bev_pool"]
    assert [op_family(n) for n in names] == ["convolution", "convolution", "batch_norm", "voxel pooling"]
    assert [op_family(n) for n in ("aten::copy_", "aten::empty", "aten::relu_", "aten::_foreach_add_")] == [
        "copies and layout",
        "allocation",
        "elementwise",
        "optimizer",
    ]
    assert op_family("ProfilerStep#1") == "other"


@pytest.mark.slow  # one round of the user-level section in its own process (it tunes malloc process-wide)
def test_bench_pool_user_level_reports_the_memory_traffic_floor(tmp_path):
    out = tmp_path / "pool.json"
    args = ["--device", "cpu", "--section", "user", "--rounds", "1", "--threads", "2"]
    run_script("bench_pool.py", *args, "--skip", "quickcumsum voxel_sum", "torch voxel_sum", "--out", str(out))
    lss = json.loads(out.read_text())["user_level"]["malloc_tuned"]["lss"]
    floor = next(r for r in lss["rows"] if r["method"] == "memory traffic only (floor)")
    assert floor["fwd_bwd_ms"] > 0 and lss["ratios"]["index_add_ / memory traffic only (floor)"] > 0
    assert {"index_add_ / native voxel_sum", "index_add_ / native bev_pool"} <= set(lss["ratios"])


# What a user runs (the benchmarks behind the docs' figures, the cross-checks against the peers' code, the GPU
# check) stays small; one-off experiments live in git history.
SCRIPTS_MAX_LINES = 3000


def test_scripts_stay_within_their_line_budget():
    lines = {p.name: len(p.read_text().splitlines()) for p in sorted(SCRIPTS.iterdir()) if p.is_file()}
    assert sum(lines.values()) <= SCRIPTS_MAX_LINES, f"scripts/ has {sum(lines.values())} lines: {lines}"
