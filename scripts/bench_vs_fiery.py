#!/usr/bin/env python
"""The training step at FIERY's baseline setting: FIERY's own model against this project's, in one run.

    .venv/bin/python scripts/bench_vs_fiery.py --fiery /tmp/fiery [--site /tmp/fiery_site] [--steps 3] [--stride8]

--fiery is a checkout of github.com/wayveai/fiery, loaded from there as it is (never copied into this
project); it needs efficientnet_pytorch and fvcore (pip install --target DIR efficientnet_pytorch fvcore yacs
iopath portalocker termcolor tabulate; pass DIR as --site); the pytorch_lightning 1.2 names its trainer
imports are stood in for, in this process only. The setting: FIERY's configs/baseline.yml at batch 1
(3 frames x 6 cameras of 224x480, a 200x200 grid of 0.5 m, 4 future frames). FIERY's step is its
TrainingModule.shared_step + backward + clipping + Adam in fp32; ours is experiment=fiery_nuscenes as
bev-train runs it here (scripts/bench_temporal.py; --ours-fp32 also in fp32), and with --stride8 also at
equal work (model.net.camera.downsample=8: as many frustum points as FIERY's). Random inputs with the real rig;
variants alternate round-robin; medians of the measured steps. Writes JSON to --out atomically.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import checkout_commit, host_versions, processor_name, write_report  # noqa: E402
from bench_temporal import VARIANTS, Variant  # noqa: E402

# FIERY's encoder (fiery/models/encoder.py, DOWNSAMPLE 8): stride-16 features upsampled into stride 8, 128 channels.
STRIDE8 = ["model.net.camera.downsample=8", "model.net.camera.mid_channels=128"]


def _stand_in_lightning() -> None:
    """pytorch_lightning 1.2's names that FIERY's trainer and metrics import, as plain stand-ins."""
    from check_vpq_vs_fiery import _stub_lightning

    _stub_lightning()
    pl = sys.modules["pytorch_lightning"]

    class LightningModule(torch.nn.Module):
        pass

    pl.LightningModule = LightningModule
    pl.metrics = sys.modules["pytorch_lightning.metrics"]


class FieryStep:
    """FIERY's TrainingModule at its baseline config, batch 1, with its Adam and gradient clipping."""

    name = "fiery_original"

    def __init__(self, root: Path, batch: dict, device: str = "cpu"):
        sys.path.insert(0, str(root))
        _stand_in_lightning()
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
        self.module = TrainingModule(cfg.convert_to_dict()).train().to(device)
        self.opt = self.module.configure_optimizers()
        self.clip = cfg.GRAD_NORM_CLIP
        self.batch = {k: v.to(device) for k, v in fiery_batch(batch, cfg).items()}
        self.device = device
        self.precision = "32-true"
        self.batch_size = 1
        self.times: list[float] = []

    def step(self) -> float:
        self.sync()
        t0 = time.perf_counter()
        _, _, loss = self.module.shared_step(self.batch, True)
        sum(loss.values()).backward()
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync()
        return time.perf_counter() - t0

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def fiery_batch(ours: dict, cfg) -> dict:
    """FIERY's batch for ours (bench_temporal.sequence_batch at batch 1): the same images and rig, its
    intrinsics with the resize folded in, camera -> ego 4x4 extrinsics, 6-DoF ego motions, labels of
    every frame (7) at 200x200."""
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fiery", type=Path, required=True, help="a checkout of github.com/wayveai/fiery")
    p.add_argument("--site", type=Path, default=None, help="where efficientnet_pytorch and fvcore are installed")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ours-fp32", action="store_true", help="also this project's step in fp32")
    p.add_argument("--stride8", action="store_true", help="also this project's step at FIERY's stride 8 (equal work)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bench_vs_fiery_cpu.json"))
    a = p.parse_args(argv)
    if not (a.fiery / "fiery" / "models" / "fiery.py").is_file():
        raise SystemExit(
            f"{a.fiery} is not a FIERY checkout (no fiery/models/fiery.py): clone github.com/wayveai/fiery"
        )
    if a.site:
        sys.path.insert(0, str(a.site))
    torch.set_num_threads(a.threads)
    runs = [Variant("ours", VARIANTS["fiery"], None, a.device)]
    if a.ours_fp32:
        runs.append(Variant("ours_fp32", [*VARIANTS["fiery"], "trainer.precision=32-true"], None, a.device))
    if a.stride8:
        runs.append(Variant("ours_stride8", [*VARIANTS["fiery"], *STRIDE8], None, a.device))
    from bench_temporal import sequence_batch

    runs.append(FieryStep(a.fiery, sequence_batch(_fiery_cfg(), 1), a.device))
    for v in runs:
        for _ in range(a.warmup):
            v.step()
    for i in range(a.steps):
        for v in runs:
            v.times.append(v.step())
            print(f"step {i + 1}/{a.steps} {v.name}: {v.times[-1]:.2f} s", flush=True)
    fiery = statistics.median(runs[-1].times)
    results = {}
    for v in runs:
        med = statistics.median(v.times)
        results[v.name] = {
            "median_s": round(med, 3),
            "min_s": round(min(v.times), 3),
            "steps_s": [round(t, 3) for t in v.times],
            "precision": v.precision,
            "speedup_vs_fiery": round(fiery / med, 2),
        }
        if hasattr(v, "lit"):  # frustum points per sample: the work the lift and splat do
            frustum = v.lit.net.frustum
            results[v.name]["frustum_points_per_camera_frame"] = frustum[..., 0].numel()
        print(f"{v.name:16s} {med:7.2f} s/step median ({v.precision}): {fiery / med:.2f}x FIERY's")
    write_report(
        a.out,
        {
            "script": "scripts/bench_vs_fiery.py",
            "commit": checkout_commit(),
            "device": torch.cuda.get_device_name() if a.device == "cuda" else processor_name(),
            "threads": a.threads,
            "steps": a.steps,
            "warmup": a.warmup,
            "host": {**host_versions(), "processor": processor_name()},
            "variants": results,
        },
    )
    print(f"wrote {a.out}")
    return 0


def _fiery_cfg():
    from bench_train import compose_config

    return compose_config(VARIANTS["fiery"])


if __name__ == "__main__":
    sys.exit(main())
