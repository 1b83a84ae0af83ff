"""Atomic file writes: a temporary file in the target directory, fsync, then os.replace.

A same-directory rename is atomic on POSIX filesystems, so a reader (or a crash) never sees a
half-written file, and a failed write leaves the previous file in place. A write that fails because
the disk is full can be turned into one DiskFullError naming the path, the free space and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

# torch's zip writer reports a failed file.write as "unexpected pos" and may drop the OSError; such a
# failure counts as a full disk when less than this is left on the filesystem.
NEARLY_FULL_BYTES = 64 << 20
RUN_DIR_FIX = (
    "free some space there, or point paths.output_dir elsewhere (hydra.run.dir=<a directory on a disk with room>)"
)


def _new_temporary(path: Path) -> tuple[int, Path]:
    """A new ".<name>.<random>.tmp" beside `path`, created with mode 0o666 so that the umask applies
    (tempfile.mkstemp makes every file 0o600)."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary file name beside {path}")


class NotARegularFileError(OSError):
    """An output path names something other than a regular file (a link, a device, a fifo, a folder)."""


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def check_output(path: str | os.PathLike, overwrite: bool = True, key: str = "") -> Path:
    """`path` if a file may be written there: nothing is there, or a regular file (and `overwrite`).

    The rename that ends an atomic write replaces whatever the name points to, so a symbolic link, a device
    node, a named pipe or a folder there is refused (as root, out=/dev/null would replace /dev/null). `key`
    names the setting the path came from (out, hydra.run.dir), for the fix."""
    path = Path(path)
    setting = f"{key}={str(path)!r}" if key else str(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    if not stat.S_ISREG(mode):
        raise NotARegularFileError(
            f"{setting} is {_kind(mode)}, not a regular file: an output only ever replaces a regular file. "
            f"Write to another path" + (f" ({key}=<a new file>)" if key else ""),
        )
    if not overwrite:
        raise FileExistsError(
            f"{setting} exists: pass overwrite=true to replace it, or write to another path"
            + (f" ({key}=<a new file>)" if key else ""),
        )
    return path


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", overwrite: bool = True) -> Iterator[IO]:
    """Open a temporary file next to `path` for writing ("wb" or "w"); on success it replaces `path`.

    Only a regular file is ever replaced (check_output); with overwrite=False an existing one is refused too,
    before writing and again at the end (then without a window: the file is linked in, never renamed over)."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open writes whole files: mode must be 'wb' or 'w', got {mode!r}")
    path = check_output(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_temporary(path)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        check_output(path, overwrite)  # again: something may have appeared there while we wrote
        with contextlib.suppress(FileNotFoundError):  # a replaced file keeps its mode
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
        _put_in_place(tmp, path, overwrite)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _put_in_place(tmp: Path, path: Path, overwrite: bool) -> None:
    """Rename tmp to path; without overwrite as a hard link, which fails if path exists (no check-then-rename race)."""
    if not overwrite:
        try:
            os.link(tmp, path)
        except FileExistsError:
            check_output(path, overwrite)  # the clear error
            raise
        except OSError:  # a file system without hard links: the check above has to do
            pass
        else:
            tmp.unlink()
            return
    os.replace(tmp, path)


def inside(root: str | os.PathLike, path: str | os.PathLike) -> Path:
    """`path` (a file to write under `root`) if its folder stays inside `root` with symbolic links followed;
    else a clear error, so that outputs never follow a link out of the folder a user named."""
    path = Path(path)
    _stays_inside(root, path.parent, f"{path} would be written to {path.parent.resolve() / path.name}")
    return path


def check_output_folder(root: str | os.PathLike, folder: str | os.PathLike, made_for: str = "outputs") -> Path:
    """`folder` (a folder of `made_for` under `root`) if files may be written in it: nothing is there yet, or a
    folder whose real place, symbolic links followed, stays inside `root`. Else one clear error, raised before any
    work: a link that leads out of `root` (ValueError), or a file, a device or a dangling link there
    (NotADirectoryError)."""
    folder = Path(folder)
    _stays_inside(root, folder, f"{folder} leads to {folder.resolve()}")
    if os.path.lexists(folder) and not folder.is_dir():
        raise NotADirectoryError(
            f"{folder} is {_not_folder_kind(folder)}, not a folder: it is where the {made_for} go. Move it away, or "
            "choose another output folder"
        )
    return folder


def _not_folder_kind(path: Path) -> str:
    if path.is_symlink():
        return "a symbolic link to a file" if path.exists() else "a symbolic link to nothing"
    mode = os.lstat(path).st_mode
    return "a file" if stat.S_ISREG(mode) else _kind(mode)


def _stays_inside(root: str | os.PathLike, folder: Path, where: str) -> None:
    """Refuse a folder (to write in) whose real place, symbolic links followed, is outside `root`."""
    real_root, real = Path(root).resolve(), folder.resolve()
    if real != real_root and real_root not in real.parents:
        raise ValueError(
            f"{where}, outside {root}: a symbolic link inside {root} leads out of it. Outputs never follow a link "
            "out of their folder: remove the link or choose another folder"
        )


_NAME_CHARS = re.compile(r"[^A-Za-z0-9._+-]")
MAX_NAME_CHARS = 120  # leaves room for prefixes and suffixes within the usual 255-byte limit


def safe_name(name: object) -> str:
    """A file name made from data (a sample token, a scene name): one path component, never "." or "..",
    never hidden, so out / safe_name(x) stays inside out. Letters, digits and ._+- are kept; a name that
    had to change gets a short hash of the original, so distinct names stay distinct files."""
    text = str(name)
    safe = _NAME_CHARS.sub("_", text).lstrip(".")[:MAX_NAME_CHARS] or "_"
    if safe == text:
        return safe
    return f"{safe}-{hashlib.sha1(text.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"


STALE_TEMP_S = 300  # a live atomic_open keeps writing its temporary file; one untouched this long is a killed write's


def remove_stale_temporaries(folder: str | os.PathLike, min_age_s: float = STALE_TEMP_S) -> list[Path]:
    """Delete the temporary files of atomic_open left in `folder` by killed writes (".<name>.<random>.tmp",
    untouched for min_age_s); returns them. A write still in progress is left alone."""
    import time

    removed = []
    for tmp in Path(folder).glob(".*.tmp"):
        try:
            if tmp.is_file() and time.time() - tmp.stat().st_mtime >= min_age_s:
                tmp.unlink()
                removed.append(tmp)
        except OSError:  # gone meanwhile, or not ours to delete: leave it
            continue
    return removed


def atomic_write(path: str | os.PathLike, data: bytes | str, overwrite: bool = True) -> Path:
    """Write `data` (bytes or text) to `path` atomically (atomic_open); returns the path."""
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w", overwrite) as f:
        f.write(data)
    return Path(path)


def write_run_metrics(out: str | os.PathLike, record: dict[str, Any]) -> Path:
    """<out>/metrics.json: the record of one run (read by the sweep summary)."""
    return atomic_write(Path(out) / "metrics.json", json.dumps(record, indent=2, default=str))


class DiskFullError(OSError):
    """A write failed because its filesystem is full; the message names the path, the free space and the fix."""


def _no_space_in_chain(e: BaseException | None) -> bool:
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return False


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the filesystem holding `path` (or its nearest existing parent); None if unknown."""
    for p in (Path(path), *Path(path).parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def disk_full_error(path: str | os.PathLike, e: BaseException, fix: str = RUN_DIR_FIX) -> DiskFullError | None:
    """The DiskFullError to raise instead of `e` when `e`, raised while writing `path`, comes from a full disk.

    Full means ENOSPC/EDQUOT somewhere in the exception chain, or a short-write failure of torch's
    writer ("unexpected pos") with less than NEARLY_FULL_BYTES left. Otherwise None.
    """
    if isinstance(e, DiskFullError):
        return None
    free = free_bytes(path)
    short_write = "unexpected pos" in str(e) or "PytorchStreamWriter failed" in str(e)
    if not (_no_space_in_chain(e) or (short_write and free is not None and free < NEARLY_FULL_BYTES)):
        return None
    left = f"{format_bytes(free)} free on that filesystem" if free is not None else "free space unknown"
    return DiskFullError(errno.ENOSPC, f"No space left on device while writing {path} ({left}): {fix}")


@contextlib.contextmanager
def explain_disk_full(path: str | os.PathLike, fix: str = RUN_DIR_FIX) -> Iterator[None]:
    """Re-raise a failure caused by a full disk while writing `path` as one DiskFullError (see disk_full_error)."""
    try:
        yield
    except Exception as e:
        full = disk_full_error(path, e, fix)
        if full is None:
            raise
        raise full from e


LOCK_NAME = ".bev-train.lock"


# Run folders whose lock this process took ahead of its run (claim_run_dir), with the open lock file that holds it.
_CLAIMED: dict[Path, IO] = {}


def _take_lock(folder: str | os.PathLike) -> IO:
    """Open `folder`'s lock file and lock it for this process; the open file holds the lock until it is closed, or
    the process ends however it ends (no stale lock). A RuntimeError naming the holder if another one has it."""
    import fcntl

    path = Path(folder) / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        raise RuntimeError(in_use_message(folder, holder)) from None
    except OSError as e:  # a file system without locks (some network mounts): train unlocked
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            f.close()
            raise
    f.seek(0)
    f.truncate()
    f.write(f"bev-train pid {os.getpid()}")
    f.flush()
    return f


def claim_run_dir(folder: str | os.PathLike) -> None:
    """Take `folder`'s run_dir_lock now, ahead of the run, and keep it: Hydra's RunDirCheck calls this before Hydra
    writes .hydra/ and the log there, so that of two runs started at once into one folder the refused one writes
    nothing. The run's run_dir_lock takes the claim over; release_run_dir drops one that no run took."""
    key = Path(folder).resolve()
    if key not in _CLAIMED:
        _CLAIMED[key] = _take_lock(folder)


def release_run_dir(folder: str | os.PathLike) -> None:
    """Drop this process's claim on `folder` (claim_run_dir), if it holds one."""
    f = _CLAIMED.pop(Path(folder).resolve(), None)
    if f is not None:
        f.close()


@contextlib.contextmanager
def run_dir_lock(folder: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on a run directory while training writes into it; a second process that
    wants the same directory gets a clear error instead of mixing its files in. A lock this process claimed
    before the run started (claim_run_dir) is the one held, and dropped at the end."""
    claimed = Path(folder).resolve() in _CLAIMED
    f = None if claimed else _take_lock(folder)
    try:
        yield
    finally:
        if claimed:
            release_run_dir(folder)
        else:
            f.close()


def in_use_message(folder: str | os.PathLike, holder: str) -> str:
    return (
        f"run directory {str(folder)!r} is in use by {holder or 'another process'}: wait for that run to end, or train "
        "into another directory (hydra.run.dir=...)"
    )
