#!/usr/bin/env python
"""What BEV augmentation (data.bev_aug) adds to a detection training item, in the loader (where it runs):
CPU time per item with and without it, the same items and image augmentations, variants alternated.

    .venv/bin/python scripts/bench_bev_aug.py --dataroot data/synthetic [--items 48] [--rounds 5]

CPU time (time.process_time) of one process, so other work on the machine does not count; beside it, the CPU
time of one training step of experiment=synthetic_det_cpu (batch 4, forward + backward) in the same process,
the share an item's extra cost takes of a step when the items are made in the training process (the embedded
experiments' data.num_workers=0). CBGS only changes which items an epoch draws, not their cost. Writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from bev.data import NuScenesBEVDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import host_versions, processor_name, write_report  # noqa: E402

EXPERIMENT = "experiment=synthetic_det_cpu"


def dataset(dataroot: str, **options):
    """The experiment's training dataset (its grid, classes, targets), augmented, with `options` replaced."""
    from bench_train import compose_config
    from hydra.utils import instantiate

    config = instantiate(compose_config([EXPERIMENT, f"data.dataroot={dataroot}"]).data).config.dataset
    return NuScenesBEVDataset(split="mini_train", augment=True, verbose=False, config=config, **options)


def cpu_seconds_per_item(ds, items: int) -> float:
    torch.manual_seed(0)
    start = time.process_time()
    for i in range(items):
        ds[i % len(ds)]
    return (time.process_time() - start) / items


def step_cpu_seconds(dataroot: str, steps: int = 3) -> float:
    """CPU seconds of one synthetic_det_cpu training step (forward, loss, backward) on a real batch of 4."""
    from bench_train import build, compose_config
    from torch.utils.data import default_collate

    lit = build(compose_config([EXPERIMENT, f"data.dataroot={dataroot}"]), channels_last=False)
    ds = dataset(dataroot)
    batch = default_collate([ds[i] for i in range(4)])
    batch.pop("sample_token")
    times = []
    for _ in range(steps + 1):
        start = time.process_time()
        loss, _, _ = lit.forward_loss(batch)
        loss.backward()
        times.append(time.process_time() - start)
    return statistics.median(times[1:])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataroot", required=True)
    p.add_argument("--items", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/bench_bev_aug_cpu.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # a loader worker's share
    variants = {"plain": dataset(args.dataroot), "bev_aug": dataset(args.dataroot, bev_aug="bevdet")}
    times = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, ds in variants.items():
            times[name].append(cpu_seconds_per_item(ds, args.items))
    med = {k: statistics.median(v) for k, v in times.items()}
    step = step_cpu_seconds(args.dataroot)
    report = {
        "benchmark": "CPU time per detection training item with and without BEV augmentation",
        "items_per_round": args.items,
        "rounds": args.rounds,
        "ms_per_item": {k: round(v * 1e3, 2) for k, v in med.items()},
        "ms_per_item_rounds": {k: [round(x * 1e3, 2) for x in v] for k, v in times.items()},
        "overhead": round(med["bev_aug"] / med["plain"] - 1, 4),
        "step_ms_synthetic_det_cpu_batch4": round(step * 1e3, 1),
        "extra_per_step_if_made_in_the_training_process": round(4 * (med["bev_aug"] - med["plain"]) / step, 4),
        "host": {**host_versions(), "cpu": processor_name()},
        "command": "scripts/bench_bev_aug.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(
        f"per item: {report['ms_per_item']} ms; BEV augmentation adds {report['overhead']:+.1%} to an item, "
        f"{report['extra_per_step_if_made_in_the_training_process']:+.1%} to a batch-4 step made in the training process"
    )
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
