#!/usr/bin/env python
"""Where a temporal checkpoint's VPQ comes from, frame by frame, against the present copied.

    .venv/bin/python scripts/vpq_breakdown.py CKPT [--dataroot data/synthetic] [--out FILE]

Runs the checkpoint over its val windows (bf16 autocast on CPUs with native bf16) and decodes the
instances as bev-eval does (the model's `instance_decoding`), for three predictions:
"model" (the learned future), "present_copied" (the present frame's heads copied to every future
frame with zero flow, bev-eval's baseline) and "true_present_copied" (the true present instances
copied: the best any copy of the present can do). For each, on the long range: VPQ, and per frame
PQ, SQ and RQ (not temporally consistent). Also the vehicles' motion: the share of true instances
whose centre moves more than one cell between the present and the last frame (what a copy of the
present gets wrong). Writes JSON to --out atomically.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import checkout_commit, write_report  # noqa: E402

from bev.instances import decode_sequence  # noqa: E402
from bev.lit_temporal import present_copied  # noqa: E402
from bev.metrics import PanopticQuality  # noqa: E402


def collect(ckpt: str, dataroot: str) -> tuple[dict[str, torch.Tensor], str]:
    """The heads and true instances over the val windows, concatenated (float32 heads), and the decoding."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from bev.inference import build_data_config, load_checkpoint
    from bev.utils.precision import cpu_bf16_support

    loaded = load_checkpoint(ckpt)
    data_cfg = build_data_config(OmegaConf.create({"dataroot": dataroot}), loaded.run_config)
    datamodule = instantiate(data_cfg)
    datamodule.setup("test")
    model = loaded.model.eval()
    keys, got = ("segmentation", "centerness", "offset", "flow"), []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_bf16_support() is not None):
        for i, batch in enumerate(datamodule.test_dataloader()):
            out = model(batch)
            got.append({**{k: out[k].float() for k in keys}, "instance": batch["instance"]})
            print(f"\rbatch {i + 1}", end="", flush=True)
    print()
    return {k: torch.cat([g[k] for g in got]) for k in got[0]}, model.instance_decoding


def scores(pred: torch.Tensor, true: torch.Tensor) -> dict:
    """VPQ and per-frame PQ/SQ/RQ of (B, T, X, Y) instance ids."""
    vpq = PanopticQuality(temporally_consistent=True)
    vpq.update(pred, true)
    frames = []
    for t in range(true.shape[1]):
        m = PanopticQuality(temporally_consistent=False)
        m.update(pred[:, t : t + 1], true[:, t : t + 1])
        frames.append({k: round(float(v), 4) for k, v in m.compute().items() if k in ("pq", "sq", "rq")})
    return {"vpq": round(float(vpq.compute()["pq"]), 4), "frames": frames}


def moving_share(true: torch.Tensor) -> dict:
    """True instances present in the first and last frame, and the share whose centre moved > 1 cell."""
    moved = total = 0
    for seq in true:
        for i in seq[0].unique().tolist():
            first, last = (seq[0] == i).nonzero().double(), (seq[-1] == i).nonzero().double()
            if i and len(last):
                total += 1
                moved += int((last.mean(0) - first.mean(0)).norm() > 1)
    return {"instances": total, "moving": moved, "share_moving": round(moved / max(total, 1), 4)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt")
    p.add_argument("--dataroot", default=str(REPO / "data" / "synthetic"))
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "vpq_breakdown_synthetic_cpu.json"))
    a = p.parse_args(argv)
    heads, method = collect(a.ckpt, a.dataroot)
    true = heads.pop("instance")
    heads["segmentation"] = heads["segmentation"][:, :, 0].sigmoid() > 0.5
    copied = present_copied(heads)

    def decode(h):
        return decode_sequence(h["segmentation"], h["centerness"], h["offset"], h["flow"], method)

    predictions = {
        "model": decode(heads),
        "present_copied": decode(copied),
        "true_present_copied": true[:, :1].expand_as(true),
    }
    report = {
        "script": "scripts/vpq_breakdown.py",
        "commit": checkout_commit(),
        "checkpoint": str(a.ckpt),
        "instance_decoding": method,
        "windows": len(true),
        "motion": moving_share(true),
        "predictions": {name: scores(pred, true) for name, pred in predictions.items()},
    }
    for name, r in report["predictions"].items():
        print(f"{name:22s} VPQ {r['vpq']:.3f}  per-frame PQ " + " ".join(f"{f['pq']:.3f}" for f in r["frames"]))
    print(f"moving vehicles: {report['motion']}")
    write_report(a.out, report)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
