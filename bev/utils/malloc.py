"""Allocator tuning for CPU training.

glibc returns freed blocks to the OS (munmap / heap trim) on every large free, so each step
page-faults its activations back in; keeping them mapped removes that kernel time on CPU.
"""
from __future__ import annotations

import os
import sys

MALLOC_ENV = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 34),
    "MALLOC_TOP_PAD_": str(1 << 28),
}


def tune_malloc(module: str) -> None:
    """Re-exec the interpreter once as `python -m module` with MALLOC_ENV set (glibc reads it only at start-up).

    Set BEV_MALLOC_TUNING=0 to skip. Variables the user set already are kept.
    """
    if not sys.platform.startswith("linux") or os.environ.get("BEV_MALLOC_TUNING", "1") == "0":
        return
    if all(k in os.environ for k in MALLOC_ENV):
        return
    env = {**MALLOC_ENV, **os.environ}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)
