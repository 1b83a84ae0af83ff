#!/usr/bin/env python
"""Temporal vs single-frame training step, in one run, on the CPU or a GPU.

    .venv/bin/python scripts/bench_temporal.py [--steps 5] [--warmup 2] [--threads 2] [--device cuda]
    .venv/bin/python scripts/bench_temporal.py --variants fiery_static fiery     # FIERY's baseline setting
    .venv/bin/python scripts/bench_temporal.py --variants fiery fiery_stride8 --fiery /tmp/fiery [--site DIR]

Variants (built as bev-train builds them, alternated round-robin): "static" (experiment=synthetic_cpu),
"temporal" (synthetic_temporal_cpu, every frame trained), "temporal+past_no_grad" (also with a 3x3 temporal
block), "temporal+past_no_grad+past_cache" (the experiment as configured, the cache full); "fiery_static" and
"fiery" (experiment=fiery_nuscenes's two stages at batch 1), "fiery_fp32" and "fiery_stride8" (as many frustum
points as FIERY's) only when named. A step: forward + losses in the precision bev-train resolves, backward,
clipping, the optimiser's step, on random images with the real rig, ego motions of 2-5 m a frame and random
labels. Reports medians and the ratios to the single-frame variant; writes JSON to --out atomically.

--fiery adds FIERY's own step ("fiery_original", its configs/baseline.yml at batch 1 in fp32, same images and
rig) and each variant's speed-up over it: a checkout of github.com/wayveai/fiery, loaded as it is; it needs
efficientnet_pytorch and fvcore (pip install --target DIR efficientnet_pytorch fvcore yacs iopath portalocker
termcolor tabulate; pass DIR as --site); the pytorch_lightning 1.2 names it imports are stood in for.
"""

from __future__ import annotations

import statistics
import sys
import time
import types
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import (  # noqa: E402
    RESULTS,
    checkout_commit,
    device_name,
    host_versions,
    malloc_env,
    reexec_with_malloc_env,
    step_parser,
    sync,
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
VARIANTS["fiery_fp32"] = [*VARIANTS["fiery"], "trainer.precision=32-true"]
# FIERY's encoder (fiery/models/encoder.py, DOWNSAMPLE 8): stride-16 features upsampled into stride 8, 128 channels
VARIANTS["fiery_stride8"] = [*VARIANTS["fiery"], "model.net.camera.downsample=8", "model.net.camera.mid_channels=128"]
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
        if self.lit.depth_weight:  # random lidar depth bins per camera feature cell (-1 = none)
            _, N, _, H, W = batch["images"].shape
            g = torch.Generator().manual_seed(0)
            batch["depth"] = torch.randint(-1, self.lit.net.grid.depth_bins, (B, N, H // 16, W // 16), generator=g)
        self.batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        self.opt = self.lit.make_optimizer()
        self.clip = cfg.trainer.get("gradient_clip_val")
        # the precision bev-train resolves for this device (trainer.precision "auto": bf16 where native)
        self.precision = resolve_precision(str(cfg.trainer.precision), device)[0]
        half = {"bf16": torch.bfloat16, "16": torch.float16}.get(self.precision.split("-")[0])
        self.autocast = (lambda: torch.autocast(device, dtype=half)) if half else nullcontext
        self.batch_size = B
        self.times: list[float] = []

    def loss(self):
        return self.lit.losses(self.lit(self.batch), self.batch, depth=bool(self.lit.depth_weight))[0]

    def step(self) -> float:
        import torch

        sync(self.device)
        t0 = time.perf_counter()
        with self.autocast():
            loss = self.loss()
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.lit.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        sync(self.device)
        return time.perf_counter() - t0


class FieryOriginal(Variant):
    """FIERY's own TrainingModule at its baseline config, batch 1, with its Adam and gradient clipping."""

    def __init__(self, root: Path, device: str):
        import torch
        from check_vpq_vs_fiery import stub_lightning

        sys.path.insert(0, str(root))
        stub_lightning()
        sys.modules.setdefault("fiery.utils.visualisation", types.ModuleType("fiery.utils.visualisation"))
        sys.modules["fiery.utils.visualisation"].visualise_output = None  # imported by its trainer, not called
        from efficientnet_pytorch import EfficientNet

        # Random weights instead of its ImageNet download (no network; the step costs the same).
        EfficientNet.from_pretrained = classmethod(lambda cls, name, *args, **kwargs: cls.from_name(name))
        from fiery.config import get_cfg
        from fiery.trainer import TrainingModule

        cfg = get_cfg()
        cfg.merge_from_file(str(root / "fiery" / "configs" / "baseline.yml"))
        cfg.BATCHSIZE = 1
        torch.manual_seed(0)
        self.name, self.device, self.precision, self.batch_size, self.times = "fiery_original", device, "32-true", 1, []
        self.lit = TrainingModule(cfg.convert_to_dict()).train().to(device)
        self.opt = self.lit.configure_optimizers()
        self.clip, self.autocast = cfg.GRAD_NORM_CLIP, nullcontext
        ours = sequence_batch(compose_config(VARIANTS["fiery"]), 1)
        self.batch = {k: v.to(device) for k, v in fiery_batch(ours, cfg).items()}

    def loss(self):
        return sum(self.lit.shared_step(self.batch, True)[2].values())


def fiery_batch(ours: dict, cfg) -> dict:
    """FIERY's batch for ours (sequence_batch at batch 1): the same images and rig, its intrinsics with the
    resize folded in, camera -> ego 4x4 extrinsics, 6-DoF ego motions, labels of every frame (7) at 200x200."""
    import torch

    T_in, T = cfg.TIME_RECEPTIVE_FIELD, cfg.TIME_RECEPTIVE_FIELD + cfg.N_FUTURE_FRAMES
    B, _, N = ours["images"].shape[:3]
    post = torch.eye(3).repeat(B, T_in, N, 1, 1)
    post[..., :2, :2], post[..., :2, 2] = ours["post_rots"][..., :2, :2], ours["post_trans"][..., :2]
    extr = torch.eye(4).repeat(B, T_in, N, 1, 1)
    extr[..., :3, :3], extr[..., :3, 3] = ours["rots"], ours["trans"]
    pad = lambda x: torch.cat([x, x[:, -1:].expand(B, T - T_in, *x.shape[2:])], 1)  # noqa: E731 (unused frames)
    g = torch.Generator().manual_seed(0)
    X = Y = 200
    seg = (torch.rand(B, T, 1, X, Y, generator=g) < 0.05).long()
    vec = torch.where(seg.bool(), torch.randn(B, T, 2, X, Y, generator=g), torch.full((B, T, 2, X, Y), 255.0))
    ego = torch.zeros(B, T, 6)
    ego[..., 0] = 3.0  # 3 m forward per frame
    return {
        "image": pad(ours["images"]),
        "intrinsics": pad(post @ ours["intrinsics"]),
        "extrinsics": pad(extr),
        "future_egomotion": ego,
        "segmentation": seg,
        "instance": seg[:, :, 0],
        "centerness": torch.rand(B, T, 1, X, Y, generator=g),
        "offset": vec,
        "flow": vec,
    }


def main(argv=None) -> int:
    p = step_parser(__doc__, steps=5, warmup=2)
    p.add_argument("--batch-size", type=int, default=None, help="default: the configs' (4)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=EMBEDDED)
    p.add_argument("--fiery", type=Path, default=None, help="a checkout of github.com/wayveai/fiery: its own step too")
    p.add_argument("--site", type=Path, default=None, help="where FIERY's efficientnet_pytorch and fvcore are")
    a = p.parse_args(argv)
    import torch

    if a.fiery and not (a.fiery / "fiery" / "models" / "fiery.py").is_file():
        sys.exit(f"{a.fiery} is not a FIERY checkout (no fiery/models/fiery.py): clone github.com/wayveai/fiery")
    if a.site:
        sys.path.insert(0, str(a.site))
    torch.set_num_threads(a.threads)
    torch.backends.cudnn.benchmark = a.device == "cuda"  # as trainer=gpu
    runs = [Variant(n, VARIANTS[n], a.batch_size, a.device) for n in a.variants]
    runs += [FieryOriginal(a.fiery, a.device)] if a.fiery else []
    for v in runs:
        for _ in range(a.warmup):
            v.step()
    for i in range(a.steps):  # round-robin: load changes hit every variant alike
        for v in runs:
            v.times.append(v.step())
            if a.fiery:  # FIERY's steps take seconds: show each
                print(f"step {i + 1}/{a.steps} {v.name}: {v.times[-1]:.2f} s", flush=True)
    by_name = {v.name: v for v in runs}
    results = {}
    for v in runs:
        med, best = statistics.median(v.times), min(v.times)
        more, shown = {}, ""  # its ratios and frustum size
        static = by_name.get("fiery_static" if v.name.startswith("fiery") else "static")  # its single-frame step
        if static is not None and v.name != "fiery_original":
            more["vs_static"] = round(med / statistics.median(static.times), 3)
            more["vs_static_min"] = round(best / min(static.times), 3)
            shown += f"  {more['vs_static']:.2f}x {static.name}"
        if a.fiery:
            more["speedup_vs_fiery"] = round(statistics.median(by_name["fiery_original"].times) / med, 2)
            shown += f"  {more['speedup_vs_fiery']:.2f}x faster than FIERY's"
        if not isinstance(v, FieryOriginal):  # frustum points per camera and frame: the work the lift and splat do
            more["frustum_points_per_camera_frame"] = v.lit.net.camera.frustum[..., 0].numel()
        results[v.name] = {
            "median_s": round(med, 4),
            "min_s": round(best, 4),
            "steps_s": [round(t, 4) for t in v.times],
            "batch_size": v.batch_size,
            "precision": v.precision,
            **more,
        }
        print(f"{v.name:32s} {med * 1e3:8.1f} ms/step median, {best * 1e3:8.1f} fastest ({v.precision}){shown}")
    report = {
        "script": "scripts/bench_temporal.py",
        "commit": checkout_commit(),
        "device": device_name(a.device),
        "threads": a.threads,
        "steps": a.steps,
        "warmup": a.warmup,
        "host": host_versions(),
        "malloc_env": malloc_env(),
        "variants": results,
    }
    write_report(a.out or RESULTS / f"bench_temporal_{a.device}.json", report)
    return 0


if __name__ == "__main__":
    reexec_with_malloc_env(__file__)
    sys.exit(main())
