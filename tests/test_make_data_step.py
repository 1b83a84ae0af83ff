"""The Makefile's data step: `make train` (and train-temporal, train-det, train-lidar, train-fusion) write the
synthetic set without the occupancy labels (bev-make-synthetic --no-occupancy), and `make train-occ` adds them to
such a set (--occupancy-only) instead of writing it again; make train-fusion's start from two runs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def test_make_train_writes_no_labels_and_train_occ_adds_them():
    """`make train` (and train-temporal, train-det, train-lidar, train-fusion) write the set without the labels; train-occ adds them to a
    set that has none instead of writing it again."""
    if shutil.which("make") is None:
        pytest.skip("no make here")
    root = Path(__file__).resolve().parents[1]
    for target in ("train", "train-temporal", "train-det", "train-lidar", "train-fusion"):
        # --no-print-directory: under `make test` this make is a sub-make, which would print directory lines
        recipe = subprocess.run(
            ["make", "--no-print-directory", "-n", target], cwd=root, capture_output=True, text=True, check=True
        ).stdout
        lines = [ln for ln in recipe.splitlines() if "bev-make-synthetic" in ln]
        assert len(lines) == 1 and "--no-occupancy" in lines[0] and "--overwrite" not in lines[0], target
        assert "--render-scale 4 --image-size render" in lines[0], target  # the JPEGs at the 400x225 render
    recipe = subprocess.run(
        ["make", "--no-print-directory", "-n", "train-occ"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    lines = [ln for ln in recipe.splitlines() if "bev-make-synthetic" in ln]
    assert len(lines) == 2 and "--occupancy-only" in lines[1]
    assert not any("--overwrite" in ln or "--no-occupancy" in ln for ln in lines)
    # A new set as make train writes it; labels added in the image size the set records (an older full-size one too).
    assert "--image-size render" in lines[0] and "--image-size" not in lines[1]


def test_train_fusion_starts_from_the_camera_and_the_lidar_runs(tmp_path):
    """make train-fusion's model.init_from lists make train's run and make train-lidar's, those that exist, as one
    Hydra list override that composes."""
    if shutil.which("make") is None:
        pytest.skip("no make here")
    from hydra import compose, initialize_config_dir

    import bev.data  # noqa: F401 (the data config schemas)
    from bev.train import CONFIG_DIR

    root = Path(__file__).resolve().parents[1]
    runs = {"RUN": tmp_path / "cam", "LIDAR_RUN": tmp_path / "lidar"}
    for run in runs.values():
        (run / "checkpoints").mkdir(parents=True)
        (run / "checkpoints" / "epoch_000.ckpt").touch()
    recipe = subprocess.run(
        ["make", "--no-print-directory", "-n", "train-fusion", *(f"{k}={v}" for k, v in runs.items())],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    override = next(w.strip("'") for w in recipe.split() if "model.init_from=" in w)
    assert override == f"model.init_from=[{runs['RUN']}/checkpoints,{runs['LIDAR_RUN']}/checkpoints]"
    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["experiment=synthetic_fusion_cpu", override])
    assert list(cfg.model.init_from) == [f"{runs['RUN']}/checkpoints", f"{runs['LIDAR_RUN']}/checkpoints"]
