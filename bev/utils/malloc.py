"""Allocator tuning for CPU training and benchmarks.

glibc returns every freed block above its mmap threshold (up to 32 MB) to the OS (munmap, heap
trim), so each training step or op call page-faults its large buffers back in: at the LSS
pooling size that page-fault time was most of a voxel_sum forward+backward. Keeping freed
memory mapped removes it. tune_malloc_in_process() sets glibc's mallopt parameters in the
running process (no re-exec; measured identical to setting MALLOC_ENV before start-up).

bev.ops does not call it on import: it changes the whole process's allocator (memory freed is
kept for reuse, not returned to the OS), a choice for the application (the training entry and
the benchmarks make it), not for a library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# mallopt parameter numbers (glibc malloc.h), the environment variable each one mirrors, and
# our value. M_TRIM_THRESHOLD is an int here, so "never trim" is its largest value.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
MALLOPT = {
    "MALLOC_MMAP_MAX_": (M_MMAP_MAX, 0),  # no mmap'd blocks: large buffers come from the heap
    "MALLOC_TRIM_THRESHOLD_": (M_TRIM_THRESHOLD, 2**31 - 1),  # never shrink the heap
    "MALLOC_TOP_PAD_": (M_TOP_PAD, 1 << 28),  # grow the heap 256 MB at a time
}
# The same settings as environment variables, for processes started from the shell.
MALLOC_ENV = {name: str(value) for name, (_, value) in MALLOPT.items()}


def tune_malloc_in_process() -> dict[str, int]:
    """Keep freed memory mapped in this process (glibc mallopt); returns the settings applied.

    Settings whose environment variable the user set are left as glibc read them. Returns {}
    off Linux/glibc. Call it once, early (memory already returned to the OS is not affected); it
    is safe to call again. bev-train calls it when the config says `malloc_tuning: true`.
    """
    if not sys.platform.startswith("linux"):
        return {}
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = {}
    for name, (param, value) in MALLOPT.items():
        if name not in os.environ and mallopt(param, value) == 1:
            applied[name] = value
    return applied
