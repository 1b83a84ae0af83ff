"""Plot val/iou and train/loss against the optimiser step from a run's CSV log.

    python scripts/plot_learning_curve.py outputs/synthetic_cpu --out benchmarks/results/synthetic_cpu_learning_curve.png

All csv/version_* logs of the run are merged in numeric order, one value per step (bev.utils.metrics_log).
"""

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bev.utils.metrics_log import read_metrics_log  # noqa: E402


def parse_args():
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a bev-train run directory (holds csv/version_*/metrics.csv)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--title", default=None)
    return p.parse_args()


def read_series(log: dict, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric; empty when the run never logged it."""
    return log.get(key, ([], []))


def plot_loss(ax, log: dict) -> None:
    """Training loss per step (faint) and per epoch on the left axis."""
    s, v = read_series(log, "train/loss_step")
    ax.plot(s, v, color="tab:gray", alpha=0.5, lw=0.8, label="train/loss (step)")
    s, v = read_series(log, "train/loss_epoch")
    ax.plot(s, v, color="black", lw=1.5, label="train/loss (epoch mean)")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("BCE loss")


def plot_iou(ax, log: dict) -> None:
    """Validation IoU (and the visible-only and map IoUs when logged), the best val/iou marked."""
    s, v = read_series(log, "val/iou")
    ax.plot(s, v, "o-", color="tab:blue", label="val/iou")
    s2, v2 = read_series(log, "val/iou_vis")
    if v2:
        ax.plot(s2, v2, "s--", color="tab:green", ms=3, label="val/iou_vis")
    s3, v3 = read_series(log, "val/miou_map")
    if v3:  # map classes: BEVFusion's mean IoU
        ax.plot(s3, v3, "^-", color="tab:orange", ms=4, label="val/miou_map")
    ax.set_ylabel("IoU")
    ax.set_ylim(0, 1)
    if v:
        ax.axhline(max(v), color="tab:blue", ls=":", lw=0.8)
        ax.annotate(f"best {max(v):.3f}", (s[v.index(max(v))], max(v)), textcoords="offset points", xytext=(5, 5))


def main() -> None:
    """Read the run's metrics log, draw loss and IoU on twin axes, save the figure."""
    args = parse_args()
    try:
        log = read_metrics_log(args.run_dir)
    except FileNotFoundError as e:
        raise SystemExit(f"plot_learning_curve: error: {e}") from None
    fig, ax_loss = plt.subplots(figsize=(8, 4.5), dpi=120)
    plot_loss(ax_loss, log)
    ax_iou = ax_loss.twinx()
    plot_iou(ax_iou, log)
    # One legend for both axes; lines labelled "_..." (matplotlib's hidden ones) stay out.
    lines = [ln for ln in ax_loss.get_lines() + ax_iou.get_lines() if not ln.get_label().startswith("_")]
    ax_loss.legend(lines, [ln.get_label() for ln in lines], loc="center right")
    ax_loss.set_title(args.title or f"learning curve: {args.run_dir}")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
