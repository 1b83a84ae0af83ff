#!/usr/bin/env python
"""Benchmark the voxel-pooling ("splat") implementations of bev.ops on real-rig geometry (`make bench`).

Frustum coordinates come from the real nuScenes rig (bev/data/nuscenes_rig.json), unprojected with
bev.geometry and floor-binned into the grid, so the collision pattern is the real one.

methods (--section methods; sizes lss and bevdet): forward and forward + backward time and peak memory of
  the torch reference, LSS's QuickCumsum, index_add_, native voxel_sum on the materialised depth x feature
  product, and the fused native bev_pool (with and without a precomputed plan); on a GPU per dtype. Peak
  memory is what torch allocates during the call above what existed before it (CPU: replayed from
  torch.profiler events; GPU: max_memory_allocated).
user level (--section user; LSS size): each method as a training step calls it (fresh inputs, the plan
  built in the call, out.sum().backward()), methods alternated within each round, medians of wall and CPU
  time; beside them a floor that only moves the memory any implementation must.

The process keeps freed memory mapped, as bev-train does with malloc_tuning: true.
Writes benchmarks/results/bench_pool_<device>.json (--out; a single section updates its part) and prints tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when run with runpy
from bench_common import RESULTS, device_name, host_versions, read_report, sync, write_report

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


# methods: each is fn(state) -> output grid; `state` holds the inputs, prepared outside the timed region
# (materialised product, precomputed plan)
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


def _voxel_sum(backend: str) -> dict:
    """voxel_sum of the materialised product (the leaf) on `backend`."""
    return dict(leaf="points", fn=lambda s: ops.voxel_sum(s["points"], s["coords4"], s["grid"], backend=backend))


def _product_then_native(s):
    return ops.voxel_sum(materialise(s["depth"], s["feats"]), s["coords4"], s["grid"], backend="native")


METHODS = {
    "reference voxel_sum": _voxel_sum("torch"),
    "quickcumsum voxel_sum": _voxel_sum("quickcumsum"),
    "index_add_": dict(leaf="points", fn=lambda s: index_add_pool(s["points"], s["coords4"], s["grid"])),
    "native voxel_sum": _voxel_sum("native"),
    "materialise+native vs": dict(leaf="frustum", fn=_product_then_native),
    "native bev_pool": dict(leaf="frustum", fn=lambda s: ops.bev_pool(s["depth"], s["feats"], s["coords"], s["grid"])),
    "native bev_pool (plan)": dict(leaf="frustum", fn=lambda s: ops.bev_pool(s["depth"], s["feats"], plan=s["plan"])),
}


def make_state(depth, feats, coords, grid, leaf):
    """New inputs of a method, as a training step gets them; its leaf tensors (the product, or depth and feats)
    require grad."""
    state = dict(coords=coords.clone(), grid=grid, coords4=flat_coords(coords))
    if leaf == "points":
        state["points"] = materialise(depth, feats).detach().requires_grad_()
    else:
        state["depth"] = depth.detach().clone().requires_grad_()
        state["feats"] = feats.detach().clone().requires_grad_()
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

    def call():
        """One call; it frees its output and gradients."""
        run_once(method, state, grad_out, backward)
        clear_grads(state)

    clear_grads(state)
    if device.type != "cuda":
        return peak_cpu_bytes(call)  # the call's CPU allocations, replayed
    sync(device)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    sync(device)
    return torch.cuda.max_memory_allocated() - base


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def random_inputs(coords, grid, channels, device, dtype):
    """Seeded depth (softmax over the bins), features and output gradient for the frustum of `coords`."""
    B, Nc, D, fH, fW, _ = coords.shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    depth = torch.randn(B, Nc, D, fH, fW, generator=gen).softmax(2).to(device, dtype)
    feats = torch.randn(B, Nc, fH, fW, channels, generator=gen).to(device, dtype)
    grad_out = torch.randn(B, channels, *grid[1:], generator=gen).to(device, dtype)
    return depth, feats, grad_out


def measure(method, state, grad_out, repeats, device) -> dict:
    """Median and min ms and peak MB of the forward and of forward + backward."""
    row = {}
    for key, backward in (("forward", False), ("fwd_bwd", True)):
        median, fastest = time_it(method, state, grad_out, backward, repeats, device)
        row[f"{key}_ms"], row[f"{key}_ms_min"] = 1e3 * median, 1e3 * fastest
        row[f"{key}_peak_mb"] = peak_memory(method, state, grad_out, backward, device) / 2**20
    return row


def bench_size(name, size, device, repeats, methods, dtype=torch.float32):
    """Every method at one size and dtype: difference from the first method's output, times, peak memory."""
    coords, grid = real_rig_coords(size, device)
    depth, feats, grad_out = random_inputs(coords, grid, size["channels"], device, dtype)
    plan = ops.bev_pool_plan(coords, grid, backend="native")
    # how the points fall into the grid: counts, fraction inside, occupied voxels, product size
    inside = ((coords >= 0) & (coords < torch.tensor(grid[1:], device=coords.device))).all(-1)
    occupied = int(((plan.offsets[1:] - plan.offsets[:-1]) > 0).sum())
    info = dict(
        points=int(depth.numel()),
        channels=feats.shape[-1],
        grid_shape=list(grid),
        inside_fraction=float(inside.float().mean()),
        occupied_voxels=occupied,
        points_per_occupied_voxel=float(inside.sum()) / max(occupied, 1),
        product_mb=depth.numel() * feats.shape[-1] * feats.element_size() / 2**20,
    )
    rows = []
    reference_out = None
    for label, method in methods.items():
        state = make_state(depth, feats, coords, grid, method["leaf"])
        state["plan"] = plan
        with torch.no_grad():
            out = method["fn"](state)
        if reference_out is None:  # every method is checked against the first one's output
            reference_out = out.double()
        row = dict(method=label, max_abs_diff_vs_first=float((out.double() - reference_out).abs().max()))
        del out
        row.update(measure(method, state, grad_out, repeats, device))
        rows.append(row)
        print(f"  {name} {label}: fwd+bwd {row['fwd_bwd_ms']:.2f} ms, {row['fwd_bwd_peak_mb']:.1f} MB", flush=True)
        del state
    return dict(size=name, dtype=str(dtype).replace("torch.", ""), **info, rows=rows)


# user level: fresh inputs every call (a previous layer allocates them), the plan built inside the call,
# out.sum().backward(); methods alternate within each round, the order reversed every other round.
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


# The targets (reported, never asserted): (size, faster method, slower method, measure, factor).
TARGETS = (
    ("lss", "native voxel_sum", "quickcumsum voxel_sum", "fwd_bwd_ms", 10),
    ("lss", "native voxel_sum", "index_add_", "fwd_bwd_ms", 2),
    ("lss", "native bev_pool", "materialise+native vs", "fwd_bwd_ms", 1),
    ("bevdet", "native bev_pool", "materialise+native vs", "fwd_bwd_peak_mb", 5),
)
USER_TARGETS = (  # the user level's, on the CPU (LSS size, wall time)
    ("LSS user level", "native voxel_sum", "quickcumsum voxel_sum", "fwd_bwd_ms", 10),
    ("LSS user level", "native voxel_sum", "index_add_", "fwd_bwd_ms", 3),
)


def targets(results, table=TARGETS) -> list[dict]:
    """Each target of `table` whose methods this run measured (fp32), with the ratio it reached; printed."""
    by = {r["size"]: {row["method"]: row for row in r["rows"]} for r in results if r["dtype"] == "float32"}
    checks = []
    for size, mine, other, key, goal in table:
        rows = by.get(size, {})
        if mine in rows and other in rows:
            ratio = rows[other][key] / rows[mine][key]
            what = "peak memory" if key.endswith("_mb") else "fwd+bwd time"
            checks.append(
                dict(target=f"{size}: {mine} {what} >= {goal}x below {other}", ratio=ratio, met=ratio >= goal)
            )
            print(f"[{'MET' if ratio >= goal else 'MISSED'}] {checks[-1]['target']}: {ratio:.2f}x")
    return checks


def parse_args(argv):
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--section", choices=["all", "methods", "user"], default="all")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (median)")
    parser.add_argument("--rounds", type=int, default=15, help="user level: alternating rounds (median)")
    parser.add_argument("--skip", nargs="*", default=[], help="method labels to skip")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), help="default: float32 on a CPU, all on a GPU")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def methods_section(args, device, repeats, report):
    """Every method at every dtype and size, recorded in `report` with the targets; prints the table."""
    methods = {k: v for k, v in METHODS.items() if k not in args.skip}
    load_at_start, results = os.getloadavg(), []
    for dtype in args.dtypes or (list(DTYPES) if device.type == "cuda" else ["float32"]):
        for name in args.sizes:
            print(f"{name} {dtype}", flush=True)
            results.append(bench_size(name, SIZES[name], device, repeats, methods, DTYPES[dtype]))
    report.update(
        load_average_at_start=load_at_start,
        load_average_at_end=os.getloadavg(),
        repeats=repeats,
        statistic=f"median of repeats, of 3 where they passed {MEASURE_BUDGET_S} s (min also recorded)",
        date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        results=results,
    )
    print("\n| size | dtype | method | fwd ms | fwd+bwd ms | fwd+bwd peak MB |\n|---|---|---|---:|---:|---:|")
    for r in results:
        for row in r["rows"]:
            print(
                f"| {r['size']} | {r['dtype']} | {row['method']} | {row['forward_ms']:.2f} | "
                f"{row['fwd_bwd_ms']:.2f} | {row['fwd_bwd_peak_mb']:.1f} |"
            )
    for r in results:
        print(
            f"{r['size']}: {r['points']} points, {r['inside_fraction']:.1%} inside, {r['occupied_voxels']} occupied "
            f"voxels, {r['points_per_occupied_voxel']:.1f} points per occupied voxel, product {r['product_mb']:.0f} MB"
        )
    report["targets"] = targets(results)


def user_section(args, device, report):
    """The user level (LSS size): median wall and CPU ms of each method's fwd+bwd over alternating rounds,
    recorded under user_level.malloc_tuned in `report`; prints its table."""
    load_at_start = os.getloadavg()
    coords, grid = real_rig_coords(SIZES["lss"], device)
    depth, feats, _ = random_inputs(coords, grid, SIZES["lss"]["channels"], device, torch.float32)
    methods = {k: v for k, v in USER_METHODS.items() if k not in args.skip}
    times = {label: [] for label in methods}
    cpu_times = {label: [] for label in methods}
    labels = list(methods)
    for r in tqdm(range(args.rounds + 1), desc="user level lss", leave=False):  # round 0 warms up
        for label in labels if r % 2 else labels[::-1]:
            state = make_state(depth, feats, coords, grid, methods[label]["leaf"])
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
    result = dict(size="lss", rows=rows)
    result["ratios"] = user_level_ratios(result)
    result["cpu_time_ratios"] = user_level_ratios(result, "fwd_bwd_cpu_ms")
    report.setdefault("user_level", {})["malloc_tuned"] = dict(
        how="fresh inputs each call (made outside the timed region), plan built in the call, out.sum().backward(); "
        "methods alternate within each round; median of the rounds after one warm-up round",
        rounds=args.rounds,
        date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        lss=result,
        load_average_at_start=load_at_start,
        load_average_at_end=os.getloadavg(),
    )
    print(f"\nLSS user level (load average {load_at_start[0]:.1f}, median of {args.rounds} rounds)")
    print("| method | fwd+bwd ms | min ms | CPU ms |\n|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['method']} | {row['fwd_bwd_ms']:.2f} | {row['fwd_bwd_ms_min']:.2f} | {row['fwd_bwd_cpu_ms']:.2f} |"
        )
    for key, ratio in result["ratios"].items():
        print(f"  {key}: {ratio:.2f}x wall, {result['cpu_time_ratios'][key]:.2f}x CPU time")
    on_cpu = [dict(size="LSS user level", dtype="float32", rows=rows)] if device.type == "cpu" else []
    report["user_level"]["malloc_tuned"]["targets"] = targets(on_cpu, USER_TARGETS)


def main(argv=None):
    """Run the requested sections, print their tables and write (or update) the JSON report."""
    args = parse_args(argv)
    malloc = tune_malloc_in_process()  # as the CPU training entry does (malloc_tuning: true)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (20 if device.type == "cuda" else 5)
    if not ops.native_available(device):
        sys.exit(f"bench_pool: error: native kernels are not available for {device}: build the extension first")
    print(f"bench_pool on {device_name(device)}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    out = args.out or RESULTS / f"bench_pool_{device.type}.json"
    # A single section updates the existing report, keeping the other section's record.
    report = read_report(out) if args.section != "all" else {}
    report.update(  # the device, software and allocator fields, refreshed by every run
        **host_versions(),
        device=str(device),
        device_name=device_name(device),
        threads=torch.get_num_threads(),
        cpu_count=os.cpu_count(),
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
        malloc={k: os.environ.get(k, str(malloc.get(k))) for k in MALLOC_ENV},
    )
    if args.section in ("all", "methods"):
        methods_section(args, device, repeats, report)
    if args.section in ("all", "user"):
        user_section(args, device, report)
    write_report(out, report)


if __name__ == "__main__":
    main()
