"""What every task is in training and evaluation (bev.tasks.<task>.task subclasses it): its loss on the network's
output, its metric per stage, its predictions, what bev-eval asks of it (its folders, its part of metrics.json,
its report), what bev-predict asks (its files, npz arrays, record fields and picture layers) and what bev-export
asks of its head (its exported maps). The LightningModule and the entry points call these alone: no entry point
asks which task it holds."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

NPZ_SCALE = 255  # probabilities are stored as uint8 q = round(p * 255): p = q / 255, error <= 0.002


def quantised(probs: torch.Tensor) -> np.ndarray:
    """Probabilities as the npz stores them: uint8 q = round(p * NPZ_SCALE), p clamped to [0, 1]."""
    p = probs.detach().float().cpu().clamp(0, 1).numpy()
    return np.rint(p * NPZ_SCALE).astype(np.uint8)


@dataclass(frozen=True)
class SampleContext:
    """Where a predicted sample is: the dataset index, its row there, and whether the sample predicted just
    before it is its previous key frame (bev-predict predicts each scene in time order)."""

    index: Mapping[str, Any]
    row: int
    follows: bool


class Task(nn.Module):
    name = ""
    absorbs: tuple[str, ...] = ()  # tasks whose loss this one weighs among its own terms (not summed again)

    def loss(self, out: Mapping, batch: Mapping, terms: Mapping) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(this task's weighted loss, its unweighted terms by log name); `terms`: those of the tasks before."""
        raise NotImplementedError

    @classmethod
    def upgrade_model_config(cls, model_cfg, path: Path) -> None:
        """Bring this task's settings in the model config of an older checkpoint at `path` (stored before today's
        rules) within them, in place and with a warning, before the model is built (bev.inference.load_checkpoint)."""

    def has_targets(self, batch: Mapping) -> bool:
        """Whether `batch` carries this task's targets (bev-predict's data may not)."""
        return True

    def update(self, out: Mapping, batch: Mapping, stage: str) -> None:
        raise NotImplementedError

    def results(self, stage: str, context) -> dict[str, float]:
        """The stage's scores, keyed without the stage prefix; the metric is reset."""
        raise NotImplementedError

    def predict(self, out: Mapping) -> dict[str, Any]:
        raise NotImplementedError

    # --- bev-eval

    @classmethod
    def eval_files(cls, out: Path) -> list[Path]:
        """Files this task writes in bev-eval's output folder (checked before anything runs, so before the
        checkpoint says which tasks it has: a class's)."""
        return []

    def check_eval_folders(self, out: Path, overwrite: bool) -> None:
        """Refuse, before anything runs, folders this task would write in that it must not."""

    def before_test(self, out: Path) -> None:
        """Ready bev-eval's output folder for this evaluation's files."""

    def record(self) -> dict[str, Any]:
        """What metrics.json says of how this task's metrics are defined."""
        return {}

    def after_test(self, record: dict[str, Any], out: Path, index, dataroot: str, options: Mapping[str, Any]) -> None:
        """Scores computed from the files the test wrote, added to `record`."""

    def report(self, record: Mapping[str, Any], out: Path) -> str:
        """This task's part of bev-eval's printed report."""
        return ""

    # --- bev.predict, bev-predict and bev-eval's pictures

    @staticmethod
    def head_predictions(out: Mapping) -> dict[str, Any]:
        """What bev.predict gives of a bare network's output of this task's head, with no task module (so no
        options) at hand: {} when its predictions need them."""
        return {}

    def decoded(self, pred: Mapping) -> dict[str, Any]:
        """What bev.predict adds to the merged predictions, decoded from them (the motion task's instance ids)."""
        return {}

    def start_predicting(self, options: Mapping[str, Any]) -> bool:
        """Ready this task for one bev-predict run (options: boxes, box_threshold, class_names, n_objects);
        False: the run writes and draws nothing of it (boxes=false)."""
        return True

    def prediction_format(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """What predictions.json says of this task's files (its npz_format, or fields of its own)."""
        return {}

    def sample_file(self, out: Path, token: str) -> Path | None:
        """The file of a sample's prediction in a format of this task's own, replacing the sample's npz; None:
        its arrays go into the npz beside the sample's PNG."""
        return None

    def write_sample(self, out: Path, token: str, item: Mapping) -> Path | None:
        """Write the sample's prediction `item` to sample_file (returned); None where it has none."""
        return None

    def sample_prediction(self, item: dict[str, Any], sample: SampleContext) -> dict[str, Any]:
        """One sample's predictions as bev-predict writes and draws them (the detection task's boxes: with the
        velocities of their tracks over the key frames before)."""
        return item

    def npz_arrays(self, item: Mapping) -> dict[str, np.ndarray]:
        """This task's arrays in the sample's npz (probabilities quantised: `quantised`)."""
        return {}

    def sample_record(self, item: Mapping, options: Mapping[str, Any]) -> dict[str, Any]:
        """What the sample's record in predictions.json adds of this task's predictions."""
        return {}

    def picture_layers(self, item: Mapping, options: Mapping[str, Any]) -> dict[str, Any]:
        """What this task adds to the sample's picture: the layers bev.viz.sample_picture draws (BEV maps, boxes,
        a window's instances, a voxel volume)."""
        return {}

    # --- bev-export: a class's, since the network's heads, not its trained tasks, give the exported maps

    exported: tuple[str, ...] = ()  # the exported model's outputs of this task's head, in order
    gives_boxes = False  # its outputs are 3D boxes: predicted and exported with boxes=auto|true only

    @staticmethod
    def exported_maps(out: Mapping) -> dict[str, torch.Tensor]:
        """The network output's maps of this task's head, by their names in `exported`."""
        return {}
