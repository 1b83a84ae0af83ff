"""What a call allocates, for benchmarks and tests (timings stay in the benchmarks)."""

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
