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
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bev.utils.malloc import MALLOC_ENV

# Same allocator settings as training (bev.utils.malloc); glibc reads them only at start-up, so re-exec once.
if (sys.platform.startswith("linux") and os.environ.get("BEV_MALLOC_TUNING", "1") != "0"
        and not all(k in os.environ for k in MALLOC_ENV)):
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], {**MALLOC_ENV, **os.environ})
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no spinning OpenMP threads on a shared machine

import torch  # noqa: E402

from bev.inference import example_inputs, export_onnx, load_model  # noqa: E402
from bev.utils.io import atomic_write  # noqa: E402


def default_net() -> torch.nn.Module:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from bev.utils.config import CONFIG_DIR

    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["experiment=synthetic_cpu"])
    return instantiate(cfg.model.net)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=None, help="a checkpoint or run dir (default: synthetic_cpu model, random weights)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cameras", type=int, default=6)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--skip", nargs="*", default=[], help="variants to leave out")
    p.add_argument("--out", default="benchmarks/results/bench_infer_cpu.json")
    a = p.parse_args(argv)

    torch.manual_seed(0)
    net = (load_model(a.ckpt).net if a.ckpt else default_net()).eval()
    x = example_inputs(net, a.cameras, a.batch)
    variants, setup_s = {}, {}
    with torch.no_grad():
        expected = net(*x)
        variants["eager"] = lambda: net(*x)

        def scatter():
            with net.exportable():
                return net(*x)
        variants["eager_scatter"] = scatter
        if "compile" not in a.skip:
            compiled = torch.compile(net)
            t = time.perf_counter()
            compiled(*x)
            setup_s["compile"] = round(time.perf_counter() - t, 1)
            variants["compile"] = lambda: compiled(*x)
        if "onnxruntime" not in a.skip:
            import onnxruntime as ort

            tmp = tempfile.TemporaryDirectory(prefix="bench_infer_")
            t = time.perf_counter()
            path = export_onnx(net, x, Path(tmp.name) / "model.onnx")
            setup_s["onnx_export"] = round(time.perf_counter() - t, 1)
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = torch.get_num_threads()
            session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
            feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), x)}
            variants["onnxruntime"] = lambda: torch.from_numpy(session.run(["logits"], feeds)[0])
        for name in a.skip:
            variants.pop(name, None)

        max_diff = {k: float((f() - expected).abs().max()) for k, f in variants.items()}
        for _ in range(a.warmup):
            for f in variants.values():
                f()
        times = {k: [] for k in variants}
        names = list(variants)
        load_start = os.getloadavg()[0]
        for r in range(a.rounds):
            for k in (names if r % 2 == 0 else names[::-1]):  # alternate the order: drift hits all alike
                t = time.perf_counter()
                variants[k]()
                times[k].append(1000 * (time.perf_counter() - t))

    grid = net.grid
    report = {
        "what": "ms per forward (no grad), median over rounds; each round runs every variant once, order alternating",
        "model": {"checkpoint": a.ckpt or "synthetic_cpu config, random weights", "cameras": a.cameras, "batch": a.batch,
                  "image_size": list(net.image_size), "grid_xy": list(grid.bev_shape), "depth_bins": grid.depth_bins,
                  "params_M": round(sum(p.numel() for p in net.parameters()) / 1e6, 3)},
        "results": {k: {"median_ms": round(statistics.median(v), 2), "min_ms": round(min(v), 2), "max_ms": round(max(v), 2),
                        "max_abs_logit_diff_vs_eager": max_diff[k]} for k, v in times.items()},
        "setup_s": setup_s,
        "rounds": a.rounds,
        "host": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                 "malloc_env": {k: os.environ.get(k) for k in MALLOC_ENV}, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                 "load_average_1m_at_start": round(load_start, 2), "load_average_1m_at_end": round(os.getloadavg()[0], 2),
                 "python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
                 "onnxruntime": sys.modules["onnxruntime"].__version__ if "onnxruntime" in sys.modules else None},
    }
    atomic_write(a.out, json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
