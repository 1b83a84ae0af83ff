#!/usr/bin/env python
"""Benchmark the voxel-pooling ("splat") implementations of bev.ops on real-rig geometry.

Frustum coordinates come from the real nuScenes rig (bev/data/nuscenes_rig.json): each
camera's frustum is unprojected with bev.geometry and floor-binned into the grid, so the
collision pattern (many points per occupied cell, a few percent outside) is the real one.

Methods (all produce the same (B, C, Z, X, Y) grid; timings include building the plan from
the coordinates, as in training where the geometry changes every sample, unless noted):
  reference voxel_sum      the pure-torch reference (backend="torch": per-voxel segment sums)
  quickcumsum voxel_sum    LSS's prefix-sum trick (backend="quickcumsum", float64 prefix)
  index_add_               index_add_ into the flat grid (autograd backward: index_select)
  native voxel_sum         our kernels on the materialised product
  materialise+native vs    depth x feats product, then native voxel_sum (the unfused path)
  native bev_pool          fused lift+splat, the product is never built
  native bev_pool (plan)   fused, with a precomputed plan (fixed calibration)
  bevfusion-style (GPU)    one thread per (interval, channel) over the sorted product, as in
                           BEVFusion's bev_pool (our own re-implementation, for comparison)

Peak memory is the peak of bytes allocated by torch during the call above what existed
before it (inputs excluded; outputs, intermediates, saved tensors and gradients included).
CPU: replayed from the allocation/free events of torch.profiler(profile_memory=True).
GPU: torch.cuda.max_memory_allocated after reset_peak_memory_stats.

GPU: achieved forward bandwidth of the fused op (unique bytes moved / time) vs the device's
measured copy bandwidth and its theoretical peak (memory clock x bus width), per dtype.

User level (--section user, LSS size): each method called as a training step calls it: fresh
input tensors every call, the plan built in the call, out.sum().backward() (an expanded,
stride-0 gradient); methods alternate within each round; medians of wall and CPU time. Beside
them, as a floor, a call that only moves the memory any implementation must (the rows read, the
output and the rows' gradient written, once each): index_add_ over it is the most any could reach.

The process keeps freed memory mapped (bev.utils.malloc.tune_malloc_in_process, as the CPU
training entry does with malloc_tuning: true); --malloc default measures glibc's defaults (stored
separately under user_level.malloc_default).

Usage: python scripts/bench_pool.py [--section all|methods|user] [--sizes lss bevdet] [--repeats N]
                                    [--rounds N] [--threads N] [--device cpu|cuda]
                                    [--dtypes float32 float16 bfloat16] [--malloc tuned|default]
Writes benchmarks/results/bench_pool_<device>.json (a single section updates its part) and
prints tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when run with runpy
from bench_common import write_report  # noqa: E402

# The benchmark machines are shared: spinning OpenMP workers that wait for a descheduled
# sibling turn every small parallel op into a time slice. Passive waiting keeps the numbers
# meaningful for every method alike (recorded in the JSON); must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import bev.ops as ops  # noqa: E402
from bev.data.rig import load_rig  # noqa: E402
from bev.geometry import Grid, frustum_to_ego, make_frustum, quaternion_to_matrix, voxel_coords  # noqa: E402
from bev.utils.malloc import MALLOC_ENV, tune_malloc_in_process  # noqa: E402
from bev.utils.profiling import peak_cpu_bytes  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# Sizes from the issue: LSS (paper config) and BEVDet/BEVFusion.
SIZES = {
    "lss": dict(
        batch=4,
        image=(128, 352),
        downsample=16,
        channels=64,
        grid=Grid(xbound=(-50, 50, 0.5), ybound=(-50, 50, 0.5), zbound=(-10, 10, 20), dbound=(4, 45, 1)),
        # LSS val augmentation: resize 0.22 (1600x900 -> 352x198), crop the top 48 rows... as post_rot/post_tran
        resize=0.22,
        crop_top=48,
    ),
    "bevdet": dict(
        batch=1,
        image=(256, 704),
        downsample=8,
        channels=80,
        grid=Grid(xbound=(-51.2, 51.2, 0.4), ybound=(-51.2, 51.2, 0.4), zbound=(-10, 10, 20), dbound=(1, 60, 0.5)),
        # BEVDet test augmentation: resize 0.44 (1600x900 -> 704x396), crop 140 rows off the top
        resize=0.44,
        crop_top=140,
    ),
}


def real_rig_coords(size: dict, device) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """(B, 6, D, fH, fW, 3) int64 voxel coords of the real rig's frustum points, and grid_shape."""
    rig = load_rig()
    grid: Grid = size["grid"]
    cams = [rig["cameras"][name] for name in rig["camera_order"]]
    intrinsics = torch.tensor([c["camera_intrinsic"] for c in cams], dtype=torch.float64)
    rots = torch.tensor(np.stack([quaternion_to_matrix(c["rotation"]) for c in cams]), dtype=torch.float64)
    trans = torch.tensor([c["translation"] for c in cams], dtype=torch.float64)
    post_rot = torch.diag(torch.tensor([size["resize"], size["resize"], 1.0], dtype=torch.float64))
    post_tran = torch.tensor([0.0, -float(size["crop_top"]), 0.0], dtype=torch.float64)
    B, N = size["batch"], len(cams)
    frustum = make_frustum(size["image"], size["downsample"], grid).double()
    points = frustum_to_ego(
        frustum,
        intrinsics.expand(B, N, 3, 3),
        rots.expand(B, N, 3, 3),
        trans.expand(B, N, 3),
        post_rot.expand(B, N, 3, 3),
        post_tran.expand(B, N, 3),
    )
    coords = voxel_coords(points, grid)
    return coords.to(device), (B, *grid.voxel_shape)


# ---------------------------------------------------------------------------------------------
# methods: each is fn(depth, feats, coords, grid, state) -> output grid; `state` holds inputs
# prepared outside the timed region (materialised product, precomputed plan)
# ---------------------------------------------------------------------------------------------
def materialise(depth, feats):
    """The (points, C) depth x feats product the unfused methods pool."""
    return (depth.unsqueeze(-1) * feats.unsqueeze(2)).reshape(-1, feats.shape[-1])


def flat_coords(coords):
    """(points, 4) coords with the batch index first, as voxel_sum takes them."""
    B = coords.shape[0]
    batch = torch.arange(B, device=coords.device).view(B, 1, 1, 1, 1, 1).expand(*coords.shape[:5], 1)
    return torch.cat([batch, coords], -1).reshape(-1, 4)


def index_add_pool(points, coords4, grid):
    """Pool with index_add_ into the flat grid; points outside go to an extra row that is dropped."""
    B, Z, X, Y = grid
    upper = torch.tensor([B, Z, X, Y], device=coords4.device)
    inside = ((coords4 >= 0) & (coords4 < upper)).all(1)
    b, z, x, y = coords4.unbind(1)
    flat = torch.where(inside, ((b * Z + z) * X + x) * Y + y, B * Z * X * Y)
    out = points.new_zeros(B * Z * X * Y + 1, points.shape[1])  # last row collects ignored points
    out = out.index_add(0, flat, points)
    return out[:-1].view(B, Z * X * Y, -1).transpose(1, 2).reshape(B, -1, Z, X, Y)


METHODS = {
    "reference voxel_sum": dict(
        leaf="points", fn=lambda s: ops.voxel_sum(s["points"], s["coords4"], s["grid"], backend="torch")
    ),
    "quickcumsum voxel_sum": dict(
        leaf="points", fn=lambda s: ops.voxel_sum(s["points"], s["coords4"], s["grid"], backend="quickcumsum")
    ),
    "index_add_": dict(leaf="points", fn=lambda s: index_add_pool(s["points"], s["coords4"], s["grid"])),
    "native voxel_sum": dict(
        leaf="points", fn=lambda s: ops.voxel_sum(s["points"], s["coords4"], s["grid"], backend="native")
    ),
    "materialise+reference": dict(
        leaf="frustum",
        fn=lambda s: ops.voxel_sum(materialise(s["depth"], s["feats"]), s["coords4"], s["grid"], backend="torch"),
    ),
    "materialise+native vs": dict(
        leaf="frustum",
        fn=lambda s: ops.voxel_sum(materialise(s["depth"], s["feats"]), s["coords4"], s["grid"], backend="native"),
    ),
    "native bev_pool": dict(
        leaf="frustum", fn=lambda s: ops.bev_pool(s["depth"], s["feats"], s["coords"], s["grid"], backend="native")
    ),
    "native bev_pool (plan)": dict(
        leaf="frustum", fn=lambda s: ops.bev_pool(s["depth"], s["feats"], plan=s["plan"], backend="native")
    ),
}


# ---------------------------------------------------------------------------------------------
# BEVFusion-style baseline kernel (GPU only): one thread per (interval, channel) over the
# product sorted by voxel; written here from the published description, for comparison.
# ---------------------------------------------------------------------------------------------
BASELINE_CUDA = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

__global__ void interval_channel_kernel(const float* __restrict__ sorted_points, const int* __restrict__ starts,
                                        const int* __restrict__ lengths, const int* __restrict__ voxel_of_interval,
                                        float* __restrict__ out, int intervals, int C, int S) {
  int idx = blockIdx.x * blockDim.x + threadIdx.x;  // int32 indexing, as in the original
  int interval = idx / C, c = idx % C;
  if (interval >= intervals) return;
  float acc = 0.f;
  const float* row = sorted_points + starts[interval] * C + c;
  for (int i = 0; i < lengths[interval]; ++i) acc += row[i * C];
  int v = voxel_of_interval[interval];
  int b = v / S, s = v % S;
  out[(b * C + c) * S + s] = acc;
}

torch::Tensor interval_pool(torch::Tensor sorted_points, torch::Tensor starts, torch::Tensor lengths,
                            torch::Tensor voxel_of_interval, int64_t B, int64_t S) {
  const int C = sorted_points.size(1), intervals = starts.size(0);
  auto out = torch::zeros({B, C, S}, sorted_points.options());
  const int threads = 256, blocks = (intervals * C + threads - 1) / threads;
  interval_channel_kernel<<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
      sorted_points.data_ptr<float>(), starts.data_ptr<int>(), lengths.data_ptr<int>(),
      voxel_of_interval.data_ptr<int>(), out.data_ptr<float>(), intervals, C, S);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}
"""


def load_baseline():
    """Compile the BEVFusion-style kernel (GPU) with torch's inline extension loader."""
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name="bev_bench_interval_baseline",
        cpp_sources="torch::Tensor interval_pool(torch::Tensor sorted_points, "
        "torch::Tensor starts, torch::Tensor lengths, torch::Tensor voxel_of_interval, int64_t B, int64_t S);",
        cuda_sources=BASELINE_CUDA,
        functions=["interval_pool"],
        verbose=False,
    )


def add_baseline_methods(state, baseline):
    """Intervals (non-empty voxels) from the plan: computed once, outside the timed region."""
    plan = state["plan"]
    counts = plan.offsets[1:] - plan.offsets[:-1]
    occupied = torch.nonzero(counts).squeeze(1)
    state["intervals"] = (
        plan.offsets[:-1][occupied].int().contiguous(),
        counts[occupied].int().contiguous(),
        occupied.int().contiguous(),
    )
    B, Z, X, Y = state["grid"]
    S = Z * X * Y

    def bevfusion_style(s):
        """Materialise, sort by voxel, then the interval kernel (the full BEVFusion-style path)."""
        points = materialise(s["depth"], s["feats"]).index_select(0, s["plan"].order)
        out = baseline.interval_pool(points.contiguous(), *s["intervals"], B, S)
        return out.view(B, -1, Z, X, Y)

    def bevfusion_kernel_only(s):
        """The interval kernel alone, on the product sorted outside the timed region."""
        return baseline.interval_pool(s["sorted_points"], *s["intervals"], B, S).view(B, -1, Z, X, Y)

    return {
        "bevfusion-style (plan)": dict(leaf="frustum", fn=bevfusion_style, forward_only=True),
        "bevfusion kernel only": dict(leaf="frustum", fn=bevfusion_kernel_only, forward_only=True),
    }


# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------
def sync(device):
    """Wait for the GPU, so that the clock covers its work."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_state(depth, feats, coords, grid, leaf):
    """Inputs of a method; its leaf tensors (the product, or depth and feats) require grad."""
    state = dict(coords=coords, grid=grid, coords4=flat_coords(coords))
    if leaf == "points":
        state["points"] = materialise(depth, feats).detach().requires_grad_()
    else:
        state["depth"] = depth.detach().requires_grad_()
        state["feats"] = feats.detach().requires_grad_()
    return state


def run_once(method, state, grad_out, backward):
    """One call of the method, with the backward pass when asked."""
    out = method["fn"](state)
    if backward:
        out.backward(grad_out)
    return out


def clear_grads(state):
    """Drop the gradients a backward pass left on the leaves."""
    for key in ("points", "depth", "feats"):
        if key in state:
            state[key].grad = None


# Past this many seconds of timed calls a measurement stops at 3 calls: the slow references (QuickCumsum
# takes 0.7 s a call at BEVDet size on an H200) would otherwise take most of a GPU check's time.
MEASURE_BUDGET_S = 2.0


def time_it(method, state, grad_out, backward, repeats, device):
    """Median and min seconds of `repeats` calls (at least 3 past MEASURE_BUDGET_S) after one warm-up call."""
    times = []
    for i in range(repeats + 1):  # first run is warm-up
        clear_grads(state)
        sync(device)
        t0 = time.perf_counter()
        out = run_once(method, state, grad_out, backward)
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
        del out
        if len(times) >= 3 and sum(times) > MEASURE_BUDGET_S:
            break
    return statistics.median(times), min(times)


def peak_memory(method, state, grad_out, backward, device):
    """Peak bytes allocated during one call above what existed before it (see the module docstring)."""
    clear_grads(state)
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = run_once(method, state, grad_out, backward)
        sync(device)
        peak = torch.cuda.max_memory_allocated() - base
        del out
        clear_grads(state)
        return peak

    def call():
        """The call whose CPU allocations are replayed; it frees its output and gradients."""
        out = run_once(method, state, grad_out, backward)
        del out
        clear_grads(state)

    return peak_cpu_bytes(call)


def product_bytes(depth, feats):
    """Bytes of the materialised depth x feats product."""
    return depth.numel() * feats.shape[-1] * feats.element_size()


def fused_forward_bytes(depth, feats, grid):
    """Unique bytes a fused forward must move: depth, feats, plan (order + offsets), output."""
    B, Z, X, Y = grid
    V = B * Z * X * Y
    return (
        depth.numel() * depth.element_size()
        + feats.numel() * feats.element_size()
        + depth.numel() * 8
        + (V + 1) * 8
        + V * feats.shape[-1] * feats.element_size()
    )


def copy_bandwidth(device):
    """Achievable device memory bandwidth, from a 1 GiB clone (read + write)."""
    x = torch.empty(2**28, dtype=torch.float32, device=device)
    times = []
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        y = x.clone()
        sync(device)
        times.append(time.perf_counter() - t0)
        del y
    return 2 * x.numel() * 4 / statistics.median(times[1:])


def peak_bandwidth(device):
    """The device's theoretical memory bandwidth (bytes/s) from its memory clock and bus width
    (double data rate), or None where torch does not report them."""
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def random_inputs(coords, grid, channels, device, dtype):
    """Seeded depth (softmax over the bins), features and output gradient for the frustum of `coords`."""
    B, Nc, D, fH, fW, _ = coords.shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    depth = torch.randn(B, Nc, D, fH, fW, generator=gen).softmax(2).to(device, dtype)
    feats = torch.randn(B, Nc, fH, fW, channels, generator=gen).to(device, dtype)
    grad_out = torch.randn(B, channels, *grid[1:], generator=gen).to(device, dtype)
    return depth, feats, grad_out


def geometry_info(depth, feats, coords, grid, plan) -> dict:
    """How the points fall into the grid: counts, fraction inside, occupied voxels, product size."""
    inside = ((coords >= 0) & (coords < torch.tensor(grid[1:], device=coords.device))).all(-1)
    occupied = int(((plan.offsets[1:] - plan.offsets[:-1]) > 0).sum())
    return dict(
        points=int(depth.numel()),
        channels=feats.shape[-1],
        grid_shape=list(grid),
        inside_fraction=float(inside.float().mean()),
        occupied_voxels=occupied,
        points_per_occupied_voxel=float(inside.sum()) / max(occupied, 1),
        product_mb=product_bytes(depth, feats) / 2**20,
    )


def method_state(label, method, depth, feats, coords, grid, plan, baseline):
    """A method's inputs, made outside the timed region (for the bevfusion ones: intervals, sorted product)."""
    state = make_state(depth, feats, coords, grid, method["leaf"])
    state["plan"] = plan
    if "bevfusion" in label:
        add_baseline_methods(state, baseline)
        state["sorted_points"] = materialise(depth, feats).index_select(0, plan.order).contiguous()
    return state


def measure(method, state, grad_out, repeats, device) -> dict:
    """Median and min ms and peak MB of the forward and, unless the method is forward-only, fwd+bwd."""
    row = {}
    median, fastest = time_it(method, state, grad_out, False, repeats, device)
    row["forward_ms"], row["forward_ms_min"] = 1e3 * median, 1e3 * fastest
    row["forward_peak_mb"] = peak_memory(method, state, grad_out, False, device) / 2**20
    if not method.get("forward_only"):
        median, fastest = time_it(method, state, grad_out, True, repeats, device)
        row["fwd_bwd_ms"], row["fwd_bwd_ms_min"] = 1e3 * median, 1e3 * fastest
        row["fwd_bwd_peak_mb"] = peak_memory(method, state, grad_out, True, device) / 2**20
    return row


def print_method_row(name, label, row):
    """One method's progress line."""
    print(
        f"  {name:7s} {label:24s} fwd {row['forward_ms']:9.2f} ms  fwd+bwd "
        f"{row.get('fwd_bwd_ms', float('nan')):9.2f} ms  peak fwd+bwd {row.get('fwd_bwd_peak_mb', float('nan')):8.1f} MB",
        flush=True,
    )


def bench_size(name, size, device, repeats, methods, baseline, dtype=torch.float32):
    """Every method at one size and dtype: difference from the first method's output, times, peak memory."""
    coords, grid = real_rig_coords(size, device)
    depth, feats, grad_out = random_inputs(coords, grid, size["channels"], device, dtype)
    plan = ops.bev_pool_plan(coords, grid, backend="native")
    info = geometry_info(depth, feats, coords, grid, plan)
    all_methods = dict(methods)
    if baseline is not None and dtype == torch.float32:  # the baseline kernel is fp32-only, as the original
        all_methods.update(add_baseline_methods(dict(plan=plan, grid=grid), baseline))
    rows = []
    reference_out = None
    for label, method in all_methods.items():
        state = method_state(label, method, depth, feats, coords, grid, plan, baseline)
        with torch.no_grad():
            out = method["fn"](state)
        if reference_out is None:  # every method is checked against the first one's output
            reference_out = out.double()
        row = dict(method=label, max_abs_diff_vs_first=float((out.double() - reference_out).abs().max()))
        del out
        row.update(measure(method, state, grad_out, repeats, device))
        if device.type == "cuda" and label.startswith("native bev_pool"):
            row["forward_gb_per_s"] = fused_forward_bytes(depth, feats, grid) / (row["forward_ms"] / 1e3) / 1e9
        rows.append(row)
        print_method_row(name, label, row)
        del state
    info["fused_forward_bytes"] = fused_forward_bytes(depth, feats, grid)
    return dict(size=name, dtype=str(dtype).replace("torch.", ""), **info, rows=rows)


# ---------------------------------------------------------------------------------------------
# user level: each call as a training step makes it. Fresh input tensors every call (made
# outside the timed region: a previous layer allocates them), the plan built inside the call,
# and out.sum().backward(), whose gradient is expanded (stride 0). Methods alternate within
# each round (order reversed every other round) so load changes hit them alike.
# ---------------------------------------------------------------------------------------------
class _TrafficOnly(torch.autograd.Function):
    """Not a pooling: the memory traffic a voxel_sum call cannot avoid and nothing else, as a floor to
    compare with. Forward reads the rows once and writes a zero output once; backward writes the rows'
    gradient once. No keys, no sort, no gathering."""

    @staticmethod
    def forward(ctx, points, out_shape):
        ctx.rows = points.shape
        points.sum()  # every row read once
        return points.new_zeros(out_shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.new_empty(ctx.rows).fill_(1.0), None


TRAFFIC_ONLY = "memory traffic only (floor)"
USER_METHODS = {
    "native voxel_sum": METHODS["native voxel_sum"],
    "native bev_pool": METHODS["native bev_pool"],
    "torch voxel_sum": METHODS["reference voxel_sum"],
    "quickcumsum voxel_sum": METHODS["quickcumsum voxel_sum"],
    "index_add_": METHODS["index_add_"],
    TRAFFIC_ONLY: dict(
        leaf="points",
        fn=lambda s: _TrafficOnly.apply(s["points"], (*s["grid"][:1], s["points"].shape[1], *s["grid"][1:])),
    ),
}


def fresh_state(base, leaf):
    """New input tensors for one call, as a training step gets them."""
    state = dict(grid=base["grid"], coords=base["coords"].clone(), coords4=base["coords4"].clone())
    names = ("points",) if leaf == "points" else ("depth", "feats")
    state.update({name: base[name].clone().requires_grad_() for name in names})
    return state


def user_level(name, size, device, rounds, skip=()):
    """Median wall and CPU ms of each user-level method's fwd+bwd over `rounds` alternating rounds."""
    coords, grid = real_rig_coords(size, device)
    B, Nc, D, fH, fW, _ = coords.shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    depth = torch.randn(B, Nc, D, fH, fW, generator=gen).softmax(2).to(device)
    feats = torch.randn(B, Nc, fH, fW, size["channels"], generator=gen).to(device)
    base = dict(
        grid=grid,
        coords=coords,
        coords4=flat_coords(coords),
        depth=depth,
        feats=feats,
        points=materialise(depth, feats),
    )
    methods = {k: v for k, v in USER_METHODS.items() if k not in skip}
    times = {label: [] for label in methods}
    cpu_times = {label: [] for label in methods}
    labels = list(methods)
    for r in tqdm(range(rounds + 1), desc=f"user level {name}", leave=False):  # round 0 warms up
        for label in labels if r % 2 else labels[::-1]:
            state = fresh_state(base, methods[label]["leaf"])
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            out = methods[label]["fn"](state)
            out.sum().backward()
            sync(device)
            if r:
                times[label].append(time.perf_counter() - t0)
                cpu_times[label].append(time.process_time() - c0)
            del out, state
    # CPU time (all threads of the process) is less sensitive than wall time to other jobs
    # taking the cores of a shared machine; both are medians over the same calls.
    rows = [
        dict(
            method=label,
            fwd_bwd_ms=1e3 * statistics.median(t),
            fwd_bwd_ms_min=1e3 * min(t),
            fwd_bwd_cpu_ms=1e3 * statistics.median(cpu_times[label]),
            runs=len(t),
        )
        for label, t in times.items()
    ]
    for row in rows:
        print(
            f"  {name:7s} user level {row['method']:24s} fwd+bwd {row['fwd_bwd_ms']:8.2f} ms (min {row['fwd_bwd_ms_min']:.2f})",
            flush=True,
        )
    return dict(size=name, rows=rows)


def user_level_ratios(result, key="fwd_bwd_ms"):
    """How many times faster native voxel_sum / bev_pool are than each other method (medians)."""
    by = {row["method"]: row[key] for row in result["rows"]}
    ratios = {
        f"{other} / {mine}": by[other] / by[mine]
        for mine in ("native voxel_sum", "native bev_pool")
        if mine in by
        for other in ("quickcumsum voxel_sum", "torch voxel_sum", "index_add_")
        if other in by
    }
    if TRAFFIC_ONLY in by and "index_add_" in by:  # the most any implementation could reach over index_add_
        ratios[f"index_add_ / {TRAFFIC_ONLY}"] = by["index_add_"] / by[TRAFFIC_ONLY]
    return ratios


def user_level_targets(user, device):
    """The issue's user-level targets (CPU, LSS size), evaluated on this run's ratios."""
    checks = []
    ratios = user.get("lss", {}).get("ratios", {})
    if device.type == "cpu" and ratios:
        for other, goal in (("quickcumsum voxel_sum", 10), ("index_add_", 3)):
            key = f"{other} / native voxel_sum"
            if key in ratios:
                checks.append(
                    dict(
                        target=f"LSS user level: native voxel_sum fwd+bwd >= {goal}x faster than {other}",
                        ratio=ratios[key],
                        met=ratios[key] >= goal,
                    )
                )
    return checks


def targets(results, device):
    """The issue's targets, evaluated on this run's numbers (reported, never asserted)."""
    try:
        return _targets(results, device)
    except KeyError as e:  # a method the target needs was left out with --skip
        print(f"targets not evaluated: method {e} was skipped")
        return []


def _targets(results, device):
    """The method-level targets; raises KeyError when a method they compare was skipped."""
    # Targets are stated for fp32 (the other dtypes are reported alongside).
    results = [r for r in results if r.get("dtype", "float32") == "float32"]
    by = {r["size"]: {row["method"]: row for row in r["rows"]} for r in results}
    checks = []
    if "lss" in by and device.type == "cpu":
        m = by["lss"]
        ref, iadd = m["quickcumsum voxel_sum"]["fwd_bwd_ms"], m["index_add_"]["fwd_bwd_ms"]
        nvs = m["native voxel_sum"]["fwd_bwd_ms"]
        checks.append(
            dict(
                target="LSS: native voxel_sum fwd+bwd >= 10x faster than the QuickCumsum reference",
                ratio=ref / nvs,
                met=ref / nvs >= 10,
            )
        )
        checks.append(
            dict(
                target="LSS: native voxel_sum fwd+bwd >= 2x faster than index_add_",
                ratio=iadd / nvs,
                met=iadd / nvs >= 2,
            )
        )
        unfused, fused = m["materialise+native vs"]["fwd_bwd_ms"], m["native bev_pool"]["fwd_bwd_ms"]
        checks.append(
            dict(
                target="LSS: fused bev_pool fwd+bwd faster than materialise + native voxel_sum",
                ratio=unfused / fused,
                met=fused < unfused,
            )
        )
    if "bevdet" in by:
        m = by["bevdet"]
        unfused, fused = m["materialise+native vs"]["fwd_bwd_peak_mb"], m["native bev_pool"]["fwd_bwd_peak_mb"]
        checks.append(
            dict(
                target="BEVDet: fused bev_pool fwd+bwd peak memory >= 5x below materialise + voxel_sum",
                ratio=unfused / fused,
                met=unfused / fused >= 5,
            )
        )
        if device.type == "cuda":
            info = next(r for r in results if r["size"] == "bevdet")
            bound_ms = info["fused_forward_bytes"] / info["copy_bandwidth_gb_per_s"] / 1e6
            fused_ms = m["native bev_pool (plan)"]["forward_ms"]
            checks.append(
                dict(
                    target="GPU BEVDet: fused bev_pool forward within 2x of the bandwidth bound",
                    ratio=fused_ms / bound_ms,
                    met=fused_ms <= 2 * bound_ms,
                )
            )
            if "bevfusion-style (plan)" in m:
                base = m["bevfusion-style (plan)"]["forward_ms"]
                checks.append(
                    dict(
                        target="GPU BEVDet: fused bev_pool forward faster than bevfusion-style",
                        ratio=base / fused_ms,
                        met=fused_ms < base,
                    )
                )
    return checks


def parse_args(argv):
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--section",
        choices=["all", "methods", "user"],
        default="all",
        help="methods: each method's forward / fwd+bwd time and peak memory; user: the user-level "
        "fwd+bwd (LSS size only). A single section updates just its part of the JSON",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (median)")
    parser.add_argument("--rounds", type=int, default=15, help="user level: alternating rounds (median)")
    parser.add_argument("--skip", nargs="*", default=[], help="method labels to skip")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=None,
        choices=list(DTYPES),
        help="input dtypes (default: float32 on the CPU; float32, float16, bfloat16 on a GPU)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument(
        "--malloc",
        choices=["tuned", "default"],
        default="tuned",
        help="tuned: freed memory stays mapped, as bev-train with malloc_tuning: true; default: glibc's",
    )
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def malloc_mode(malloc_tuning: dict) -> str:
    """ "malloc_tuned" when freed memory stays mapped (tuned here or by the environment), else "malloc_default"."""
    return "malloc_tuned" if malloc_tuning or all(k in os.environ for k in MALLOC_ENV) else "malloc_default"


def malloc_settings(malloc_tuning: dict) -> dict:
    """Each allocator setting as the environment gives it, else as tune_malloc_in_process applied it."""
    return {k: os.environ.get(k, str(malloc_tuning.get(k))) for k in MALLOC_ENV}


def load_report(out: Path, section: str) -> dict:
    """The report to fill: a single section updates the existing one (keeping the other section), else a new one."""
    return json.loads(out.read_text()) if section != "all" and out.exists() else {}


def host_fields(device, device_name) -> dict:
    """The report's device and software fields, refreshed by every run."""
    return dict(
        device=str(device),
        device_name=device_name,
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        cpu_count=os.cpu_count(),
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
        python=platform.python_version(),
    )


def add_bandwidth(result, bandwidth, peak):
    """Record the GPU's copy and theoretical bandwidth in `result`, and the fused rows' fractions of them."""
    result["copy_bandwidth_gb_per_s"] = bandwidth / 1e9
    result["peak_bandwidth_gb_per_s"] = peak / 1e9 if peak else None
    for row in result["rows"]:
        if "forward_gb_per_s" in row:
            row["forward_fraction_of_copy"] = row["forward_gb_per_s"] / result["copy_bandwidth_gb_per_s"]
            row["forward_fraction_of_peak"] = row["forward_gb_per_s"] * 1e9 / peak if peak else None


def bench_all_sizes(args, device, repeats, baseline) -> list[dict]:
    """bench_size for every dtype and size (dtype by dtype), with the bandwidth figures on a GPU."""
    methods = {k: v for k, v in METHODS.items() if k not in args.skip}
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    peak = peak_bandwidth(device) if device.type == "cuda" else None
    dtypes = args.dtypes or (list(DTYPES) if device.type == "cuda" else ["float32"])
    results = []
    for dtype in dtypes:
        for name in args.sizes:
            print(f"{name} {dtype}", flush=True)
            result = bench_size(name, SIZES[name], device, repeats, methods, baseline, DTYPES[dtype])
            if bandwidth:
                add_bandwidth(result, bandwidth, peak)
            results.append(result)
    return results


def methods_section(args, device, repeats, baseline, malloc_tuning, report):
    """Measure every method, record the results and how they were measured in `report`, print the table."""
    load_at_start = os.getloadavg()
    results = bench_all_sizes(args, device, repeats, baseline)
    checks = targets(results, device)
    report.update(
        malloc=malloc_settings(malloc_tuning),
        malloc_mode=malloc_mode(malloc_tuning),
        load_average_at_start=load_at_start,
        load_average_at_end=os.getloadavg(),
        repeats=repeats,
        statistic=f"median of repeats, of 3 where they passed {MEASURE_BUDGET_S} s (min also recorded; a shared CPU machine adds other jobs load)",
        memory_method=(
            "torch.cuda.max_memory_allocated above the pre-call allocation"
            if device.type == "cuda"
            else "peak of torch allocations during the call, replayed from torch.profiler(profile_memory=True) "
            "events (inputs excluded)"
        ),
        date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        results=results,
        targets=checks,
    )
    report.pop("malloc_env", None)  # older key, now "malloc"
    print_table(results, checks)


def user_section(args, device, malloc_tuning, report):
    """Measure the user level (LSS size), record it under user_level.<malloc mode> in `report`, print its table."""
    load_at_start = os.getloadavg()
    # Each allocator mode keeps its own record: a --malloc default run leaves the tuned one in place.
    user = report.setdefault("user_level", {}).setdefault(malloc_mode(malloc_tuning), {})
    user.update(
        how="fresh inputs each call (made outside the timed region), plan built in the call, out.sum().backward(); "
        "methods alternate within each round; median of the rounds after one warm-up round",
        rounds=args.rounds,
        malloc=malloc_settings(malloc_tuning),
        date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    )
    result = user_level("lss", SIZES["lss"], device, args.rounds, args.skip)
    result["ratios"] = user_level_ratios(result)
    result["cpu_time_ratios"] = user_level_ratios(result, "fwd_bwd_cpu_ms")
    user.update(lss=result, load_average_at_start=load_at_start, load_average_at_end=os.getloadavg())
    user["targets"] = user_level_targets(user, device)
    print_user_table(report["user_level"])


def main(argv=None):
    """Run the requested sections, print their tables and write (or update) the JSON report."""
    args = parse_args(argv)
    # As the CPU training entry does (malloc_tuning: true); --malloc default measures glibc's defaults.
    malloc_tuning = tune_malloc_in_process() if args.malloc == "tuned" else {}
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (20 if device.type == "cuda" else 5)
    if not ops.native_available(device):
        sys.exit(f"native kernels are not available for {device}: build the extension first")
    baseline = load_baseline() if device.type == "cuda" and args.section != "user" else None
    device_name = describe_device(device)
    print(
        f"bench_pool on {device_name} ({device}), torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"{malloc_mode(malloc_tuning)}, median of {repeats} (user level: {args.rounds} rounds)",
        flush=True,
    )
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"bench_pool_{device.type}.json"
    report = load_report(out, args.section)
    report.update(host_fields(device, device_name))
    if args.section in ("all", "methods"):
        methods_section(args, device, repeats, baseline, malloc_tuning, report)
    if args.section in ("all", "user"):
        user_section(args, device, malloc_tuning, report)
    write_report(out, report)
    print(f"wrote {out}")


def describe_device(device) -> str:
    """The GPU's name, or the CPU's model name from /proc/cpuinfo (else what platform knows)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def print_user_table(user_level):
    """The user-level table of every allocator mode the report holds, with ratios and targets."""
    for mode, user in user_level.items():
        if "lss" not in user:
            continue
        load = user.get("load_average_at_start", [float("nan")])[0]
        print(f"\nLSS user level, {mode} (load average {load:.1f} at start, median of {user['rounds']} rounds)")
        print("| method | fwd+bwd ms | min ms | CPU ms |\n|---|---:|---:|---:|")
        for row in user["lss"]["rows"]:
            print(
                f"| {row['method']} | {row['fwd_bwd_ms']:.2f} | {row['fwd_bwd_ms_min']:.2f} | {row['fwd_bwd_cpu_ms']:.2f} |"
            )
        for key, ratio in user["lss"]["ratios"].items():
            print(f"  {key}: {ratio:.2f}x wall, {user['lss']['cpu_time_ratios'][key]:.2f}x CPU time")
        for c in user.get("targets", []):
            print(f"[{'MET' if c['met'] else 'MISSED'}] {c['target']}: {c['ratio']:.2f}x")


def print_table(results, checks):
    """The methods table, bandwidths, geometry per size, and the targets."""
    header = "| size | dtype | method | fwd ms | fwd+bwd ms | fwd peak MB | fwd+bwd peak MB | GB/s | % of peak |"
    print("\n" + header + "\n|---|---|---|---:|---:|---:|---:|---:|---:|")

    def fmt(v, spec):
        return format(v, spec) if v is not None else "-"

    for r in results:
        for row in r["rows"]:
            peak = row.get("forward_fraction_of_peak")
            print(
                f"| {r['size']} | {r.get('dtype', 'float32')} | {row['method']} | {fmt(row['forward_ms'], '.2f')} | "
                f"{fmt(row.get('fwd_bwd_ms'), '.2f')} | {fmt(row['forward_peak_mb'], '.1f')} | "
                f"{fmt(row.get('fwd_bwd_peak_mb'), '.1f')} | {fmt(row.get('forward_gb_per_s'), '.0f')} | "
                f"{fmt(100 * peak if peak else None, '.0f')} |"
            )
    for r in results:
        if r.get("copy_bandwidth_gb_per_s"):
            print(
                f"{r['size']} {r['dtype']}: device copy bandwidth {r['copy_bandwidth_gb_per_s']:.0f} GB/s, "
                f"theoretical peak {fmt(r.get('peak_bandwidth_gb_per_s'), '.0f')} GB/s"
            )
    for r in results:
        print(
            f"{r['size']}: {r['points']} points, {r['inside_fraction']:.1%} inside, {r['occupied_voxels']} occupied voxels, "
            f"{r['points_per_occupied_voxel']:.1f} points per occupied voxel, product {r['product_mb']:.0f} MB"
        )
    for c in checks:
        print(f"[{'MET' if c['met'] else 'MISSED'}] {c['target']}: {c['ratio']:.2f}x")


if __name__ == "__main__":
    main()
