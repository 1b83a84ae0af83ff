"""What a call allocates, the family of a profiled op and the matrix-product rate, for benchmarks and tests
(timings stay in the benchmarks)."""

from __future__ import annotations

from collections.abc import Callable


def peak_cpu_bytes(fn: Callable[[], object]) -> int:
    """Peak of torch's CPU allocations while fn() runs, its result dropped at the end; what
    existed before the call (its inputs) is not counted."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # Raw allocation (+bytes) / free (-bytes) records, in time order.
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


# A profiled op's family: the first whose patterns ("|"-separated) one is in the op's name; the rest "other".
OP_FAMILIES = {
    "convolution": "conv|mkldnn_linear|addmm|matmul|::mm|::bmm",
    "batch_norm": "batch_norm",
    "voxel pooling": "bev::",
    "optimizer": "adam|_foreach|clip_grad|norm",
    "copies and layout": "copy|contiguous|clone|cat|stack|index|gather|scatter|::to|as_strided",
    "allocation": "empty|zeros|ones|fill|resize",
    "elementwise": "add|mul|sub|div|relu|threshold|sigmoid|exp|log|where|clamp|silu|upsample|pool|sum|mean",
}


def op_family(name: str) -> str:
    """The family (OP_FAMILIES) of a torch.profiler op name such as aten::mkldnn_convolution."""
    low = name.lower()
    return next((f for f, patterns in OP_FAMILIES.items() if any(p in low for p in patterns.split("|"))), "other")


def matmul_rate(dtype, device: str = "cpu", n: int = 2048, repeats: int = 5) -> float:
    """The device's rate for torch's n x n matrix product in `dtype`, GFLOP/s (median of `repeats`): the yardstick of
    a convolution-bound step's arithmetic rate (oneDNN's convolutions may beat the product's kernel)."""
    import statistics
    import time

    import torch

    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    times = []
    for _ in range(repeats + 1):  # the first warms up
        t0 = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return round(2 * n**3 / statistics.median(times[1:]) / 1e9, 1)
