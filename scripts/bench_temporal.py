#!/usr/bin/env python
"""Temporal vs single-frame training step, in one run, on the CPU or a GPU.

    .venv/bin/python scripts/bench_temporal.py [--steps 5] [--warmup 2] [--threads 2] [--device cuda]
    .venv/bin/python scripts/bench_temporal.py --variants fiery_static fiery     # FIERY's baseline setting

Variants, built from the Hydra configs as bev-train builds them and alternated round-robin: "static"
(experiment=synthetic_cpu), "temporal" (experiment=synthetic_temporal_cpu with every frame trained),
"temporal+past_no_grad" (the past frames without gradient; also with a 3x3 temporal block) and
"temporal+past_no_grad+past_cache" (the experiment as configured, the cache full: the same batch every
step); "fiery_static" and "fiery" are experiment=fiery_nuscenes's two stages at batch 1, only when named.
A step is forward + losses under the precision bev-train resolves on the device, backward, gradient
clipping and the optimiser's step, on random images with the real rig, ego motions of a car driving 2-5 m
per frame and random labels. Reports the median and fastest step and the ratios to the single-frame
variant; writes JSON to --out atomically.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import (  # noqa: E402
    checkout_commit,
    host_versions,
    malloc_env,
    processor_name,
    reexec_with_malloc_env,
    write_report,
)
from bench_train import compose_config, real_rig_batch  # noqa: E402

VARIANTS = {
    "static": ["experiment=synthetic_cpu"],
    "temporal": ["experiment=synthetic_temporal_cpu", "model.past_no_grad=false", "model.past_cache_mb=0"],
    "temporal+past_no_grad": ["experiment=synthetic_temporal_cpu", "model.past_cache_mb=0"],
    "temporal+past_no_grad+fusion3x3": [
        "experiment=synthetic_temporal_cpu",
        "model.past_cache_mb=0",
        "model.net.temporal.fusion_kernel=3",
    ],
    "temporal+past_no_grad+past_cache": ["experiment=synthetic_temporal_cpu"],
    # FIERY's baseline setting at batch 1 (random camera weights: the step costs the same)
    "fiery_static": ["experiment=fiery_nuscenes_static", "data.batch_size=1", "model.net.camera.weights=null"],
    "fiery": ["experiment=fiery_nuscenes", "data.batch_size=1", "model.net.camera.weights=null"],
}
EMBEDDED = [v for v in VARIANTS if not v.startswith("fiery")]


def sequence_batch(cfg, batch_size: int, seed: int = 0) -> dict:
    """real_rig_batch for every input frame (B, T, ...), ego motions and labels for the present and future frames."""
    import math

    import torch

    P, F = int(cfg.data.past_frames), int(cfg.data.future_frames)
    T = P + 1
    frames = real_rig_batch(cfg, batch_size * T, seed)
    batch = {k: v.view(batch_size, T, *v.shape[1:]) for k, v in frames.items() if k != "bev"}
    g = torch.Generator().manual_seed(seed)
    X, Y = frames["bev"].shape[-2:]
    ego = torch.eye(4).repeat(batch_size, T + F, 1, 1)
    for t in range(T + F - 1):  # frame t -> t+1 of a car driving forward and turning slowly
        yaw = 0.05 * (torch.rand(batch_size, generator=g) - 0.5)
        ego[:, t, 0, 0], ego[:, t, 0, 1], ego[:, t, 1, 0], ego[:, t, 1, 1] = yaw.cos(), -yaw.sin(), yaw.sin(), yaw.cos()
        ego[:, t, 0, 3] = -(2.0 + 3.0 * torch.rand(batch_size, generator=g))
    seg = (torch.rand(batch_size, F + 1, X, Y, generator=g) < 0.05).long()
    vec = torch.randn(batch_size, F + 1, 2, X, Y, generator=g)
    vec = torch.where(seg.bool()[:, :, None], vec, torch.full_like(vec, 255.0))
    batch["sample_tokens"] = [[f"window{b}_frame{t}" for t in range(T + F)] for b in range(batch_size)]
    batch.update(
        future_egomotion=ego,
        segmentation=seg,
        instance=seg,
        offset=vec,
        flow=vec * 0.5,
        centerness=torch.rand(batch_size, F + 1, 1, X, Y, generator=g) * math.e**-1,
        bev=frames["bev"][::T],
    )
    return batch


def depth_target(lit, batch: dict, seed: int = 0) -> dict:
    """batch with random lidar depth bins per camera feature cell (-1 = none), for a static model with a depth loss."""
    import torch

    B, N, _, H, W = batch["images"].shape
    g = torch.Generator().manual_seed(seed)
    D = lit.net.grid.depth_bins
    return {**batch, "depth": torch.randint(-1, D, (B, N, H // 16, W // 16), generator=g)}


class Variant:
    """A config's LightningModule, optimiser and batch; step() runs one timed training step."""

    def __init__(self, name: str, overrides: list[str], batch_size: int | None, device: str):
        import torch
        from hydra.utils import instantiate

        from bev.utils.precision import resolve_precision

        self.name = name
        cfg = compose_config(overrides)
        B = int(batch_size or cfg.data.batch_size)
        torch.manual_seed(0)
        self.device = device
        self.lit = instantiate(cfg.model).train().to(device)
        self.temporal = "past_frames" in cfg.data and int(cfg.data.past_frames) > 0
        batch = sequence_batch(cfg, B) if self.temporal else real_rig_batch(cfg, B)
        if self.lit.depth_weight:
            batch = depth_target(self.lit, batch)
        self.batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        self.opt = self.lit.make_optimizer()
        self.clip = cfg.trainer.get("gradient_clip_val")
        # the precision bev-train resolves for this device (trainer.precision "auto": bf16 where native)
        self.precision = resolve_precision(str(cfg.trainer.precision), device)[0]
        half = {"bf16": torch.bfloat16, "16": torch.float16}.get(self.precision.split("-")[0])
        self.autocast = (lambda: torch.autocast(device, dtype=half)) if half else nullcontext
        self.batch_size = B
        self.times: list[float] = []

    def sync(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()

    def step(self) -> float:
        import torch

        self.sync()
        t0 = time.perf_counter()
        with self.autocast():
            loss = self.lit.losses(self.lit(self.batch), self.batch, depth=bool(self.lit.depth_weight))[0]
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.lit.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync()
        return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5, help="measured steps per variant (medians)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=None, help="default: the configs' (4)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=EMBEDDED)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default=None, help="default: benchmarks/results/bench_temporal_<device>.json")
    a = p.parse_args(argv)
    a.out = a.out or str(REPO / "benchmarks" / "results" / f"bench_temporal_{a.device}.json")
    import torch

    torch.set_num_threads(a.threads)
    torch.backends.cudnn.benchmark = a.device == "cuda"  # as trainer=gpu
    runs = [Variant(n, VARIANTS[n], a.batch_size, a.device) for n in a.variants]
    for v in runs:
        for _ in range(a.warmup):
            v.step()
    for _ in range(a.steps):  # round-robin: load changes hit every variant alike
        for v in runs:
            v.times.append(v.step())
    by_name = {v.name: v for v in runs}
    results = {}
    for v in runs:
        med, best = statistics.median(v.times), min(v.times)
        ratios = {}
        static = by_name.get("fiery_static" if v.name.startswith("fiery") else "static")  # its single-frame step
        if static is not None:
            ratios = {
                "vs_static": round(med / statistics.median(static.times), 3),
                "vs_static_min": round(best / min(static.times), 3),
            }
        results[v.name] = {
            "median_s": round(med, 4),
            "min_s": round(best, 4),
            "steps_s": [round(t, 4) for t in v.times],
            "batch_size": v.batch_size,
            "precision": v.precision,
            **ratios,
        }
        shown = f"  {ratios['vs_static']:.2f}x {static.name}" if ratios else ""
        print(f"{v.name:32s} {med * 1e3:8.1f} ms/step median, {best * 1e3:8.1f} fastest ({v.precision}){shown}")
    report = {
        "script": "scripts/bench_temporal.py",
        "commit": checkout_commit(),
        "device": torch.cuda.get_device_name() if a.device == "cuda" else processor_name(),
        "threads": a.threads,
        "steps": a.steps,
        "warmup": a.warmup,
        "host": {**host_versions(), "processor": processor_name()},
        "malloc_env": malloc_env(),
        "variants": results,
    }
    write_report(a.out, report)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    reexec_with_malloc_env(__file__)
    sys.exit(main())
