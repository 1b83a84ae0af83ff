"""What the benchmark scripts share: the allocator re-exec, the host's versions, the step benchmarks' command
line, the GPU wait and the JSON report.

The bench_*.py scripts import it as a sibling module (each puts scripts/ on sys.path first). torch is
imported only inside its functions, so that a script may re-exec with the allocator settings before
torch loads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from bev.utils.io import atomic_write
from bev.utils.malloc import MALLOC_ENV

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


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
    """Python and torch versions, the machine type and the CPU's model, for a report's host record."""
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": processor_name(),
    }


def device_name(device) -> str:
    """The GPU's name on a CUDA device, else the CPU's model name."""
    import torch

    return torch.cuda.get_device_name(device) if str(device).startswith("cuda") else processor_name()


def sync(device) -> None:
    """Wait for the GPU's queued work on a CUDA device, so that a clock read next covers it."""
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def step_parser(doc: str, steps: int, warmup: int) -> argparse.ArgumentParser:
    """The command line the training-step benchmarks share: --steps, --warmup, --threads, --device, --out."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=steps, help="measured steps per variant (medians)")
    p.add_argument("--warmup", type=int, default=warmup, help="unmeasured steps per variant (the first compiles)")
    p.add_argument("--threads", type=int, default=2, help="torch's CPU threads")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default=None, help="default: benchmarks/results/<script>_<device>.json")
    return p


def write_report(path, report: dict) -> None:
    """Write `report` to `path` as indented JSON, atomically (a reader never sees half a report), and say so."""
    atomic_write(path, json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


def read_report(path) -> dict:
    """The report at `path`, for a run of one section to update; {} where there is none."""
    path = Path(path)
    return json.loads(path.read_text()) if path.is_file() else {}


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
