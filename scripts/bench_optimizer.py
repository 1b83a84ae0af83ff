"""Training step with the configured optimiser's default step vs its fused kernel.

    .venv/bin/python scripts/bench_optimizer.py [--device cuda] [--configs paper] [--variants fp32 channels_last+bf16]

The same model (bench_train's configs and variants) and the same batch, with two optimisers over
its parameters, PyTorch's default step (multi-tensor "foreach" on CUDA, a per-tensor loop on the
CPU) and fused=True, alternated step by step; medians of the steps and of the per-round ratios. It
decides where bev.lit.fused_default turns `fused=True` on: measured on an H200, the default step
loops over all 272 parameter tensors of the paper model in Python, host time a launch-bound GPU
step cannot hide. Writes JSON to --out atomically.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train as bt  # noqa: E402
from bench_common import write_report  # noqa: E402


def compare(cfg, name: str, batch: dict, rounds: int) -> dict:
    """One variant's model stepped with the default and the fused optimiser in turn."""
    v = bt.Variant(cfg, name, batch)
    params = [p for p in v.lit.parameters() if p.requires_grad]
    opts = {
        "default": v.lit.optimizer_factory(params=params),
        "fused": v.lit.optimizer_factory(params=params, fused=True),
    }
    t0 = time.perf_counter()
    v.step()  # cuDNN autotuning or oneDNN's first primitives, with the variant's own optimiser
    first = time.perf_counter() - t0
    for opt in opts.values():  # each optimiser's state allocated before the clock runs
        v.opt = opt
        v.step()
    times: dict[str, list[float]] = {k: [] for k in opts}
    for _ in range(rounds):
        for k, opt in opts.items():
            v.opt = opt
            times[k].append(v.step())
    ratios = [a / b for a, b in zip(times["default"], times["fused"])]
    return {
        "first_step_s": round(first, 2),
        **{f"{k}_step_ms": round(statistics.median(t) * 1e3, 2) for k, t in times.items()},
        "fused_speedup_median_of_rounds": round(statistics.median(ratios), 3),
        "fused_faster_rounds": sum(r > 1 for r in ratios),
        "steps_ms": {k: [round(x * 1e3, 2) for x in t] for k, t in times.items()},
    }


def parse_args(argv):
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--configs", nargs="+", choices=sorted(bt.CONFIGS), default=["embedded"])
    p.add_argument("--variants", nargs="+", choices=[k for k, v in bt.VARIANTS.items() if not v[2]], default=["fp32"])
    p.add_argument("--batch-size", type=int, default=None, help="replaces the configs' batch size")
    p.add_argument("--rounds", type=int, default=8, help="measured steps per optimiser and variant")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON report (default benchmarks/results/bench_optimizer_<device>.json)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Compare the two optimiser steps for every config and variant, print a line each, write the JSON."""
    a = parse_args(argv)
    import torch

    load0 = os.getloadavg()[0]
    bt.DEVICE = a.device
    torch.set_num_threads(a.threads)
    torch.backends.cudnn.benchmark = a.device == "cuda"  # as trainer=gpu
    out = a.out or os.path.join("benchmarks", "results", f"bench_optimizer_{a.device}.json")  # rename per machine
    report = {
        "benchmark": "training step: default vs fused optimiser step, alternated on one model",
        "device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or platform.machine(),
        "threads": a.threads,
        "rounds": a.rounds,
        "configs": {},
    }
    for key in a.configs:
        cfg = bt.compose_config([*bt.CONFIGS[key], *([f"data.batch_size={a.batch_size}"] if a.batch_size else [])])
        bs = int(cfg.data.batch_size)
        batch = {k: t.to(a.device) for k, t in bt.real_rig_batch(cfg, bs).items()}
        res = report["configs"][key] = {"batch_size": bs, "optimizer": cfg.model.optimizer._target_, "variants": {}}
        for name in a.variants:
            r = res["variants"][name] = compare(cfg, name, batch, a.rounds)
            print(
                f"{key} (batch {bs}) {name}: default {r['default_step_ms']:.1f} ms, fused {r['fused_step_ms']:.1f} ms, "
                f"fused {r['fused_speedup_median_of_rounds']:.2f}x (median of rounds; faster in "
                f"{r['fused_faster_rounds']}/{a.rounds})",
                flush=True,
            )
    report["host"] = bt.host(load0)
    report["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_report(out, report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
