"""Hostile Occ3D files for the reader tests: .npz archives with chosen members (arrays, raw .npy bytes, or streams
of chunks that inflate to gigabytes without the test holding them), and a guard that unblocks a read waiting on a
named pipe, so that a reader that regresses fails the test instead of hanging the suite."""

from __future__ import annotations

import io
import itertools
import os
import threading
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

GIB = 1 << 30
CHUNK = bytes(16 << 20)


def npy_header(shape: tuple[int, ...], dtype=np.uint8) -> bytes:
    """A version 1.0 .npy header declaring `shape` and `dtype` (no data)."""
    buf = io.BytesIO()
    descr = np.lib.format.dtype_to_descr(np.dtype(dtype))
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def raw_npy_header(text: str) -> bytes:
    """A version 1.0 .npy header holding `text` as its dictionary, whatever it says (padded as numpy pads)."""
    body = text.encode("latin1")
    body += b" " * ((64 - (10 + len(body) + 1) % 64) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body


def zeros_member(declared: int, actual: int | None = None) -> Iterable[bytes]:
    """A uint8 .npy member declaring `declared` elements followed by `actual` (default: as many) zero bytes."""
    n = declared if actual is None else actual
    full, rest = divmod(n, len(CHUNK))
    return itertools.chain([npy_header((declared,))], itertools.repeat(CHUNK, full), [bytes(rest)])


def write_npz(path: Path, members: dict[str, np.ndarray | bytes | Iterable[bytes]], mode: str = "w") -> Path:
    """An .npz (a zip of deflated members) with `members`: an array is written as np.savez writes it, under
    NAME.npy; bytes or chunks are written as they are, under the name as given."""
    with zipfile.ZipFile(path, mode, zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for name, m in members.items():
            if isinstance(m, np.ndarray):
                with z.open(f"{name}.npy", "w") as f:
                    np.lib.format.write_array(f, m, allow_pickle=False)
                continue
            with z.open(name, "w", force_zip64=True) as f:
                for chunk in [m] if isinstance(m, bytes) else m:
                    f.write(chunk)
    return path


def renamed(src: Path, dst: Path, old: str, new: str) -> Path:
    """A copy of the archive `src` with its member `old` named `new` (the same length): the name is stored twice,
    in the member's local header and in the central directory, so a gigabyte member is deflated once for all."""
    assert len(old) == len(new)
    data = src.read_bytes()
    assert data.count(old.encode()) == 2, "the member name must occur in its two headers only"
    dst.write_bytes(data.replace(old.encode(), new.encode()))
    return dst


def run_guarded(read: Callable[[], object], fifo: Path, timeout_s: float = 10.0) -> tuple[bool, BaseException | None]:
    """Run read() in a thread; (whether it waited past timeout_s, what it raised). A read still blocked then is
    a reader waiting for a writer on `fifo`: one opens and closes the pipe so the thread ends either way."""
    raised: list[BaseException] = []

    def target() -> None:
        try:
            read()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            raised.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    hung = thread.is_alive()
    if hung:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the blocked open returns; its read sees EOF
        thread.join(timeout_s)
    return hung, raised[0] if raised else None
