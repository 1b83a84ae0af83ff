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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a bev-train run directory (holds csv/version_*/metrics.csv)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--title", default=None)
    args = p.parse_args()
    try:
        log = read_metrics_log(args.run_dir)
    except FileNotFoundError as e:
        raise SystemExit(f"plot_learning_curve: error: {e}") from None

    def read_series(key: str) -> tuple[list[int], list[float]]:
        return log.get(key, ([], []))

    fig, ax_loss = plt.subplots(figsize=(8, 4.5), dpi=120)
    s, v = read_series("train/loss_step")
    ax_loss.plot(s, v, color="tab:gray", alpha=0.5, lw=0.8, label="train/loss (step)")
    s, v = read_series("train/loss_epoch")
    ax_loss.plot(s, v, color="black", lw=1.5, label="train/loss (epoch mean)")
    ax_loss.set_xlabel("optimiser step")
    ax_loss.set_ylabel("BCE loss")
    ax_iou = ax_loss.twinx()
    s, v = read_series("val/iou")
    ax_iou.plot(s, v, "o-", color="tab:blue", label="val/iou")
    s2, v2 = read_series("val/iou_vis")
    if v2:
        ax_iou.plot(s2, v2, "s--", color="tab:green", ms=3, label="val/iou_vis")
    s3, v3 = read_series("val/miou_map")
    if v3:  # map classes: BEVFusion's mean IoU
        ax_iou.plot(s3, v3, "^-", color="tab:orange", ms=4, label="val/miou_map")
    ax_iou.set_ylabel("IoU")
    ax_iou.set_ylim(0, 1)
    if v:
        ax_iou.axhline(max(v), color="tab:blue", ls=":", lw=0.8)
        ax_iou.annotate(f"best {max(v):.3f}", (s[v.index(max(v))], max(v)), textcoords="offset points", xytext=(5, 5))
    lines = [ln for ln in ax_loss.get_lines() + ax_iou.get_lines() if not ln.get_label().startswith("_")]
    ax_loss.legend(lines, [ln.get_label() for ln in lines], loc="center right")
    ax_loss.set_title(args.title or f"learning curve: {args.run_dir}")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
