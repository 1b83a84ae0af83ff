#!/usr/bin/env python
"""Occupancy benchmarks (CPU or GPU), printed and written to benchmarks/results/bench_occupancy_<device>.json:

op     the splat at BEVDet-Occ's occupancy size: 6 cameras 256 x 704 (BEVDet's test crop of the real nuScenes
       rig), stride 16, depth 1-45 m at 0.5 m (88 bins), Occ3D's 200 x 200 x 16 grid, 64 channels, batch 1;
       forward + backward of the fused native bev_pool against index_add_ and LSS's QuickCumsum on the
       materialised depth x feature product (their product is built inside the timed call, as in training),
       median wall time and peak bytes allocated by torch (bench_pool's measures).
model  one training step (forward, loss, backward, AdamW) of the two occupancy models of
       experiment=synthetic_occ_cpu (kind voxel3d and channel_to_height, the same camera encoder and lift),
       alternating within each round, median wall time; random images on the real rig, random labels.

Usage: python scripts/bench_occupancy.py [--section all|op|model] [--repeats N] [--rounds N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common and bench_pool, also when run with runpy
# As bench_pool: passive OpenMP waiting on the shared machines, set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402
from bench_common import checkout_commit, host_versions, processor_name, write_report  # noqa: E402
from bench_pool import index_add_pool, materialise, real_rig_coords  # noqa: E402

import bev.ops as ops  # noqa: E402
from bev.occupancy.grid import occ3d_grid  # noqa: E402
from bev.utils.profiling import peak_cpu_bytes  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OCC_SIZE = dict(batch=1, image=(256, 704), downsample=16, channels=64, grid=occ3d_grid((1.0, 45.0, 0.5)))
OCC_SIZE.update(resize=0.44, crop_top=140)  # BEVDet's test augmentation: 1600 x 900 -> 704 x 396, top 140 rows off


def _pool_methods(coords, grid_shape):
    """name -> fn(depth, feats) -> (B, C, Z, X, Y); the unfused ones build the product in the call."""
    B = coords.shape[0]
    batch = torch.arange(B).view(B, 1, 1, 1, 1, 1).expand(*coords.shape[:5], 1)
    coords4 = torch.cat([batch, coords], -1).reshape(-1, 4)
    return {
        "native bev_pool (fused)": lambda d, f: ops.bev_pool(d, f, coords, grid_shape, backend="native"),
        "index_add_": lambda d, f: index_add_pool(materialise(d, f), coords4, grid_shape),
        "quickcumsum": lambda d, f: ops.voxel_sum(materialise(d, f), coords4, grid_shape, backend="quickcumsum"),
    }


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_op(device, repeats: int) -> dict:
    coords, grid_shape = real_rig_coords(OCC_SIZE, device)
    B, N, D, fH, fW, _ = coords.shape
    g = torch.Generator().manual_seed(0)
    depth = torch.rand(B, N, D, fH, fW, generator=g).softmax(2).to(device)
    feats = torch.randn(B, N, fH, fW, OCC_SIZE["channels"], generator=g).to(device)
    inside = ((coords >= 0) & (coords < torch.tensor(grid_shape[1:], device=device))).all(-1)
    rows = {}
    for name, fn in _pool_methods(coords, grid_shape).items():
        d, f = depth.clone().requires_grad_(), feats.clone().requires_grad_()
        call = functools.partial(_fwd_bwd, fn, d, f)
        times = []
        for i in range(repeats + 1):  # the first call warms up
            d.grad = f.grad = None
            _sync(device)
            t0 = time.perf_counter()
            out = call()
            _sync(device)
            if i:
                times.append(time.perf_counter() - t0)
            del out
        d.grad = f.grad = None
        peak = peak_cpu_bytes(call) if device.type == "cpu" else None
        rows[name] = {"fwd_bwd_ms": 1000 * statistics.median(times), "min_ms": 1000 * min(times), "peak_bytes": peak}
        print(f"  {name:<26} fwd+bwd {rows[name]['fwd_bwd_ms']:9.1f} ms   peak {_mb(peak)}", flush=True)
    ref = rows["native bev_pool (fused)"]["fwd_bwd_ms"]
    for row in rows.values():
        row["vs_native"] = row["fwd_bwd_ms"] / ref
    points = int(coords[..., 0].numel())
    return {
        "size": {
            **{k: v for k, v in OCC_SIZE.items() if k != "grid"},
            "grid": {k: list(getattr(OCC_SIZE["grid"], k)) for k in ("xbound", "ybound", "zbound", "dbound")},
        },
        "points": points,
        "points_inside": int(inside.sum()),
        "methods": rows,
    }


def _fwd_bwd(fn, d: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    out = fn(d, f)
    out.backward(torch.ones_like(out))
    return out


def _mb(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:8.1f} MB"


def _model_step(kind: str, device):
    """(step function, its module) of experiment=synthetic_occ_cpu's model with occupancy.kind = kind."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from bev.inference import example_inputs
    from bev.occupancy.grid import NUM_CLASSES, OCC_SHAPE
    from bev.utils.config import CONFIG_DIR

    overrides = ["experiment=synthetic_occ_cpu", f"model.net.occupancy.kind={kind}", "model.depth_weight=0"]
    # Both kinds on the one lift the comparison is of: 8 height bins of 16 channels, 2 m depth bins from 2 to 46 m.
    overrides += ["grid.zbound=[-1.0,5.4,0.8]", "grid.dbound=[2.0,46.0,2.0]", "model.net.context_channels=16"]
    overrides += ["model.net.camera.channels_last=false", "model.net.bev.channels_last=false", "trainer.precision=32"]
    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    module = instantiate(cfg.model).to(device)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    inputs = [t.to(device) for t in example_inputs(module.net, 6, 1)]
    sem = torch.randint(0, NUM_CLASSES, (1, *OCC_SHAPE), generator=g).to(torch.uint8).to(device)
    mask = (torch.rand(1, *OCC_SHAPE, generator=g) < 0.4).to(device)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = module.occ_loss.total(module.occ_loss(module.net(*inputs), sem, mask))
        loss.backward()
        opt.step()
        _sync(device)

    return step, module


def bench_model(device, rounds: int) -> dict:
    kinds = ("voxel3d", "channel_to_height")
    steps = {k: _model_step(k, device) for k in kinds}
    times = {k: [] for k in kinds}
    for k in kinds:
        steps[k][0]()  # warm-up
    for _ in range(rounds):
        for k in kinds:  # alternating: both see the same load
            t0 = time.perf_counter()
            steps[k][0]()
            times[k].append(time.perf_counter() - t0)
    out = {}
    for k in kinds:
        n = sum(p.numel() for p in steps[k][1].net.parameters())
        out[k] = {"step_ms": 1000 * statistics.median(times[k]), "min_ms": 1000 * min(times[k]), "parameters": n}
        print(f"  {k:<18} step {out[k]['step_ms']:8.1f} ms (min {out[k]['min_ms']:.1f})  {n / 1e6:.2f} M parameters")
    out["config"] = "experiment=synthetic_occ_cpu (128x352, lift 0.8 m x 8 height bins, 16 channels), batch 1, fp32"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--section", choices=("all", "op", "model"), default="all")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    report = {
        "host": {**host_versions(), "processor": processor_name(), "threads": torch.get_num_threads()},
        "load_average_at_start": os.getloadavg()[0],  # the machines are shared: what else was running
        "commit": checkout_commit(),
    }
    if args.section in ("all", "op"):
        print("The splat at occupancy size (forward + backward):", flush=True)
        report["op"] = bench_op(device, args.repeats)
    if args.section in ("all", "model"):
        print("One training step of the two occupancy models:", flush=True)
        report["model"] = bench_model(device, args.rounds)
    report["load_average_at_end"] = os.getloadavg()[0]
    out = REPO / "benchmarks" / "results" / f"bench_occupancy_{args.device}.json"
    write_report(out, report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
