"""The camera trunk's fast layers (bev.models.fast_layers) against the layers they replace.

    .venv/bin/python scripts/bench_fast_layers.py [--rounds 5] [--steps 4] [--out FILE]

1. Layers: every swapped depthwise convolution and squeeze-excitation block of the paper config's
   EfficientNet-B0 trunk, at its own input size (24 images of 128x352: batch 4 x 6 cameras),
   forward + backward, the replaced layer and the fast one alternated, medians of --rounds:
   depthwise convolutions in channels_last + bf16 autocast (where FP32GradDepthwiseConv2d acts),
   squeeze-excitation in that and in fp32 NCHW (GlobalAvgPool acts in both).
2. Training step: bench_train's paper config, variants fp32 and channels_last+bf16, each with the
   fast layers and with the plain ones (the swaps undone on the same initial weights), alternated
   step by step, medians of --steps: what the layers change for a user, and the bf16 speedup over
   fp32 with and without them.
Writes JSON to --out atomically (default benchmarks/results/bench_fast_layers_cpu.json).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train as bt  # noqa: E402
from bench_common import write_report  # noqa: E402


def plain_layers(module):
    """The module with bev.models.fast_layers' swaps undone (in place): plain Conv2d and AdaptiveAvgPool2d."""
    from torch import nn

    from bev.models.fast_layers import FP32GradDepthwiseConv2d, GlobalAvgPool

    for name, m in list(module.named_modules()):
        if type(m) is FP32GradDepthwiseConv2d:
            m.__class__ = nn.Conv2d
        elif isinstance(m, GlobalAvgPool):
            module.set_submodule(name, nn.AdaptiveAvgPool2d(1))
    return module


def trunk_layers(cfg) -> list[tuple[str, object, tuple]]:
    """(name, module, input shape) of each depthwise convolution and squeeze-excitation block of the trunk."""
    import torch
    from torchvision.ops.misc import SqueezeExcitation

    from bev.models.fast_layers import slow_bf16_depthwise

    trunk = bt.build(cfg, channels_last=False).net.camera_encoder.trunk
    picked = {
        n: m
        for n, m in trunk.named_modules()
        if isinstance(m, SqueezeExcitation) or (isinstance(m, torch.nn.Conv2d) and m.groups > 1)
    }
    shapes = {}

    def record(name):
        def hook(module, args):
            shapes.setdefault(name, tuple(args[0].shape))  # returns None: the input is left as it is

        return hook

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in picked.items()]
    H, W = (int(s) for s in cfg.data.final_dim)
    with torch.no_grad():
        trunk(torch.randn(int(cfg.data.batch_size) * 6, 3, H, W))
    for h in hooks:
        h.remove()
    return [
        (n, m, shapes[n]) for n, m in picked.items() if not isinstance(m, torch.nn.Conv2d) or slow_bf16_depthwise(m)
    ]


def time_pair(plain, fast, shape, bf16: bool, rounds: int) -> dict:
    """Forward + backward of two versions of a layer on the same input, alternated; medians in ms."""
    import torch

    fmt = torch.channels_last if bf16 else torch.contiguous_format
    x = torch.randn(shape).contiguous(memory_format=fmt).to(torch.bfloat16 if bf16 else torch.float32).requires_grad_()
    mods = {"plain": plain.to(memory_format=fmt), "fast": fast.to(memory_format=fmt)}
    times = {k: [] for k in mods}
    for r in range(rounds + 1):
        for k, m in mods.items():
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = m(x)
            out.backward(torch.ones_like(out))
            if r:  # the first round builds oneDNN's primitives
                times[k].append(time.perf_counter() - t0)
            x.grad = None
            m.zero_grad(set_to_none=True)
    med = {k: statistics.median(t) * 1e3 for k, t in times.items()}
    return {
        "plain_ms": round(med["plain"], 2),
        "fast_ms": round(med["fast"], 2),
        "speedup": round(med["plain"] / med["fast"], 2),
    }


def bench_layers(cfg, rounds: int) -> list[dict]:
    """Each picked layer in the modes where its replacement acts."""
    from torch import nn

    from bev.models.fast_layers import fast_global_pools, fp32_depthwise

    rows = []
    for name, m, shape in trunk_layers(cfg):
        fast = copy.deepcopy(m)
        if isinstance(m, nn.Conv2d):
            fp32_depthwise(nn.Sequential(fast))
            kind, modes = f"depthwise {m.kernel_size[0]}x{m.kernel_size[1]} stride {m.stride[0]}", [True]
        else:
            fast_global_pools(fast)
            kind, modes = "squeeze-excitation", [True, False]
        plain = plain_layers(copy.deepcopy(m))
        for bf16 in modes:
            r = {
                "layer": name,
                "kind": kind,
                "input": list(shape),
                "mode": "channels_last+bf16" if bf16 else "fp32",
                **time_pair(plain, fast, shape, bf16, rounds),
            }
            rows.append(r)
            print(
                f"  {name:28s} {kind:24s} {str(shape):22s} {r['mode']:19s} plain {r['plain_ms']:7.2f} ms  "
                f"fast {r['fast_ms']:7.2f} ms  {r['speedup']:.2f}x",
                flush=True,
            )
    return rows


def bench_steps(cfg, steps: int) -> dict:
    """bench_train's fp32 and channels_last+bf16 steps with the fast layers and with the plain ones."""
    batch = bt.real_rig_batch(cfg, int(cfg.data.batch_size))
    runs = {}
    for name in ("fp32", "channels_last+bf16"):
        for layers in ("fast", "plain"):
            v = bt.Variant(cfg, name, batch)
            if layers == "plain":
                plain_layers(v.net)
            v.step()  # warm-up
            runs[f"{name} {layers}"] = v
    times = {k: [] for k in runs}
    for i in range(steps):
        for k, v in runs.items():
            times[k].append(v.step())
        print(f"  step {i + 1}/{steps}: " + ", ".join(f"{k} {t[-1]:.2f} s" for k, t in times.items()), flush=True)
    med = {k: statistics.median(t) for k, t in times.items()}
    res = {
        "step_s": {k: round(s, 3) for k, s in med.items()},
        "steps_s": {k: [round(s, 3) for s in t] for k, t in times.items()},
    }
    for layers in ("fast", "plain"):
        res[f"bf16_speedup_{layers}"] = round(med[f"fp32 {layers}"] / med[f"channels_last+bf16 {layers}"], 3)
    for name in ("fp32", "channels_last+bf16"):
        res[f"fast_layers_speedup_{name}"] = round(med[f"{name} plain"] / med[f"{name} fast"], 3)
    return res


def parse_args(argv):
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="measured forward + backward passes per layer version")
    p.add_argument("--steps", type=int, default=4, help="measured training steps per model (0: layers only)")
    p.add_argument("--batch-size", type=int, default=None, help="instead of the paper config's 4 (x 6 cameras)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "bench_fast_layers_cpu.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Time the layers, then the training steps; print as it goes and write the JSON."""
    a = parse_args(argv)
    import torch

    from bev.utils.precision import cpu_bf16_support

    load0 = os.getloadavg()[0]
    torch.set_num_threads(a.threads)
    # depthwise_fp32=true: the fast layers are measured even where a config turned them off
    cfg = bt.compose_config(
        [
            *bt.CONFIGS["paper"],
            "model.net.camera.depthwise_fp32=true",
            *([f"data.batch_size={a.batch_size}"] if a.batch_size else []),
        ]
    )
    report = {
        "benchmark": "camera trunk fast layers vs the layers they replace (forward + backward; training step)",
        "batch_size": int(cfg.data.batch_size),
        "cpu_bf16": cpu_bf16_support(),
        "threads": a.threads,
        "rounds": a.rounds,
        "steps": a.steps,
    }
    print("layers (forward + backward, medians):")
    report["layers"] = bench_layers(cfg, a.rounds)
    if a.steps:
        print("training steps at the paper config, alternated:")
        report["training_step"] = s = bench_steps(cfg, a.steps)
        print(
            f"bf16 + channels_last vs fp32: {s['bf16_speedup_fast']:.2f}x with the fast layers, "
            f"{s['bf16_speedup_plain']:.2f}x without; fast layers: {s['fast_layers_speedup_channels_last+bf16']:.2f}x "
            f"(bf16), {s['fast_layers_speedup_fp32']:.2f}x (fp32)"
        )
    report["host"] = bt.host(load0)
    report["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_report(a.out, report)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
