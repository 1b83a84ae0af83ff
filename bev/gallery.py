"""`bev-gallery`: write a PNG of one sample's 6 cameras and its BEV target."""

from __future__ import annotations

import argparse
import sys

from bev.data.nuscenes import NuScenesBEVDataset
from bev.viz import save_sample_png


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bev-gallery", description=__doc__)
    p.add_argument("--dataroot", required=True, help="nuScenes (or synthetic nuScenes-format) root")
    p.add_argument("--version", default="v1.0-mini")
    p.add_argument("--split", default="mini_val")
    p.add_argument("--index", type=int, default=0, help="sample index within the split")
    p.add_argument("--augment", action="store_true", help="show a training augmentation instead of the val crop")
    p.add_argument("--cache-dir", default=None, help="index cache folder (default DATAROOT/.bev_cache)")
    p.add_argument("--out", default=None, help="PNG path (default gallery_<split>_<index>.png)")
    a = p.parse_args(argv)
    try:
        ds = NuScenesBEVDataset(a.dataroot, version=a.version, split=a.split, augment=a.augment, cache_dir=a.cache_dir)
        if not -len(ds) <= a.index < len(ds):
            raise IndexError(f"--index {a.index} out of range: split {a.split!r} has {len(ds)} samples")
        sample = ds[a.index]
    except (FileNotFoundError, ValueError, IndexError) as e:
        print(f"bev-gallery: error: {e}", file=sys.stderr)
        return 2
    out = a.out or f"gallery_{a.split}_{a.index}.png"
    save_sample_png(out, sample, grid=ds.grid, title=f"{a.version}/{a.split}[{a.index}] {sample['sample_token']}")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
