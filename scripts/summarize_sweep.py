"""Re-write summary.csv / summary.md for a sweep directory (bev-train -m does this itself at the end).

python scripts/summarize_sweep.py logs/train/multiruns/2026-01-01_12-00-00
"""

import argparse

from bev.callbacks import summarize_sweep

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweep_dir")
    p.add_argument("--sort-key", default="val/iou_best")
    args = p.parse_args()
    rows = summarize_sweep(args.sweep_dir, args.sort_key)
    print(f"{len(rows)} runs -> {args.sweep_dir}/summary.md, summary.csv")
