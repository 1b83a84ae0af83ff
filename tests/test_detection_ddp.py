"""Detection scores under DDP: every process's boxes are scored once, so the logged val/mAP and val/NDS (the
checkpoint monitor) are those of the whole split, equal to bev-eval's of the same checkpoint in one process."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import bev.tasks.detection.scoring as scoring
from bev.tasks.detection.scoring import DetectionScore
from helpers.cli import TINY, eval_cli

# Segmentation + the light detection head; no score threshold, so that even a tiny model's boxes match some
# ground truth and a score of half the split differs from the whole split's.
DETECTION = [
    "data.detection=true",
    "model.net.heads.detection={shared_channels: 8, head_channels: 0}",
    "model.tasks=[segmentation,detection]",
    # Velocities from tracks too: consecutive key frames fall to different processes, so they are tracked only
    # once every process's boxes are gathered.
    "model.detection={decoding: {score_threshold: 0.0, top_k: 500, nms: circle}, track_velocity: {past_frames: 1, "
    "gate: 6.0, min_past_score: 0.0, still_speed: 0.0}}",
]


@pytest.mark.e2e
def test_ddp_logs_the_score_of_the_whole_split(synthetic_root, tmp_path, monkeypatch):
    run = tmp_path / "run"
    args = [
        *TINY,
        *DETECTION,
        "trainer=ddp_cpu",
        # Scored on the scene whose second sample has boxes that match: rank 1's only sample, so a score of
        # rank 0's shard alone differs from the whole split's.
        "data.train_split=mini_val",
        "data.val_split=mini_train",
        "data.batch_size=1",  # the same per-sample batches as the one-process evaluation below
        "callbacks.bev_png.every_n_steps=0",
        "malloc_tuning=false",
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={run}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bev.train", *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = json.loads((run / "metrics.json").read_text())["metrics"]

    ev = tmp_path / "eval"
    ckpt = run / "checkpoints" / "last.ckpt"
    assert (
        eval_cli(
            [
                f"ckpt_path={ckpt}",
                f"data.dataroot={synthetic_root}",
                "data.val_split=mini_train",
                "data.batch_size=1",
                f"hydra.run.dir={ev}",
            ],
            monkeypatch,
        )
        == 0
    )
    scored = json.loads((ev / "metrics.json").read_text())["metrics"]
    assert logged["val/NDS"] > 0  # boxes matched: half the split scores differently
    for k in ("mAP", "NDS", "mATE", "mASE", "mAOE", "mAVE"):
        assert abs(logged[f"val/{k}"] - scored[k]) <= 1e-6, k
    # Each val sample counted once in the segmentation IoU too (no sample repeated to even out the processes).
    assert abs(logged["val/iou"] - scored["iou"]) <= 1e-6


def _boxes(n, seed):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 9)).astype(np.float32), rng.random(n).astype(np.float32), np.zeros(n, np.int64))


def test_compute_scores_the_boxes_of_every_process(monkeypatch):
    """gather() unites the shards (a sample the sampler's padding gave two processes has the same boxes in both)."""
    score = DetectionScore(grid=None)
    score.boxes = {"a": _boxes(2, 0), "b": _boxes(3, 1)}
    other = {"c": _boxes(1, 2), "b": score.boxes["b"]}
    monkeypatch.setattr(scoring, "gather_objects", lambda boxes: [boxes, other])
    seen = {}
    monkeypatch.setattr(DetectionScore, "_score", lambda self, *a: seen.update(self.boxes) or {"mAP": 0.5})
    assert score.compute(dataset=None) == {"mAP": 0.5}
    assert sorted(seen) == ["a", "b", "c"] and seen["c"] is other["c"]
