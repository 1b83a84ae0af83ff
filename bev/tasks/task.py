"""What every task is in training and evaluation (bev.tasks.<task>.task subclasses it): its loss on the network's
output, its metric per stage, its predictions, and what bev-eval asks of it (its folders, its part of metrics.json,
its report). The LightningModule and the entry points call these alone: no entry point asks which task it holds."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn


class Task(nn.Module):
    name = ""
    absorbs: tuple[str, ...] = ()  # tasks whose loss this one weighs among its own terms (not summed again)

    def loss(self, out: Mapping, batch: Mapping, terms: Mapping) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(this task's weighted loss, its unweighted terms by log name); `terms`: those of the tasks before."""
        raise NotImplementedError

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

    def eval_files(self, out: Path) -> list[Path]:
        """Files this task writes in bev-eval's output folder (checked before anything runs)."""
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
