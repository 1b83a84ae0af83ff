"""The Makefile's data step: `make train` (and train-temporal, train-det, train-fusion) write the synthetic set
without the occupancy labels (bev-make-synthetic --no-occupancy), and `make train-occ` adds them to such a set
(--occupancy-only) instead of writing it again."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def test_make_train_writes_no_labels_and_train_occ_adds_them():
    """`make train` (and train-temporal, train-det, train-fusion) write the set without the labels; train-occ adds them to a
    set that has none instead of writing it again."""
    if shutil.which("make") is None:
        pytest.skip("no make here")
    root = Path(__file__).resolve().parents[1]
    for target in ("train", "train-temporal", "train-det", "train-fusion"):
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
