"""Decoded boxes of a split collected over batches, then scored as the nuScenes leaderboard scores them
(bev.tasks.detection.nusc_eval, the devkit's DetectionEval). Used by training (val/mAP, val/NDS) and bev-eval.

Under DDP each process sees its shard of the split: compute() gathers every process's boxes, scores them
once on rank 0 (as mmdet3d's collect_results does before the devkit) and gives every process the same
numbers, so the logged score and the checkpoint monitor are those of the whole split."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bev.geometry import Grid, matrix_to_quaternion
from bev.tasks.detection.decode import decode
from bev.tasks.detection.nusc_eval import RANGES, evaluate, to_results
from bev.tasks.detection.tracking import TrackVelocity, sample_links, track_velocity
from bev.utils.dist import gather_objects, on_rank_zero


class DetectionScore:
    """update() with the head's maps of a batch and its sample tokens; compute() scores every sample seen
    (samples of the split never seen get no box) on the dataset's split. `decoding`: options of
    bev.tasks.detection.decode (score_threshold, top_k, nms); `track`: velocities from the boxes' tracks over the
    split's past key frames (bev.tasks.detection.tracking) instead of the head's, None to keep the head's."""

    def __init__(self, grid: Grid, decoding: Mapping[str, Any] | None = None, track: TrackVelocity | None = None):
        self.grid, self.decoding, self.track = grid, dict(decoding or {}), track
        self.boxes: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._nusc: dict[tuple[str, str], Any] = {}  # the devkit's tables, loaded once per dataroot and version

    def reset(self) -> None:
        self.boxes = {}

    @torch.no_grad()
    def decode(self, outputs: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """The head's maps -> per sample {"boxes", "scores", "labels"} (bev.tasks.detection.decode, this scorer's
        options)."""
        return decode(outputs["heatmap"], outputs["regression"], self.grid, **self.decoding)

    def update(self, outputs: Mapping[str, torch.Tensor], sample_tokens: Sequence[str]) -> None:
        for token, det in zip(sample_tokens, self.decode(outputs)):
            self.boxes[str(token)] = tuple(det[k].cpu().numpy() for k in ("boxes", "scores", "labels"))

    def results(self, dataset) -> dict[str, list[dict]]:
        """The devkit's results of every sample of `dataset` (a NuScenesBEVDataset): global frame, per token."""
        tokens = [str(t) for t in dataset.index["sample_token"]]
        empty = (np.zeros((0, 9), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int64))
        cols = [self.boxes.get(t, empty) for t in tokens]
        rotations = [matrix_to_quaternion(r) for r in dataset.index["ego_rotation"]]
        return to_results(tokens, *zip(*cols), rotations, list(dataset.index["ego_translation"]))

    def gather(self) -> None:
        """Every process's boxes in self.boxes (a sample seen by two processes, as the distributed sampler's
        padding repeats some, has the same boxes in both)."""
        merged: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for boxes in gather_objects(self.boxes):
            merged.update(boxes)
        self.boxes = merged

    def compute(self, dataset, output_dir: str | Path | None = None, verbose: bool = False) -> dict[str, float]:
        """DetectionEval's metrics (mAP, NDS, mATE..., AP/<class>) of what update() saw in every process, on
        dataset's split; results_nusc.json and metrics_summary.json go to output_dir (a temporary folder when
        None), written by rank 0 alone."""
        self.gather()
        return on_rank_zero(lambda: self._score(dataset, output_dir, verbose))

    def _score(self, dataset, output_dir: str | Path | None, verbose: bool) -> dict[str, float]:
        key = (dataset.dataroot, dataset.version)
        if key not in self._nusc:
            from nuscenes import NuScenes

            self._nusc[key] = NuScenes(version=dataset.version, dataroot=dataset.dataroot, verbose=False)
        results = self.results(dataset)
        if self.track is not None:
            results = track_velocity(results, sample_links(self._nusc[key]), self.track)
        if output_dir is not None:  # bev-eval: the mAP per distance band too
            return evaluate(results, *key, dataset.split, output_dir, verbose, nusc=self._nusc[key], ranges=RANGES)
        with tempfile.TemporaryDirectory(prefix="bev-det-") as tmp:
            return evaluate(results, *key, dataset.split, tmp, verbose, nusc=self._nusc[key])
