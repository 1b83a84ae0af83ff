"""Atomic file writes: a temporary file in the target directory, fsync, then os.replace.

A same-directory rename is atomic on POSIX filesystems, so a reader (or a crash) never sees a
half-written file, and a failed write leaves the previous file in place.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file next to `path` for writing ("wb" or "w"); on success it replaces `path`."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open writes whole files: mode must be 'wb' or 'w', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write `data` (bytes or text) to `path` atomically; returns the path."""
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    return Path(path)


def write_run_metrics(out: str | os.PathLike, record: dict[str, Any]) -> Path:
    """<out>/metrics.json: the record of one run (read by the sweep summary)."""
    return atomic_write(Path(out) / "metrics.json", json.dumps(record, indent=2, default=str))
