"""Sweep summaries: <sweep_dir>/summary.csv and summary.md from each run's metrics.json."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path
from typing import Any

RUN_METRICS_FILE = "metrics.json"  # written by bev.train in every run directory


def _scalar(v: Any) -> Any:
    return None if v is None or (isinstance(v, float) and v != v) else v


def summarize_sweep(sweep_dir: str | os.PathLike, sort_key: str = "val/iou_best") -> list[dict[str, Any]]:
    """Collect <sweep_dir>/*/metrics.json into summary.csv and summary.md, best `sort_key` first.

    Runs without a metrics file (crashed, killed) are listed with status "missing".
    Returns the rows.
    """
    sweep_dir = Path(sweep_dir)
    rows = []
    for run in sorted(
        (p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.name
    ):
        f = run / RUN_METRICS_FILE
        if not f.is_file():
            if (run / ".hydra").is_dir():
                rows.append({"run": run.name, "status": "missing", "overrides": _overrides(run)})
            continue
        rec = json.loads(f.read_text())
        row = {"run": run.name, "status": rec.get("status", "ok"), "overrides": " ".join(rec.get("overrides", []))}
        row.update({k: _scalar(v) for k, v in rec.get("metrics", {}).items()})
        row["best_ckpt"] = rec.get("best_ckpt")
        rows.append(row)
    rows.sort(key=lambda r: (r.get(sort_key) is None, -(r.get(sort_key) or 0.0)))
    metric_cols = sorted({k for r in rows for k in r if "/" in k}, key=lambda k: (k != sort_key, k != "val/iou", k))
    cols = ["run", "overrides", *metric_cols, "status", "best_ckpt"]
    with open(sweep_dir / "summary.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    short = ["run", "overrides", *[c for c in metric_cols if c.startswith("val/")], "status"]

    def cell(v: Any) -> str:
        return f"{v:.4f}" if isinstance(v, float) else ("" if v is None else str(v).replace("|", "\\|"))

    md = [f"# Sweep summary: {sweep_dir}", "", f"{len(rows)} runs, sorted by {sort_key} (best first).", ""]
    md += ["| " + " | ".join(short) + " |", "|" + "---|" * len(short)]
    md += ["| " + " | ".join(cell(r.get(c)) for c in short) + " |" for r in rows]
    (sweep_dir / "summary.md").write_text("\n".join(md) + "\n")
    return rows


def _overrides(run: Path) -> str:
    f = run / ".hydra" / "overrides.yaml"
    if not f.is_file():
        return ""
    from omegaconf import OmegaConf

    return " ".join(OmegaConf.load(f))


try:  # Hydra is a dependency; the guard only keeps this module importable in odd environments
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover
    _HydraCallback = object


class SweepSummary(_HydraCallback):
    """Hydra callback: at the end of `bev-train -m ...`, writes summary.csv / summary.md in the sweep dir."""

    def __init__(self, sort_key: str = "val/iou_best"):
        self.sort_key = sort_key

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        rows = summarize_sweep(sweep_dir, self.sort_key)
        print(f"Sweep summary ({len(rows)} runs): {sweep_dir / 'summary.md'} and {sweep_dir / 'summary.csv'}")
        print((sweep_dir / "summary.md").read_text())
        failed = [r for r in rows if r["status"] != "ok"]
        if failed:  # the sweep went on past them; its exit status still says so
            runs = "; ".join(f"run {r['run']} ({r['overrides']}): {str(r['status'])[:120]}" for r in failed[:3])
            print(
                f"bev-{config.task_name}: error: {len(failed)} of {len(rows)} sweep runs failed: {runs}. "
                f"Each run's error.txt has its traceback.",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(1)
