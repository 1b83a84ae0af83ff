"""`threads: auto`: torch's intra-op threads for CPU training, leaving a core to each loader worker
and to other processes that keep the machine's cores busy.

torch uses every core by default. On a small machine its threads and the data loader's worker
processes then contend for the same cores, and each parallel region of the model waits for its
slowest thread; other processes that keep cores busy do the same (the measurements:
docs/training-speed.md). So training re-checks, at the start and every epoch
(bev.callbacks.ThreadsFollowLoad), how many of its CPUs other processes kept busy (OtherLoad) and
gives up a thread per busy CPU (threads_for_load).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager


def cpu_set() -> set[int]:
    """The CPUs this process may run on (the affinity mask: containers and taskset included)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def available_cpus() -> int:
    return len(cpu_set())


def resolve_threads(
    threads: int | str | None, num_workers: int, accelerator: str = "cpu", devices: int | str = 1
) -> tuple[int | None, str]:
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


def follows_load(threads: int | str | None, accelerator: str = "cpu", devices: int | str = 1) -> bool:
    """Whether `threads` is auto for one CPU process, whose count then follows other processes' load."""
    one_process = not isinstance(devices, int) or devices <= 1  # DDP processes would count each other as load
    return str(threads) == "auto" and one_process and resolve_threads(threads, 0, accelerator, devices)[0] is not None


def apply_threads(
    threads: int | str | None, num_workers: int, accelerator: str = "cpu", devices: int | str = 1
) -> tuple[int | None, str | None]:
    """Set torch's intra-op threads per `threads` (resolve_threads); returns (count set or None, a line to print or None)."""
    import torch

    n, reason = resolve_threads(threads, num_workers, accelerator, devices)
    if n is None:
        return None, None
    torch.set_num_threads(n)
    return n, f"threads: {n} ({reason})"


@contextmanager
def intra_op_threads(
    threads: int | str | None, num_workers: int, accelerator: str = "cpu", devices: int | str = 1
) -> Iterator[int | None]:
    """apply_threads (printing what it set) for the duration of the block, then torch's previous count;
    yields the count set (None: torch's default kept)."""
    import torch

    before = torch.get_num_threads()
    n, line = apply_threads(threads, num_workers, accelerator, devices)
    if line:
        print(line, flush=True)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# Load of other processes on our CPUs (Linux /proc; None elsewhere)
# ---------------------------------------------------------------------------------------------
def _busy_ticks(cpus: set[int]) -> int | None:
    """Clock ticks the CPUs in `cpus` spent busy (not idle, not waiting for I/O) since boot."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
    except OSError:
        return None
    busy = 0
    for fields in lines:
        if int(fields[0][3:]) in cpus:
            ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
            busy += sum(ticks) - ticks[3] - ticks[4]
    return busy


def _own_ticks() -> int | None:
    """Clock ticks used by this process and its live children (the loader workers)."""
    me = os.getpid()
    total = 0
    try:
        pids = [pid for pid in os.listdir("/proc") if pid.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
        except OSError:
            continue  # exited meanwhile, or not ours to read
        if int(pid) == me or int(fields[1]) == me:  # fields[1] = ppid
            total += int(fields[11]) + int(fields[12])  # utime + stime
    return total


class OtherLoad:
    """CPUs (of those this process may use) kept busy by other processes since the last mark()."""

    def __init__(self, cpus: set[int] | None = None):
        self.cpus = cpus if cpus is not None else cpu_set()
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.mark()

    def mark(self) -> None:
        self._mark = (time.monotonic(), _busy_ticks(self.cpus), _own_ticks())

    def cpus_busy(self) -> float | None:
        """Average CPUs used by others since mark(), or None if /proc cannot tell (not Linux)."""
        t0, busy0, own0 = self._mark
        busy, own = _busy_ticks(self.cpus), _own_ticks()
        wall = time.monotonic() - t0
        if None in (busy0, own0, busy, own) or wall <= 0:
            return None
        return max(0.0, (busy - busy0 - (own - own0)) / self.hz / wall)


def threads_for_load(max_threads: int, others: float | None) -> int:
    """max_threads less one per CPU other processes keep busy (rounded), at least 1."""
    if others is None:
        return max_threads
    return max(1, min(max_threads, math.floor(max_threads + 0.5 - others)))
