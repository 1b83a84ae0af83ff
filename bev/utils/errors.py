"""One clear line for a failed command; the full traceback goes to <run>/error.txt."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig

from bev.utils.config import is_multirun, output_dir, task_overrides
from bev.utils.io import (
    atomic_write,
    check_output,
    check_output_folder,
    claim_run_dir,
    disk_full_error,
    release_run_dir,
    write_run_metrics,
)


def one_line(e: BaseException) -> str:
    """`Type: message` of an exception, unwrapping Hydra's instantiation wrapper and worker tracebacks."""
    msg = str(e).strip()
    # Hydra wraps errors raised while instantiating; the cause carries the useful message.
    cause = e.__cause__ or e.__context__
    if type(e).__name__ == "InstantiationException" and cause is not None:
        return f"{msg.splitlines()[0] if msg else ''} {one_line(cause)}".strip()
    if "Traceback (most recent call last)" in msg:  # errors re-raised from worker processes
        msg = msg.strip().splitlines()[-1]
    # OmegaConf appends "full_key: ... / object_type=..." lines: keep the first line and the key.
    if type(e).__module__.startswith("omegaconf") and msg:
        first, key = msg.splitlines()[0], getattr(e, "full_key", None)
        msg = f"{first} (config key {key})" if key and key not in first else first
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _save_traceback(out: Path | None) -> str:
    """Write the current traceback to <out>/error.txt; returns where it went, for the message."""
    if out is None:
        return ""
    try:
        atomic_write(out / "error.txt", traceback.format_exc())
    except OSError as w:  # e.g. the disk that just filled up
        return f" (the traceback could not be saved to {out / 'error.txt'}: {w.strerror or w}; HYDRA_FULL_ERROR=1 prints it)"
    return f" (traceback in {out / 'error.txt'})"


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
            except KeyboardInterrupt:  # Ctrl-C outside training (bev-train stops its training loop itself)
                print(f"\n{prog}: interrupted (SIGINT): stopped before finishing", file=sys.stderr, flush=True)
                sys.exit(130)
            except Exception as e:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                out = output_dir(cfg)
                # A full disk met by any writer (a logger, metrics.json) gets the free space and the fix too.
                msg = one_line(disk_full_error(getattr(e, "filename", None) or out or ".", e) or e)
                where = _save_traceback(out)
                print(f"{prog}: error: {msg}{where}", file=sys.stderr, flush=True)
                if is_multirun():
                    if out is not None:
                        with contextlib.suppress(OSError):  # the disk may be full: the message above is what counts
                            write_run_metrics(
                                out, {"status": f"failed: {msg[:300]}", "metrics": {}, "overrides": task_overrides()}
                            )
                    return float("nan")
                sys.exit(1)

        return run

    return wrap


def unwritable_dir(path: str | os.PathLike) -> str | None:
    """Why files cannot be created in directory `path` (made if missing), or None when they can."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return None


class RunDirCheck(HydraCallback):
    """Hydra callback, before Hydra writes anything in the run directory: check that the run (sweep) directory is
    writable (else a raw "Unable to configure handler 'file'" traceback), that no link there leads Hydra's files out
    of it, and for bev-train, lock it (a directory another run holds is refused, untouched)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.run.dir")
        self._refuse_links_out(config)
        if config.get("task_name") == "train":
            self._claim(config)

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.get("task_name") == "train":  # bev-train's run took the claim over and dropped it: this is a no-op
            release_run_dir(config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.sweep.dir")

    @staticmethod
    def _claim(config: DictConfig) -> None:
        """Lock the run directory for this bev-train now, before Hydra writes its .hydra/ files and log there: a run
        into a directory another one holds is refused without touching it, and of two started at once into one new
        directory, the one refused finds the other's lock, not its files (bev-train's run_dir_lock keeps the claim)."""
        from lightning.pytorch.utilities import rank_zero_only

        if rank_zero_only.rank != 0:  # a multi-process run's other processes, started into rank 0's locked directory
            return
        try:
            claim_run_dir(config.hydra.run.dir)
        except RuntimeError as e:
            print(f"bev-train: error: {e}", file=sys.stderr, flush=True)
            sys.exit(1)

    @staticmethod
    def _refuse_links_out(config: DictConfig) -> None:
        """Hydra writes .hydra/*.yaml and <job>.log in the run directory, following links: refuse a link there that
        would make it write elsewhere (a user's file out of the run directory replaced), before it writes."""
        run = Path(config.hydra.run.dir)
        try:
            if config.hydra.output_subdir is not None:
                saved = check_output_folder(run, run / config.hydra.output_subdir, "run's composed config files")
                for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
                    check_output(saved / name)
            check_output(run / f"{config.hydra.job.name}.log")
        except (OSError, ValueError) as e:
            print(f"bev-{config.task_name}: error: {e}", file=sys.stderr, flush=True)
            sys.exit(1)

    @staticmethod
    def _check(config: DictConfig, key: str) -> None:
        from omegaconf import OmegaConf

        path = OmegaConf.select(config, key)
        why = unwritable_dir(path) if path else None
        if why:
            what = "sweep" if "sweep" in key else "run"
            print(
                f"bev-{config.task_name}: error: cannot write the {what} directory {path} ({why}). "
                f"Pass {key}=<a writable directory>.",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(1)
