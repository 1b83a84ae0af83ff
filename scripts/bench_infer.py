#!/usr/bin/env python
"""Inference latency of one BEV model: PyTorch eager, torch.compile and ONNX Runtime (CPU).

    .venv/bin/python scripts/bench_infer.py [--ckpt RUN_OR_CKPT] [--batch 1] [--rounds 15]

Without --ckpt the model is the embedded default (experiment=synthetic_cpu: lss_small, 6 cameras
of 128x352, 100x100 grid, D=24) with random weights: latency does not depend on the weights.
Variants, all on the same inputs (random images, a ring of 6 cameras):
  eager          the model as trained (native bev_pool splat)
  eager_scatter  eager with the export splat (scatter-add), to separate formulation from runtime
  compile        torch.compile(model) (inductor), compile time reported separately
  onnxruntime    the bev-export ONNX model on ONNX Runtime's CPU provider (same thread count)
After warm-up, every round runs each variant once, in alternating order; the report gives the
median (and min / max) ms per forward. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when run with runpy
from bench_common import host_versions, malloc_env, reexec_with_malloc_env, write_report  # noqa: E402

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no spinning OpenMP threads on a shared machine

import torch  # noqa: E402

from bev.inference import example_inputs, export_onnx, load_model  # noqa: E402


def default_net() -> torch.nn.Module:
    """The embedded default's network (experiment=synthetic_cpu), random weights."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    import bev.data  # noqa: F401 (registers the data config schemas that configs/data names)
    from bev.utils.config import CONFIG_DIR

    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["experiment=synthetic_cpu"])
    return instantiate(cfg.model.net)


def parse_args(argv):
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--ckpt", default=None, help="a checkpoint or run dir (default: synthetic_cpu model, random weights)"
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cameras", type=int, default=6)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--skip", nargs="*", default=[], help="variants to leave out")
    p.add_argument("--out", default="benchmarks/results/bench_infer_cpu.json")
    return p.parse_args(argv)


def compile_variant(net, x, setup_s: dict):
    """torch.compile(net), compiled by one call here (its seconds go to setup_s["compile"])."""
    compiled = torch.compile(net)
    t = time.perf_counter()
    compiled(*x)
    setup_s["compile"] = round(time.perf_counter() - t, 1)
    return lambda: compiled(*x)


def onnxruntime_variant(net, x, folder: Path, setup_s: dict):
    """The bev-export ONNX model (written to `folder`) on ONNX Runtime's CPU provider, torch's thread count."""
    import onnxruntime as ort

    t = time.perf_counter()
    path = export_onnx(net, x, folder / "model.onnx")
    setup_s["onnx_export"] = round(time.perf_counter() - t, 1)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), x)}
    return lambda: torch.from_numpy(session.run(["logits"], feeds)[0])


def build_variants(net, x, skip: list[str], folder: Path) -> tuple[dict, dict]:
    """Every variant not in `skip` as a no-argument forward, and the setup seconds of those that need one."""
    variants, setup_s = {}, {}
    variants["eager"] = lambda: net(*x)

    def scatter():
        """Eager, with the export splat (scatter-add)."""
        with net.exportable():
            return net(*x)

    variants["eager_scatter"] = scatter
    if "compile" not in skip:
        variants["compile"] = compile_variant(net, x, setup_s)
    if "onnxruntime" not in skip:
        variants["onnxruntime"] = onnxruntime_variant(net, x, folder, setup_s)
    for name in skip:
        variants.pop(name, None)
    return variants, setup_s


def time_rounds(variants: dict, warmup: int, rounds: int) -> tuple[dict, float]:
    """ms of each variant per round after `warmup` rounds, and the 1-min load average when timing began."""
    for _ in range(warmup):
        for f in variants.values():
            f()
    times = {k: [] for k in variants}
    names = list(variants)
    load_start = os.getloadavg()[0]
    for r in range(rounds):
        for k in names if r % 2 == 0 else names[::-1]:  # alternate the order: drift hits all alike
            t = time.perf_counter()
            variants[k]()
            times[k].append(1000 * (time.perf_counter() - t))
    return times, load_start


def host(load_start: float) -> dict:
    """CPUs, threads, allocator and OpenMP settings, load at start and end, versions."""
    return {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "malloc_env": malloc_env(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_average_1m_at_start": round(load_start, 2),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        **host_versions(),
        "onnxruntime": sys.modules["onnxruntime"].__version__ if "onnxruntime" in sys.modules else None,
    }


def make_report(a, net, times: dict, max_diff: dict, setup_s: dict, load_start: float) -> dict:
    """The JSON report: model, per-variant statistics, setup times, host."""
    grid = net.grid
    return {
        "what": "ms per forward (no grad), median over rounds; each round runs every variant once, order alternating",
        "model": {
            "checkpoint": a.ckpt or "synthetic_cpu config, random weights",
            "cameras": a.cameras,
            "batch": a.batch,
            "image_size": list(net.image_size),
            "grid_xy": list(grid.bev_shape),
            "depth_bins": grid.depth_bins,
            "params_M": round(sum(p.numel() for p in net.parameters()) / 1e6, 3),
        },
        "results": {
            k: {
                "median_ms": round(statistics.median(v), 2),
                "min_ms": round(min(v), 2),
                "max_ms": round(max(v), 2),
                "max_abs_logit_diff_vs_eager": max_diff[k],
            }
            for k, v in times.items()
        },
        "setup_s": setup_s,
        "rounds": a.rounds,
        "host": host(load_start),
    }


def main(argv=None) -> int:
    """Time every variant on the same inputs, then write and print the report."""
    a = parse_args(argv)
    torch.manual_seed(0)
    net = (load_model(a.ckpt).net if a.ckpt else default_net()).eval()
    x = example_inputs(net, a.cameras, a.batch)
    # The folder holds the exported ONNX model while ONNX Runtime runs it.
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="bench_infer_") as folder:
        expected = net(*x)
        variants, setup_s = build_variants(net, x, a.skip, Path(folder))
        max_diff = {k: float((f() - expected).abs().max()) for k, f in variants.items()}
        times, load_start = time_rounds(variants, a.warmup, a.rounds)
    result = make_report(a, net, times, max_diff, setup_s, load_start)
    write_report(a.out, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    reexec_with_malloc_env(__file__)  # same allocator settings as training (bev.utils.malloc)
    sys.exit(main())
