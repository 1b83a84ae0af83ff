"""`threads: auto`: torch's intra-op threads for CPU training, leaving a core to each loader worker.

torch uses every core by default. On a small machine its threads and the data loader's worker
processes then contend for the same cores, and each parallel region of the model waits for its
slowest thread: on 2 cores, 2 threads + 1 worker ran the embedded default at 0.232 s/step, 1
thread + 1 worker at 0.204 s/step (same machine, same run length).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def available_cpus() -> int:
    """CPUs this process may run on (the affinity mask: containers and taskset included)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def resolve_threads(threads: int | str | None, num_workers: int, accelerator: str = "cpu",
                    devices: int | str = 1) -> tuple[int | None, str]:
    """(intra-op threads to set or None to leave torch's default, reason) for the `threads` config key.

    auto: on the CPU, each of `devices` processes gets an equal share of the available CPUs less
    one per loader worker (at least 1), unless OMP_NUM_THREADS is set (then the user's choice
    stands); on GPUs torch's default.
    """
    if threads is None:
        return None, "torch default"
    if str(threads) != "auto":
        try:
            n = int(threads)
        except (TypeError, ValueError):
            n = 0
        if n < 1:
            raise ValueError(f"threads must be a positive integer, auto or null, got {threads!r}")
        return n, "as configured"
    if accelerator == "auto":
        import torch

        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if accelerator != "cpu":
        return None, f"torch default on accelerator {accelerator!r}"
    if os.environ.get("OMP_NUM_THREADS"):
        return None, f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} set"
    cpus = available_cpus()
    procs = devices if isinstance(devices, int) and devices > 0 else 1
    n = max(1, cpus // procs - max(0, int(num_workers)))
    share = f"{cpus} CPUs / {procs} processes" if procs > 1 else f"{cpus} CPUs"
    return n, f"{share} less {num_workers} loader worker(s)"


def apply_threads(threads: int | str | None, num_workers: int, accelerator: str = "cpu",
                  devices: int | str = 1) -> str | None:
    """Set torch's intra-op threads per `threads` (resolve_threads); returns a line to print, or None."""
    import torch

    n, reason = resolve_threads(threads, num_workers, accelerator, devices)
    if n is None:
        return None
    torch.set_num_threads(n)
    return f"threads: {n} ({reason})"


@contextmanager
def intra_op_threads(threads: int | str | None, num_workers: int, accelerator: str = "cpu",
                     devices: int | str = 1) -> Iterator[None]:
    """apply_threads (printing what it set) for the duration of the block, then torch's previous count."""
    import torch

    before = torch.get_num_threads()
    line = apply_threads(threads, num_workers, accelerator, devices)
    if line:
        print(line, flush=True)
    try:
        yield
    finally:
        torch.set_num_threads(before)
