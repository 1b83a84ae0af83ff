"""What the benchmark scripts share: the allocator re-exec, the host's versions, the JSON report.

The bench_*.py scripts import it as a sibling module (each puts scripts/ on sys.path first). torch is
imported only inside host_versions, so that a script may re-exec with the allocator settings before
torch loads.
"""

from __future__ import annotations

import json
import os
import platform
import sys

from bev.utils.io import atomic_write
from bev.utils.malloc import MALLOC_ENV


def reexec_with_malloc_env(script: str) -> None:
    """Restart `script` once with bev-train's allocator settings (glibc reads them only at start-up)."""
    if sys.platform.startswith("linux") and not all(k in os.environ for k in MALLOC_ENV):
        sys.stdout.flush()  # exec drops whatever is still buffered
        os.execve(
            sys.executable, [sys.executable, os.path.abspath(script), *sys.argv[1:]], {**MALLOC_ENV, **os.environ}
        )


def malloc_env() -> dict[str, str | None]:
    """The allocator variables of MALLOC_ENV as this process sees them (None: unset)."""
    return {k: os.environ.get(k) for k in MALLOC_ENV}


def host_versions() -> dict[str, str]:
    """Python and torch versions and the machine type, for a report's host record."""
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine()}


def write_report(path, report: dict) -> None:
    """Write `report` to `path` as indented JSON, atomically (a reader never sees half a report)."""
    atomic_write(path, json.dumps(report, indent=2) + "\n")


def processor_name() -> str:
    """The CPU's model name ("" where /proc/cpuinfo does not say)."""
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return ""


def checkout_commit() -> str | None:
    """The checkout's commit, "+dirty" with uncommitted changes to bev/, configs/ or scripts/; None outside git."""
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.strip()
        diff = ["git", "diff", "--quiet", "HEAD", "--", "bev", "configs", "scripts"]
        dirty = subprocess.run(diff, cwd=repo).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")
