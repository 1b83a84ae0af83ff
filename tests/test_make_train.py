"""bev.make_train: what `make train` runs around bev-train (its deadline, its last lines, its learning curve).
The deadline and report logic against TimeBudget is tested in test_time_budget.py."""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bev import make_train

ROOT = Path(__file__).resolve().parents[1]


def write_log(run: Path, version: int, rows: list[dict]) -> None:
    d = run / "csv" / f"version_{version}"
    d.mkdir(parents=True)
    with open(d / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["epoch", "step", "train/loss_step", "val/iou"])
        w.writeheader()
        w.writerows(rows)


def test_plot_draws_a_resumed_runs_curve(tmp_path):
    write_log(
        tmp_path, 2, [{"step": s, "train/loss_step": 1.0 - s / 10} for s in range(4)] + [{"step": 3, "val/iou": 0.2}]
    )
    write_log(tmp_path, 10, [{"step": s, "train/loss_step": 0.5} for s in range(3, 6)] + [{"step": 5, "val/iou": 0.3}])
    out = tmp_path / "curve.png"
    run = subprocess.run(  # as `make train` runs it
        [sys.executable, "-m", "bev.make_train", "plot", str(tmp_path), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    assert out.stat().st_size > 1000 and "wrote" in run.stdout


def test_plot_of_a_folder_without_a_log_is_one_error_line(tmp_path, capsys):
    assert make_train.main(["plot", str(tmp_path), "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no csv/version_*/metrics.csv" in err and not (tmp_path / "c.png").exists()


def test_make_train_runs_the_package_helpers_not_scripts():
    if shutil.which("make") is None:
        pytest.skip("no make here")
    recipe = subprocess.run(
        ["make", "--no-print-directory", "-n", "train"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    for command in ("deadline", "plot", "report"):
        assert re.search(rf"python -m bev\.make_train {command} ", recipe), command
    assert "scripts/" not in recipe


def test_the_whole_schedule_the_warning_quotes_is_the_readmes_result_file():
    """make train's undertrained warning (shown where training runs in fp32) quotes what the whole schedule scores
    in fp32: the run of the result file the README's whole-schedule row cites, to two decimals."""
    import json

    name = "make_train_recipes_cpu.json"
    assert f"(benchmarks/results/{name})" in (ROOT / "README.md").read_text()
    runs = json.loads((ROOT / "benchmarks" / "results" / name).read_text())["runs"]
    whole = next(r for r in runs if r["steps"] == 3840 and r["overrides"])  # fp32, the fp32-CPU decoder
    metrics = {"iou_vehicle": whole["vehicle_iou"], "miou_map": whole["map_miou"]}
    assert {k: v for k, (_, v) in make_train.FULL_SCHEDULE.items()} == {k: round(v, 2) for k, v in metrics.items()}
