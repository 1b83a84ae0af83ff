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
from bev.tasks.detection.tracking import Tracker, TrackVelocity, check_past
from bev.tasks.task import SampleContext, Task
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
        self.tracker: Tracker | None = None  # bev-predict's, over the run's samples (start_predicting)

    @classmethod
    def upgrade_model_config(cls, model_cfg, path: Path) -> None:
        """Checkpoints of before the detection rules were kept may score velocities from tracks over more past key
        frames than the rules allow (check_past): they are scored within them, with a warning."""
        import warnings

        from omegaconf import DictConfig, OmegaConf

        from bev.tasks.detection.tracking import MAX_PAST_KEY_FRAMES

        track = OmegaConf.select(model_cfg, "detection.track_velocity")
        past = track.get("past_frames") if isinstance(track, DictConfig) else None
        if isinstance(past, int) and past > MAX_PAST_KEY_FRAMES:
            warnings.warn(
                f"{str(path)!r} scores velocities from tracks over {past} past key frames, beyond the nuScenes "
                f"detection rules: they are scored over {MAX_PAST_KEY_FRAMES} "
                "(model.detection.track_velocity.past_frames)",
                stacklevel=3,
            )
            track.past_frames = MAX_PAST_KEY_FRAMES

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

    @classmethod
    def eval_files(cls, out: Path) -> list[Path]:
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

    # --- bev-predict: the boxes in the npz, predictions.json and the picture (only with boxes=auto|true)

    gives_boxes = True

    def start_predicting(self, options: Mapping[str, Any]) -> bool:
        """A fresh tracker when the checkpoint scores velocities from tracks (model.detection.track_velocity)."""
        self.tracker = None if self.track is None else Tracker(self.track)
        return bool(options["boxes"])

    def prediction_format(self, options: Mapping[str, Any]) -> dict[str, Any]:
        from bev.tasks.detection.predict import boxes_format

        return boxes_format(float(options["box_threshold"]))

    def sample_prediction(self, item: dict[str, Any], sample: SampleContext) -> dict[str, Any]:
        from bev.tasks.detection.predict import tracked

        if self.tracker is None:
            return item
        det = tracked(self.tracker, item["detections"], sample.index, sample.row, sample.follows)
        return {**item, "detections": det}

    def npz_arrays(self, item: Mapping) -> dict[str, Any]:
        from bev.tasks.detection.predict import box_arrays

        return box_arrays(item["detections"])

    def sample_record(self, item: Mapping, options: Mapping[str, Any]) -> dict[str, Any]:
        from bev.tasks.detection.predict import box_records

        return box_records(item["detections"], float(options["box_threshold"]))

    def picture_layers(self, item: Mapping, options: Mapping[str, Any]) -> dict[str, Any]:
        """The boxes, those at score >= box_threshold (bev-eval gives none: bev.viz's default)."""
        layers = {"detections": item["detections"]}
        return layers | ({"box_threshold": float(options["box_threshold"])} if "box_threshold" in options else {})

    # --- bev-export: the head's maps, decoded in Python (bev.tasks.detection.decode)

    exported = ("heatmap", "regression")

    @staticmethod
    def exported_maps(out: Mapping) -> dict[str, torch.Tensor]:
        det = out["detection"]
        return {"heatmap": det["heatmap"], "regression": det["regression"]}
