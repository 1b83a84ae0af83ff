"""The detection task in training: CenterPoint's loss on the network's "detection" maps (weighted by `weight`), the
boxes decoded (decoding) and scored by the nuScenes devkit's DetectionEval per evaluation stage, velocities from
tracks where track_velocity says so (within the detection rules' 0.5 s of past)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from bev.geometry import Grid
from bev.tasks.detection.decode import check_decoding, decode
from bev.tasks.detection.loss import DetectionLoss
from bev.tasks.detection.nusc_eval import PLOTS_DIR, RESULTS_FILE, SUMMARY_FILE, format_table
from bev.tasks.detection.scoring import DetectionScore
from bev.tasks.detection.tracking import TrackVelocity, check_past
from bev.tasks.task import Task
from bev.utils.io import check_output_folder

OPTIONS = ("weight", "loss", "decoding", "velocity_frame", "track_velocity")


class DetectionTask(Task):
    """model.detection: {weight, loss: DetectionLoss options, decoding: bev.tasks.detection.decode options,
    velocity_frame, track_velocity}; past_frames: the network's (its fused past counts against the rules)."""

    name = "detection"

    def __init__(self, grid: Grid, options: Mapping[str, Any] | None = None, past_frames: int = 0):
        super().__init__()
        det = dict(options or {})
        unknown = sorted(set(det) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown model.detection key(s) {unknown}: {', '.join(OPTIONS)}")
        self.weight = float(det.get("weight", 1.0))
        # Where the head regresses velocity: one choice for the loss and every decoding of its maps.
        frame = {"velocity_frame": det.get("velocity_frame", "ego")}
        self.loss_fn = DetectionLoss(**dict(det.get("loss") or {}), **frame)
        self.decoding = {**dict(det.get("decoding") or {}), **frame}
        check_decoding(self.decoding)
        track = det.get("track_velocity")
        track = None if track is None else TrackVelocity.from_config(track)
        check_past(past_frames, track)  # the detection task's 0.5 s of past
        self.grid, self.track = grid, track
        self.scores = {s: DetectionScore(grid, self.decoding, track) for s in ("val", "test")}

    def loss(self, out: Mapping, batch: Mapping, terms: Mapping) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if "det_heatmap" not in batch:
            raise ValueError("model.tasks has detection: the batches need its targets, set data.detection=true")
        det = self.loss_fn(out["detection"], batch)
        parts = {"det": det["loss"], "det_heatmap": det["heatmap"], "det_regression": det["regression"]}
        return self.weight * det["loss"], parts

    def has_targets(self, batch: Mapping) -> bool:
        return "det_heatmap" in batch  # bev-predict's data may have none

    def update(self, out: Mapping, batch: Mapping, stage: str) -> None:
        self.scores[stage].update(out["detection"], batch["sample_token"])

    def results(self, stage: str, context) -> dict[str, float]:
        """DetectionEval's mAP, NDS, ... of the stage's boxes (none in the sanity check or without a val set);
        validation keeps the summary keys, tests also the per-class ones."""
        score = self.scores[stage]
        if context.sanity_checking or context.dataset is None:
            score.reset()
            return {}
        metrics = score.compute(context.dataset, context.output_dir if stage == "test" else None)
        score.reset()
        return metrics if stage == "test" else {k: v for k, v in metrics.items() if "/" not in k}

    @torch.no_grad()
    def decode_boxes(self, maps: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """The head's maps -> per sample {"boxes", "scores", "labels"} (bev.tasks.detection.decode)."""
        return decode(maps["heatmap"], maps["regression"], self.grid, **self.decoding)

    def predict(self, out: Mapping) -> dict[str, Any]:
        return {"detections": self.decode_boxes(out["detection"])}

    # --- bev-eval

    def eval_files(self, out: Path) -> list[Path]:
        """The files bev-eval has this task write in its output folder: the results and the devkit's summary."""
        return [out / RESULTS_FILE, out / SUMMARY_FILE]

    def check_eval_folders(self, out: Path, overwrite: bool) -> None:
        """The devkit's plots folder stays inside the output folder and is a folder."""
        check_output_folder(out, out / PLOTS_DIR, "devkit's plots")

    def report(self, record: Mapping[str, Any], out: Path) -> str:
        return (
            f"3D detection, scored by the nuScenes devkit's DetectionEval (results: {out / RESULTS_FILE}):\n"
            + format_table(record["metrics"])
        )
