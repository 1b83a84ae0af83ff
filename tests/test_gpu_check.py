"""scripts/gpu_check.sh without a GPU: its dry run, and its report from a work dir's outputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e  # every test runs a script in a new process


def test_gpu_check_dry_run_composes_its_training_stage(tmp_path):
    # The dry run composes the GPU training stage's overrides, so a stale one fails here (a removed
    # trainer.max_time once reached the GPU machine before it failed).
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DIR": str(tmp_path)}
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0 and "dry run done" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert "bev.train experiment=synthetic_cpu trainer=gpu" in r.stdout
    assert "test_ops_cuda_emulated.py" in r.stdout and "bench_pool.py" in r.stdout


def test_gpu_check_step_only_runs_the_training_step_checks(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DIR": str(tmp_path)}
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--step-only", "--skip-train"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    commands = [line for line in r.stdout.splitlines() if line.startswith("+ ")]
    assert r.returncode == 0 and any("tests/test_train_cuda.py" in c for c in commands), (
        r.stdout[-2000:] + r.stderr[-2000:]
    )
    assert any("bench_train.py" in c and "channels_last+bf16" in c for c in commands)
    assert not any(
        x in c for c in commands for x in ("test_ops_cuda", "memcheck", "bench_pool.py", "--batch-size 16", "bev.train")
    )


def _work_dir(tmp_path: Path, losses: list[float]) -> Path:
    """A gpu_check work dir as the stages leave it: junit files, both benchmarks' JSON, a training log."""
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    (work / "logs" / "memcheck.log").write_text("")
    for name, failures in (("tests", 0), ("tests_emulated", 1)):
        (work / "logs" / f"{name}.log").write_text("")
        (work / "logs" / f"{name}.xml").write_text(
            f'<testsuites><testsuite tests="5" failures="{failures}" errors="0" skipped="1"/></testsuites>'
        )
    row = dict(
        method="native bev_pool",
        forward_ms=0.2,
        fwd_bwd_ms=0.3,
        forward_gb_per_s=100.0,
        forward_fraction_of_peak=0.02,
        fwd_bwd_peak_mb=80.0,
    )
    (work / "bench_pool_cuda.json").write_text(
        json.dumps(
            {
                "results": [{"size": "lss", "dtype": "float32", "rows": [row, dict(row, method="index_add_")]}],
                "targets": [{"target": "fused faster", "ratio": 1.3, "met": True}],
            }
        )
    )
    (work / "bench_train_cuda.json").write_text(
        json.dumps(
            {
                "configs": {
                    "paper": {
                        "batch_size": 4,
                        "variants": {
                            "fp32": {
                                "step_s": 0.05,
                                "speedup_vs_fp32": 1.0,
                                "gflop_per_s": 31000.0,
                                "profile": {"gpu_kernel_ms": 28.2, "kernels_per_step": 1496},
                            },
                            "bf16": {"error": "RuntimeError: x"},
                        },
                    }
                }
            }
        )
    )
    (work / "bench_train_cuda_b16.json").write_text(
        json.dumps(
            {
                "configs": {
                    "paper": {
                        "batch_size": 16,
                        "variants": {
                            "fp32": {"step_s": 0.1, "speedup_vs_fp32": 1.0},
                            "channels_last+bf16": {"step_s": 0.05, "speedup_vs_fp32": 2.0},
                        },
                    }
                }
            }
        )
    )
    run = work / "train" / "csv" / "version_0"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text("step,train/loss_step\n" + "".join(f"{i},{l}\n" for i, l in enumerate(losses)))
    (work / "train" / "metrics.json").write_text(
        json.dumps(
            {
                "metrics": {"val/iou_best": 0.2},
                "fit_wall_s": 20.0,
                "global_step": len(losses),
                "time_budget": {"s_per_step": 0.03},
            }
        )
    )
    return work


def _report(tmp_path, work, *args):
    """scripts/gpu_check_report.py run on `work` as gpu_check.sh runs it: (exit code, JSON report, Markdown)."""
    results = tmp_path / "results"
    results.mkdir(exist_ok=True)
    cmd = [sys.executable, str(REPO / "scripts" / "gpu_check_report.py"), "--device", "some_gpu", "--work", str(work)]
    done = subprocess.run([*cmd, "--results", str(results), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr[-3000:]  # 1: the check is not complete or failed
    report = json.loads((results / "gpu_some_gpu.json").read_text())
    return done.returncode, report, (results / "gpu_some_gpu.md").read_text()


def test_report_of_a_finished_check(tmp_path):
    work = _work_dir(tmp_path, [1.0, 0.9, 0.8, 0.7, 0.6])
    rc, report, md = _report(tmp_path, work, "--times", '{"build": 36}')
    assert rc == 0 and report["ok"] and report["pending_stages"] == []
    assert report["tests"]["tests"] == 5 and report["tests_emulated"]["failures"] == 1
    assert report["memcheck"] == "no errors, tests passed"
    assert report["bench"]["headline"][0]["method"] == "native bev_pool"  # index_add_ is not a headline row
    assert report["bench_train"]["configs"]["paper"]["bf16"]["error"] == "RuntimeError: x"
    assert report["train"]["steps"] == 5 and report["train"]["loss_went_down"]
    assert "30.0 ms/step (validations and the first epoch left out)" in md
    assert (tmp_path / "results" / "bench_pool_cuda_some_gpu.json").exists()
    assert report["bench_train_b16"]["configs"]["paper"]["channels_last+bf16"]["speedup_vs_fp32"] == 2.0
    assert report["bench_train"]["configs"]["paper"]["fp32"]["kernels_per_step"] == 1496
    assert "| paper (batch 4) | fp32 | 50.0 | 1.0x | 31.0 | 28.2 | 1496 |" in md
    assert "| paper (batch 16) | channels_last+bf16 | 50.0 | 2.0x | - | - |" in md
    assert "overall: OK" in md


def test_report_of_a_check_cut_short_or_failing(tmp_path):
    work = _work_dir(tmp_path, [0.5, 0.6, 0.7, 0.8, 0.9])
    (work / "logs" / "tests_emulated.xml").unlink()  # the pytest process crashed
    rc, report, md = _report(tmp_path, work, "--pending", "train")
    assert rc == 1 and not report["ok"] and report["pending_stages"] == ["train"]
    assert report["tests_emulated"].startswith("no report")
    assert "NOT DONE (still to run: train)" in md
    rc, report, md = _report(tmp_path, work, "--failed", "bench memcheck")
    assert rc == 1 and "FAILED (failed stages: bench memcheck" in md and report["memcheck"].startswith("failed")
    rec = json.loads((work / "train" / "metrics.json").read_text())
    (work / "train" / "metrics.json").write_text(json.dumps({**rec, "time_budget": None}))  # no budget: wall time
    rc, report, md = _report(tmp_path, work)
    assert rc == 1 and not report["train"]["loss_went_down"] and "DID NOT go down" in md
    assert "4000.0 ms/step with validations" in md
