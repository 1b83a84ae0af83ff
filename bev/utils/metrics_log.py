"""The CSV metrics log of a run, <run>/csv/version_N/metrics.csv: one home for writing and reading it.

A resumed run appends to the log it continues instead of starting version_N+1. A run killed after
its last checkpoint has logged steps that the resumed run logs again, so readers keep the last
record of each step; they merge every version in numeric order (version_2 before version_10).
"""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

METRICS_FILE = "metrics.csv"
_VERSION = re.compile(r"version_(\d+)")


def versions(log_root: str | os.PathLike) -> list[Path]:
    """The csv/version_N folders under `log_root` (e.g. <run>/csv), in numeric order."""
    root = Path(log_root)
    found = [(int(m.group(1)), p) for p in root.glob("version_*") if p.is_dir() and (m := _VERSION.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer, keeping an existing metrics.csv (Lightning deletes it) and its columns."""

    def _check_log_dir_exists(self) -> None:
        if not self._fs.isfile(self.metrics_file_path):
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as f:
            header = next(csv.reader(f), [])
        self.metrics_keys = sorted(header)
        if header != self.metrics_keys:  # appended rows follow the sorted key order
            self._rewrite_with_new_header(self.metrics_keys)


class ResumableCSVLogger(CSVLogger):
    """CSVLogger that, when `resume` is set (the checkpoint a run resumes from), continues the newest
    existing <save_dir>/<name>/version_N log of the run directory, appending to its metrics.csv."""

    def __init__(
        self, save_dir: str, name: str = "csv", version: int | str | None = None, resume: str | None = None, **kwargs
    ):
        self._append = bool(resume)
        if self._append and version is None:
            existing = versions(Path(save_dir) / name)
            version = int(existing[-1].name.removeprefix("version_")) if existing else None
        super().__init__(save_dir, name=name, version=version, **kwargs)

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = (_AppendingWriter if self._append else ExperimentWriter)(log_dir=self.log_dir)
        return self._experiment


def _read_rows(path: Path) -> list[tuple[int, dict[str, float]]]:
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("step") in (None, ""):
                continue
            values = {}
            for k, v in row.items():
                if k != "step" and v not in (None, ""):
                    try:
                        values[k] = float(v)
                    except ValueError:
                        pass
            rows.append((int(float(row["step"])), values))
    return rows


def read_metrics_log(run_dir: str | os.PathLike, name: str = "csv") -> dict[str, tuple[list[int], list[float]]]:
    """Every metric of a run's CSV log as (steps, values), sorted by step, one value per step.

    Versions are merged in numeric order and the last record of a step wins (a resumed run re-logs the
    steps after its checkpoint). A version whose first step is not past the first step of the versions
    before it is a new run from scratch in the same directory: the earlier versions are dropped.
    Raises FileNotFoundError when the run has no log.
    """
    files = [v / METRICS_FILE for v in versions(Path(run_dir) / name) if (v / METRICS_FILE).is_file()]
    if not files:
        raise FileNotFoundError(
            f"no {name}/version_*/{METRICS_FILE} under {run_dir} (is it a bev-train run directory?)"
        )
    merged: dict[str, dict[int, float]] = {}
    first_step: int | None = None
    for f in files:
        rows = _read_rows(f)
        if not rows:
            continue
        start = min(step for step, _ in rows)
        if first_step is not None and start <= first_step:
            merged = {}
        if not merged:
            first_step = start
        for step, values in rows:
            for k, v in values.items():
                merged.setdefault(k, {})[step] = v
    return {k: (sorted(s), [s[i] for i in sorted(s)]) for k, s in merged.items()}
