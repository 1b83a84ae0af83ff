"""One clear line for a failed command; the full traceback goes to <run>/error.txt."""
from __future__ import annotations

import functools
import os
import sys
import traceback
from typing import Any, Callable

from omegaconf import DictConfig

from bev.utils.config import is_multirun, output_dir, task_overrides
from bev.utils.io import atomic_write, write_run_metrics


def one_line(e: BaseException) -> str:
    """`Type: message` of an exception, unwrapping Hydra's instantiation wrapper and worker tracebacks."""
    msg = str(e).strip()
    # Hydra wraps errors raised while instantiating; the cause carries the useful message.
    cause = e.__cause__ or e.__context__
    if type(e).__name__ == "InstantiationException" and cause is not None:
        return f"{msg.splitlines()[0] if msg else ''} {one_line(cause)}".strip()
    if "Traceback (most recent call last)" in msg:  # errors re-raised from worker processes
        msg = msg.strip().splitlines()[-1]
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def report_errors(prog: str) -> Callable:
    """Turn an exception in a task into one short paragraph on stderr and exit status 1.

    The full traceback goes to <run>/error.txt; HYDRA_FULL_ERROR=1 re-raises instead. In a sweep
    a failed run is recorded (metrics.json status) and the sweep goes on.
    """

    def wrap(task: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
        @functools.wraps(task)
        def run(cfg: DictConfig) -> Any:
            try:
                return task(cfg)
            except KeyboardInterrupt:
                raise
            except Exception as e:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                where = ""
                out = output_dir(cfg)
                if out is not None:
                    atomic_write(out / "error.txt", traceback.format_exc())
                    where = f" (traceback in {out / 'error.txt'})"
                print(f"{prog}: error: {one_line(e)}{where}", file=sys.stderr, flush=True)
                if is_multirun():
                    if out is not None:
                        write_run_metrics(out, {"status": f"failed: {one_line(e)[:300]}", "metrics": {}, "overrides": task_overrides()})
                    return float("nan")
                sys.exit(1)

        return run

    return wrap
