#!/usr/bin/env python
"""Training-step benchmark: forward + loss + backward + gradient clipping + optimiser step.

    .venv/bin/python scripts/bench_train.py [--configs paper embedded embedded_det] [--variants fp32 ...]

Models are built from the Hydra configs as bev-train builds them: "paper" is experiment=lss_nuscenes_trainval
(random init), "embedded" experiment=synthetic_cpu, "embedded_det" the same with the detection head,
"embedded_fusion" / "embedded_lidar" with the LiDAR branch; inputs are random images with the real nuScenes rig
and the LSS validation crop, and random points in the grid. Variants (layout, bf16 autocast,
torch.compile mode, CUDA graphs on a GPU) alternate round-robin in one process from the same initial weights;
medians over --steps steps after --warmup steps (the first compiles). --lss adds lift-splat-shoot's own step
from a checkout; --profile N profiles N more steps of each variant. Writes JSON to --out atomically.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))  # bench_common, also when run with runpy

from bench_common import (  # noqa: E402
    RESULTS,
    device_name,
    host_versions,
    malloc_env,
    reexec_with_malloc_env,
    step_parser,
    sync,
    write_report,
)

from bev.utils.profiling import matmul_rate, op_family  # noqa: E402

CONFIGS = {
    "paper": ["experiment=lss_nuscenes_trainval", "model.net.camera.weights=null", "trainer=cpu"],
    "embedded": ["experiment=synthetic_cpu"],
    "embedded_det": ["experiment=synthetic_det_cpu"],  # the same with the detection head (its step cost)
    "embedded_fusion": ["experiment=synthetic_fusion_cpu"],  # and the LiDAR branch and fuser
    "embedded_lidar": ["experiment=synthetic_lidar_cpu"],  # the LiDAR branch without the cameras
}
DEVICE = "cpu"  # --device; on cuda every timing waits for the GPU (synchronize) before reading the clock
LSS_ROOT = None  # --lss: a lift-splat-shoot checkout, whose own step joins the paper config as "lss_original"


def clock(wait: bool = True) -> float:
    """perf_counter after the device's queued work is done (wait=False: at once, as a trainer runs)."""
    if wait:
        sync(DEVICE)
    return time.perf_counter()


# name -> (channels_last, bf16 autocast, torch.compile mode or None for eager).
# "reduce-overhead" replays the compiled forward and backward as CUDA graphs, which removes the host's
# launches that bound the paper config's GPU step at batch 4.
VARIANTS = {
    "fp32": (False, False, None),
    "channels_last": (True, False, None),
    "bf16": (False, True, None),
    "channels_last+bf16": (True, True, None),
    "compile": (False, False, "default"),
    "compile+channels_last": (True, False, "default"),
    "compile+channels_last+bf16": (True, True, "default"),
    "cudagraphs+channels_last": (True, False, "reduce-overhead"),
    "cudagraphs+channels_last+bf16": (True, True, "reduce-overhead"),
}
PARTS = ("forward", "loss", "backward", "optimizer")


def compose_config(overrides: list[str]):
    """The `train` config with `overrides`, composed as bev-train composes it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    import bev.data  # noqa: F401 (registers the data config schemas that configs/data names)
    from bev.utils.config import CONFIG_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, "hydra.run.dir=/tmp/bench_train"], return_hydra_config=True)
    HydraConfig().set_config(cfg)  # resolves ${hydra:...} interpolations as in a real run
    return cfg


def build(cfg, channels_last: bool, seed: int = 0):
    """The LightningModule of cfg.model with every convolutional encoder in the requested layout."""
    import torch
    from hydra.utils import instantiate

    torch.manual_seed(seed)  # same initial weights for every variant
    model_cfg = cfg.model.copy()
    for part in (model_cfg.net.camera, model_cfg.net.decoder):
        if part is not None:  # a LiDAR-only model has no camera branch
            part.channels_last = channels_last
    return instantiate(model_cfg)


def real_rig_batch(cfg, batch_size: int, seed: int = 0) -> dict:
    """Random images and BEV targets with the real rig's calibration and the LSS validation crop."""
    import numpy as np
    import torch

    from bev.data.rig import IMAGE_H, IMAGE_W, load_rig
    from bev.data.transforms import sample_augmentation
    from bev.geometry import Grid, quaternion_to_matrix

    rig = load_rig()
    cams = [rig["cameras"][n] for n in rig["camera_order"]]
    H, W = (int(s) for s in cfg.data.final_dim)
    post_rot, post_tran = sample_augmentation((IMAGE_H, IMAGE_W), (H, W), train=False).post_rot_tran()
    g = torch.Generator().manual_seed(seed)
    B, N = batch_size, len(cams)
    grid = Grid.from_any(cfg.grid)
    X, Y = grid.voxel_shape[1:]

    def rep(t):
        """The per-camera values repeated for every sample of the batch."""
        return torch.as_tensor(np.asarray(t), dtype=torch.float32).expand(B, N, *np.shape(t)[1:]).clone()

    return {
        "images": torch.randn(B, N, 3, H, W, generator=g),
        "intrinsics": rep([c["camera_intrinsic"] for c in cams]),
        "rots": rep(np.stack([quaternion_to_matrix(c["rotation"]) for c in cams])),
        "trans": rep([c["translation"] for c in cams]),
        "post_rots": rep(post_rot[None].numpy()),
        "post_trans": rep(post_tran[None].numpy()),
        "bev": (torch.rand(B, int(cfg.model.net.heads.segmentation.num_classes), X, Y, generator=g) < 0.05).float(),
        **(detection_targets(grid, B, seed) if cfg.data.get("detection") else {}),
        **(lidar_points(grid, B, g) if (cfg.data.get("lidar") or {}).get("enabled") else {}),
    }


def lidar_points(grid, batch_size: int, g, per_sample: int = 31_000) -> dict:
    """Points spread over the grid, as many per sample as a key frame of make train's set has, batched flat as
    bev.data.lidar.collate_points does: rows (b, x, y, z, intensity, time lag)."""
    import torch

    bounds = torch.tensor([grid.xbound[:2], grid.ybound[:2], grid.zbound[:2]], dtype=torch.float32)
    xyz = bounds[:, 0] + torch.rand(batch_size * per_sample, 3, generator=g) * (bounds[:, 1] - bounds[:, 0])
    b = torch.arange(batch_size).repeat_interleave(per_sample)[:, None].float()
    rows = torch.cat([b, xyz, 255 * torch.rand(len(b), 1, generator=g), torch.zeros(len(b), 1)], 1)
    return {"points": rows, "num_points": torch.full((batch_size,), per_sample)}


def detection_targets(grid, batch_size: int, seed: int, boxes_per_sample: int = 40) -> dict:
    """CenterPoint targets of random car-sized boxes of every class, as data.detection=true items carry."""
    import numpy as np
    import torch

    from bev.classes import DETECTION_CLASSES
    from bev.tasks.detection.targets import encode_targets

    rng, samples = np.random.default_rng(seed), []
    for _ in range(batch_size):
        n = boxes_per_sample
        boxes = np.zeros((n, 9), np.float32)
        boxes[:, 0] = rng.uniform(grid.xbound[0], grid.xbound[1], n)
        boxes[:, 1] = rng.uniform(grid.ybound[0], grid.ybound[1], n)
        boxes[:, 3:6] = (1.9, 4.5, 1.6)
        boxes[:, 6] = rng.uniform(-np.pi, np.pi, n)
        samples.append(encode_targets(boxes, np.arange(n) % len(DETECTION_CLASSES), grid))
    return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}


class Variant:
    """One variant's model, optimiser and measurements."""

    def __init__(self, cfg, name: str, batch: dict):
        """Build the model of cfg in the variant's layout and precision (compiled if asked) and its optimiser."""
        import torch

        channels_last, bf16, self.compiled = VARIANTS[name]  # compiled: the compile mode or None
        self.lit = build(cfg, channels_last).to(DEVICE).train()
        if self.compiled:
            self.lit.net.compile(mode=self.compiled, fullgraph=True)  # as model.compile does (bev.lit)
        self.opt = self.lit.make_optimizer()
        self.autocast = (lambda: torch.autocast(DEVICE, dtype=torch.bfloat16)) if bf16 else nullcontext
        self.start(name, batch, cfg.trainer.get("gradient_clip_val"))

    def start(self, name: str, batch: dict, clip: float | None) -> None:
        """The state every variant's steps keep, before its first step."""
        self.name, self.batch, self.clip = name, batch, clip
        self.times: list[float] = []
        self.breakdown: list[dict[str, float]] = []
        self.first_step_s: float | None = None
        self.wait = True  # False while profiled: no clock may wait for the GPU inside a step

    def forward(self):
        return self.lit(self.batch)

    def loss(self, out):
        return self.lit.losses(out, self.batch)[0]

    def step(self) -> float:
        """One training step as Lightning runs it (autocast around forward + loss); returns seconds."""
        import torch

        t0 = clock(self.wait)
        if self.compiled == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # a new iteration: the last step's graph outputs are dead
        with self.autocast():
            out = self.forward()
            t1 = clock(self.wait)
            loss = self.loss(out)
        t2 = clock(self.wait)
        loss.backward()
        t3 = clock(self.wait)
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.lit.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t4 = clock(self.wait)
        self.last_breakdown = dict(forward=t1 - t0, loss=t2 - t1, backward=t3 - t2, optimizer=t4 - t3)
        return t4 - t0

    def profile(self, steps: int) -> dict:
        """torch.profiler over `steps` steps with no waiting inside them: wall and GPU kernel time per
        step, kernel launches per step, and the ops with the most self time (GPU time on a GPU)."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
        self.wait = False
        try:
            with profile(activities=acts) as prof:
                t0 = clock()
                for _ in range(steps):
                    self.step()
                wall = (clock() - t0) / steps
        finally:
            self.wait = True
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

        def self_ms(e):
            """Self time of a key average per step: on the GPU where there is one, else on the CPU."""
            us = e.self_device_time_total if kernels else e.self_cpu_time_total
            return us / steps / 1e3

        averages = prof.key_averages()
        top = sorted(averages, key=self_ms, reverse=True)[:10]
        families: dict[str, float] = {}
        for e in averages:
            family = op_family(e.key)
            families[family] = families.get(family, 0.0) + self_ms(e)
        return {
            "wall_ms": round(wall * 1e3, 2),
            "steps": steps,
            "gpu_kernel_ms": round(sum(e.device_time for e in kernels) / steps / 1e3, 2) if kernels else None,
            "kernels_per_step": round(len(kernels) / steps) if kernels else None,
            "top_self_ms": {e.key: round(self_ms(e), 3) for e in top},
            "families_ms": {k: round(v, 2) for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
        }


class LssOriginal(Variant):
    """lift-splat-shoot's own training step, its code loaded from a checkout as it is (src/train.py: its
    model, SimpleLoss with pos_weight 2.13, Adam 1e-3 / 1e-7, gradient clipping 5), in fp32 as it runs,
    on the same batch and rig as the project's variants. Random weights instead of its ImageNet download."""

    def __init__(self, cfg, name: str, batch: dict):
        import torch

        src = types.ModuleType("src")  # its package without its __init__, which imports its trainer's tools
        src.__path__ = [str(LSS_ROOT / "src")]
        sys.modules["src"] = src
        from efficientnet_pytorch import EfficientNet

        EfficientNet.from_pretrained = classmethod(lambda cls, arch, *args, **kwargs: cls.from_name(arch))
        from src.models import compile_model
        from src.tools import SimpleLoss

        grid = {k: list(cfg.grid[k]) for k in ("xbound", "ybound", "zbound", "dbound")}
        torch.manual_seed(0)
        self.compiled, self.autocast = None, nullcontext
        self.lit = compile_model(grid, {"final_dim": tuple(cfg.data.final_dim)}, outC=1).to(DEVICE).train()
        self.loss_fn = SimpleLoss(2.13).to(DEVICE)
        self.opt = torch.optim.Adam(self.lit.parameters(), lr=1e-3, weight_decay=1e-7)
        self.start(name, batch, clip=5.0)

    def forward(self):
        b = self.batch
        return self.lit(b["images"], b["rots"], b["trans"], b["intrinsics"], b["post_rots"], b["post_trans"])

    def loss(self, out):
        return self.loss_fn(out, self.batch["bev"][:, :1])


def step_flops(cfg, batch: dict) -> int:
    """Floating-point operations of one training step of cfg's model on the batch: 2 per multiply-add of every
    convolution and linear layer in the forward (nearly all of the step's arithmetic), and as many again in the
    backward for each weight gradient and for each input gradient a layer needs; counted from one forward.
    (torch's FlopCounterMode overcounts the backward of grouped and strided convolutions: 1551 GFLOP for the
    paper step's 906.)"""
    import torch
    from torch import nn

    lit = build(cfg, channels_last=False).to(DEVICE)
    step = 0

    def count(layer, args, out):
        nonlocal step
        if isinstance(layer, nn.Conv2d):
            per_output = layer.in_channels // layer.groups * layer.kernel_size[0] * layer.kernel_size[1]
        else:
            per_output = layer.in_features
        step += 2 * out.numel() * per_output * (1 + layer.weight.requires_grad + args[0].requires_grad)

    hooks = [m.register_forward_hook(count) for m in lit.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    try:
        with torch.enable_grad():
            lit(batch)
    finally:
        for h in hooks:
            h.remove()
    return step


def bench_config(
    key: str, variants: list[str], steps: int, warmup: int, progress, extra: list[str] = (), profile: int = 0
) -> dict:
    """Every variant of one config (plus `extra` overrides) on the same batch: its shape and each variant's
    record (with `profile` > 0, also a torch.profiler summary over that many steps)."""
    import torch

    overrides = [*CONFIGS[key], *extra]
    cfg = compose_config(overrides)
    batch = {k: v.to(DEVICE) for k, v in real_rig_batch(cfg, int(cfg.data.batch_size)).items()}
    flops = step_flops(cfg, batch)
    runs = []
    for name in variants:  # each built and warmed up; a failure is kept in .error, not raised
        v = (LssOriginal if name == "lss_original" else Variant)(cfg, name, batch)
        try:
            v.first_step_s = v.step()  # includes compilation for the compiled variants
            for _ in range(warmup - 1):
                v.step()
            v.error = None
        except Exception as e:  # a variant that cannot run here is reported, not fatal
            v.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            print(f"[{key}] {name}: failed: {v.error}", file=sys.stderr)
        runs.append(v)
        progress.update(1)
    for _ in range(steps):  # round-robin, so load changes hit every variant alike
        for v in runs:
            if v.error is None:
                v.times.append(v.step())
                v.breakdown.append(v.last_breakdown)
        progress.update(1)
    profiles = {v.name: v.profile(profile) for v in runs if profile and v.error is None}
    fp32 = [v for v in runs if v.name == "fp32" and v.error is None]
    base = statistics.median(fp32[0].times) if fp32 else None  # no fp32 run (--variants): no speed-up to report
    out = {
        "overrides": overrides,
        "batch_size": int(cfg.data.batch_size),
        "final_dim": list(cfg.data.final_dim),
        "grid": {k: list(cfg.grid[k]) for k in ("xbound", "ybound", "zbound", "dbound")},
        "camera_backbone": (cfg.model.net.camera or {}).get("backbone"),
        "parameters": sum(p.numel() for p in runs[0].lit.parameters()),
        "gflop_per_step": round(flops / 1e9, 1),
        "variants": {},
    }
    for v in runs:  # each variant's error, or its median step, samples/s, speed-up, arithmetic rate, part medians
        if v.error:
            out["variants"][v.name] = {"error": v.error}
        else:
            med = statistics.median(v.times)
            out["variants"][v.name] = dict(
                step_s=round(med, 4),
                steps_s=[round(x, 4) for x in v.times],
                samples_per_s=round(out["batch_size"] / med, 2),
                speedup_vs_fp32=round(base / med, 2) if base else None,
                first_step_s=round(v.first_step_s, 2),
                gflop_per_s=round(flops / med / 1e9, 1),
                breakdown_s={k: round(statistics.median([b[k] for b in v.breakdown]), 4) for k in PARTS},
            )
        if v.name in profiles:
            out["variants"][v.name]["profile"] = profiles[v.name]
        del v.lit, v.opt  # free the models before the next config builds its own
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def print_table(results: dict) -> None:
    """Per config: one line per variant with its step time, speed-up, arithmetic rate and part breakdown, and
    where profiled its wall vs kernel time per step, launches and top ops."""
    for key, r in results["configs"].items():
        print(
            f"\n{key}: {' '.join(r['overrides'])}  (batch {r['batch_size']}, {r['final_dim'][0]}x{r['final_dim'][1]}, "
            f"{r['parameters'] / 1e6:.1f} M parameters, {r['gflop_per_step']:.0f} GFLOP per step)"
        )
        print(
            f"  {'variant':28s} {'step s':>8s} {'speedup':>8s} {'GFLOP/s':>8s} {'1st step':>9s}  "
            + " ".join(f"{c:>10s}" for c in PARTS)
        )
        for name, v in r["variants"].items():
            if "error" in v:
                print(f"  {name:28s} failed: {v['error']}")
                continue
            parts = " ".join(f"{v['breakdown_s'][c]:10.3f}" for c in PARTS)
            print(
                f"  {name:28s} {v['step_s']:8.3f} {v['speedup_vs_fp32'] or 0:7.2f}x {v['gflop_per_s']:8.1f} "
                f"{v['first_step_s']:9.1f}  {parts}"
            )
            if pr := v.get("profile"):
                gpu = ""
                if pr["gpu_kernel_ms"]:
                    gpu = f", GPU kernels {pr['gpu_kernel_ms']:.1f} ms ({pr['kernels_per_step']} launches)"
                top = ", ".join(f"{k} {ms:.1f}" for k, ms in list(pr["top_self_ms"].items())[:5])
                print(f"    profiled: {pr['wall_ms']:.1f} ms per step{gpu}; most self time: {top}")
                print("    by family (ms): " + ", ".join(f"{k} {ms:.1f}" for k, ms in pr["families_ms"].items()))
    host = results["host"]
    print(f"\nload average (1 min) at start {host['load_average_1m_start']}, at end {host['load_average_1m_end']}")


def parse_args(argv):
    """The command line (see the module docstring)."""
    p = step_parser(__doc__, steps=3, warmup=1)
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=None,
        help="default: all the device runs (the paper config's bf16 ones only on CPUs with native bf16)",
    )
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="the compiled variants")
    p.add_argument("--batch-size", type=int, default=None, help="instead of the configs' batch size")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="then profile N more steps of each variant")
    p.add_argument("--lss", type=Path, default=None, help="a lift-splat-shoot checkout: its own step as lss_original")
    p.add_argument("--override", nargs="+", default=[], metavar="KEY=VALUE", help="Hydra overrides for every config")
    a = p.parse_args(argv)
    a.out = a.out or RESULTS / f"bench_train_{a.device}.json"
    return a


def variants_to_run(a) -> dict[str, list[str]]:
    """Each config's variants: --variants, else all the device runs (no CUDA graphs on a CPU, no emulated bf16 at
    the paper size: minutes per step), less the compiled ones with --no-compile."""
    from bev.utils.precision import cpu_bf16_support

    on_cpu, bf16 = a.device == "cpu", cpu_bf16_support()
    variants = {}
    for key in a.configs:
        names = a.variants or [
            v
            for v, (_, b, mode) in VARIANTS.items()
            if not on_cpu or (mode != "reduce-overhead" and (bf16 or not b or key != "paper"))
        ]
        variants[key] = [v for v in names if a.compile or not VARIANTS[v][2]]
    if a.lss and "paper" in variants:
        variants["paper"].append("lss_original")
    return variants


def main(argv=None) -> int:
    """Time every config's variants, then write the report and print its table."""
    global DEVICE, LSS_ROOT
    a = parse_args(argv)
    DEVICE = a.device
    LSS_ROOT = a.lss
    variants = variants_to_run(a)

    import torch
    from tqdm import tqdm

    from bev.utils.precision import cpu_bf16_support

    torch.set_num_threads(a.threads)
    torch.backends.cudnn.benchmark = a.device == "cuda"  # as trainer=gpu
    load0 = os.getloadavg()[0]
    extra = [f"data.batch_size={a.batch_size}"] if a.batch_size else []
    extra += a.override
    with tqdm(total=sum(len(v) + a.steps for v in variants.values()), desc="bench_train", file=sys.stderr) as bar:
        configs = {key: bench_config(key, variants[key], a.steps, a.warmup, bar, extra, a.profile) for key in a.configs}
    rates = {"fp32": matmul_rate(torch.float32, DEVICE)}
    if a.device == "cuda" or cpu_bf16_support():
        rates["bf16"] = matmul_rate(torch.bfloat16, DEVICE)
    for r in configs.values():  # each variant's arithmetic rate as a share of the matrix product's in its precision
        for name, v in r["variants"].items():
            rate = rates.get("bf16" if "bf16" in name else "fp32")
            if "gflop_per_s" in v and rate:
                v["of_matmul_rate"] = round(v["gflop_per_s"] / rate, 3)
    results = {
        "benchmark": f"training step (forward, loss, backward, clip, optimiser step), {a.device}",
        "device": device_name(a.device),
        "steps": a.steps,
        "warmup": a.warmup,
        "threads": a.threads,
        "matmul_gflop_per_s": rates,
        "configs": configs,
        "host": {  # CPUs and their bf16 / vector capability, load at start and end, allocator settings, versions
            "cpus": os.cpu_count(),
            "cpu_bf16": cpu_bf16_support(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "load_average_1m_start": round(load0, 2),
            "load_average_1m_end": round(os.getloadavg()[0], 2),
            "malloc_env": malloc_env(),
            **host_versions(),
        },
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print_table(results)
    write_report(a.out, results)
    return 0


if __name__ == "__main__":
    reexec_with_malloc_env(__file__)  # same allocator settings as bev-train
    sys.exit(main())
