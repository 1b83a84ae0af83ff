"""Occ3D-nuScenes files: ground truth `gts/<scene name>/<sample token>/labels.npz` (semantics, mask_lidar,
mask_camera, each (200, 200, 16) uint8, indexed [x, y, z] in the ego frame: bev.tasks.occupancy.grid) and
predictions, `<sample token>.npz` holding one (200, 200, 16) uint8 array of class ids.

The challenge writes a prediction with `np.savez_compressed(path, pred)`, so its array is stored under
numpy's default key "arr_0" (format_results in projects/mmdet3d_plugin/datasets/nuscenes_occ.py of
CVPR2023-3D-Occupancy-Prediction); SparseOcc's ray_metrics.py reads `np.load(path)["pred"]`. We write the
same array under both keys ("arr_0" first), so one folder serves both tools, and read either.

Reading opens regular files only (a named pipe is refused, never waited on), reads the .npy headers of the
arrays it needs and checks their shape and dtype before inflating their data, and never reads other members:
a file cannot make a reader hang or take more memory than its three arrays. Every bad file gets one
OccupancyFileError naming the file, what is wrong and the fix; a missing file gets a FileNotFoundError that
says where the file was expected.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import stat
import tokenize
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, BinaryIO, NamedTuple

import numpy as np

from bev.tasks.occupancy.grid import NUM_CLASSES, OCC_SHAPE
from bev.utils.io import _kind as file_kind
from bev.utils.io import atomic_write, safe_name

LABEL_KEYS = ("semantics", "mask_lidar", "mask_camera")
PREDICTION_KEY = "arr_0"  # np.savez's name for its first positional array, as the challenge saves it
SPARSEOCC_KEY = "pred"  # the key SparseOcc's ray_metrics.py loads
PREDICTION_KEYS = (PREDICTION_KEY, SPARSEOCC_KEY)
LABELS_FIX = (
    "re-extract this file from the Occ3D-nuScenes download (gts/<scene>/<sample token>/labels.npz), "
    "or rewrite it with bev.tasks.occupancy.io.write_labels"
)
PREDICTION_FIX = "rewrite it with bev.tasks.occupancy.io.write_prediction"


class OccupancyFileError(ValueError):
    """An Occ3D labels or prediction file that cannot be used; the message names the file, the problem and the fix."""


class OccLabels(NamedTuple):
    """One sample's Occ3D ground truth, indexed [x, y, z]."""

    semantics: np.ndarray  # (200, 200, 16) uint8 class ids 0..17
    mask_lidar: np.ndarray  # (200, 200, 16) bool: observed by the (accumulated) lidar
    mask_camera: np.ndarray  # (200, 200, 16) bool: observed by the current cameras (what the metric scores)


def labels_path(root: str | os.PathLike, scene_name: str, sample_token: str) -> Path:
    """<root>/gts/<scene name>/<sample token>/labels.npz (names made safe as path components)."""
    return Path(root) / "gts" / safe_name(scene_name) / safe_name(sample_token) / "labels.npz"


PREDICTIONS_DIR = "predictions"  # <out>/predictions/<sample token>.npz: the challenge's layout


def prediction_path(out_dir: str | os.PathLike, sample_token: str) -> Path:
    """<out_dir>/<sample token>.npz, the challenge's name for a prediction."""
    return Path(out_dir) / f"{safe_name(sample_token)}.npz"


# ----------------------------------------------------------------------------- checks


def check_semantics(semantics, source: str, fix: str = LABELS_FIX, name: str = "semantics") -> np.ndarray:
    """`semantics` as a (200, 200, 16) uint8 array of ids 0..17, or one OccupancyFileError about `source`."""
    a = np.asarray(semantics)
    _check_shape(a.shape, source, name, fix)
    _check_dtype(a.dtype, source, name, fix, mask=False)
    top = int(a.max())
    if top >= NUM_CLASSES:
        n = int(np.count_nonzero(a >= NUM_CLASSES))
        raise OccupancyFileError(
            f"{source}: {name} holds class id {top} ({n} voxels >= {NUM_CLASSES}); Occ3D ids are 0..{NUM_CLASSES - 1} "
            f"(17 = free): {fix}"
        )
    return a


def check_mask(mask, source: str, name: str, fix: str = LABELS_FIX) -> np.ndarray:
    """A (200, 200, 16) uint8 (or bool) 0/1 mask as bool, or one OccupancyFileError about `source`."""
    a = np.asarray(mask)
    _check_shape(a.shape, source, name, fix)
    _check_dtype(a.dtype, source, name, fix, mask=True)
    if a.dtype == np.bool_:
        return a
    if int(a.max()) > 1:
        bad = np.unique(a[a > 1])[:5].tolist()
        raise OccupancyFileError(f"{source}: {name} must hold only 0 and 1, found {bad}: {fix}")
    return a.astype(bool)


def _check_shape(shape: tuple[int, ...], source: str, name: str, fix: str) -> None:
    if tuple(shape) != OCC_SHAPE:
        raise OccupancyFileError(f"{source}: {name} has shape {tuple(shape)}, expected {OCC_SHAPE} ([x, y, z]): {fix}")


def _check_dtype(dtype: np.dtype, source: str, name: str, fix: str, mask: bool) -> None:
    """uint8 class ids, or for a mask uint8 0/1 or bool."""
    if dtype == np.uint8 or (mask and dtype == np.bool_):
        return
    expected = "uint8 0/1" if mask else "uint8 class ids"
    raise OccupancyFileError(f"{source}: {name} has dtype {dtype}, expected {expected}: {fix}")


# ----------------------------------------------------------------------------- reading


def _one_line(e: BaseException, limit: int = 200) -> str:
    """An error's text on one short line (numpy's header errors span lines and quote the header)."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "..."


@contextlib.contextmanager
def _read_errors(path: Path, fix: str) -> Iterator[None]:
    """One OccupancyFileError for whatever the zip and zlib layers raise on a damaged archive."""
    try:
        yield
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise OccupancyFileError(
            f"{path}: is a damaged .npz archive, truncated or corrupt ({_one_line(e)}): {fix}"
        ) from None
    except (NotImplementedError, RuntimeError) as e:  # a compression method zipfile lacks, an encrypted member
        raise OccupancyFileError(f"{path}: is an .npz archive numpy cannot unpack ({_one_line(e)}): {fix}") from None
    except OSError as e:
        raise OccupancyFileError(f"{path}: cannot be read ({e.strerror or e}): {fix}") from None


def _open_regular(path: Path, fix: str) -> BinaryIO:
    """`path` opened for reading if it is a regular file. O_NONBLOCK lets a named pipe be opened (and refused)
    at once, where a plain open would wait for a writer that never comes; fstat of the open file leaves no gap
    between the check and the read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(f"no Occ3D file at {path}: {fix}") from None
    except OSError as e:
        raise OccupancyFileError(f"{path}: cannot be read ({e.strerror or e}): {fix}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise OccupancyFileError(f"{path}: cannot be read: it is {file_kind(mode)}, not a regular file: {fix}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _npy_header(member: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran order, dtype) from the .npy header at the start of `member` (numpy caps its length)."""
    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(member)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(member)
    raise ValueError(f".npy format version {version[0]}.{version[1]}, expected 1.0 or 2.0")


class _Npz:
    """An .npz archive opened to read only the arrays asked for. Each member's .npy header (shape, dtype) is
    checked before any of its data is inflated, so a member that declares or inflates to gigabytes is refused
    at the cost of its header, and members nobody asked for are never read."""

    def __init__(self, path: Path, fix: str) -> None:
        self.path, self.fix = path, fix
        self._file = _open_regular(path, fix)
        try:
            with _read_errors(path, fix):
                head = self._file.read(6)
                if head.startswith(b"\x93NUMPY"):
                    raise OccupancyFileError(
                        f"{path}: is a single .npy array, not an .npz archive of named arrays: {fix}"
                    )
                if not head.startswith(b"PK"):
                    raise OccupancyFileError(
                        f"{path}: is not an .npz file (a zip archive); it starts with {head!r}: {fix}"
                    )
                self._file.seek(0)
                self._zip = zipfile.ZipFile(self._file)
        except BaseException:
            self._file.close()
            raise
        # np.load's names: a member "x.npy" is array "x"
        self.members = {n.removesuffix(".npy"): n for n in self._zip.namelist()}

    def __enter__(self) -> _Npz:
        return self

    def __exit__(self, *exc) -> None:
        self._zip.close()
        self._file.close()

    def read(self, key: str, name: str, mask: bool) -> np.ndarray:
        """Array `key` (called `name` in messages), after its header shows OCC_SHAPE and a uint8 (or, for a mask,
        bool) dtype and its member the matching size; read to the member's end so that zipfile checks its CRC."""
        member, where = self.members[key], f"{self.path}: {name}"
        with _read_errors(self.path, self.fix), self._zip.open(member) as f:
            try:
                shape, fortran, dtype = _npy_header(f)
            except (ValueError, SyntaxError, RecursionError, tokenize.TokenError) as e:  # numpy parses it as Python
                raise OccupancyFileError(
                    f"{where}: is not a readable .npy array ({_one_line(e)}): {self.fix}"
                ) from None
            if dtype.hasobject:  # unpickling could run code: never loaded
                raise OccupancyFileError(f"{where}: holds objects numpy cannot load without pickle: {self.fix}")
            _check_shape(shape, str(self.path), name, self.fix)
            _check_dtype(dtype, str(self.path), name, self.fix, mask)
            nbytes = math.prod(shape) * dtype.itemsize
            held = self._zip.getinfo(member).file_size - f.tell()
            if held != nbytes:  # the zip's record of the member's size, checked before inflating any of it
                problem = "is truncated" if held < nbytes else "holds more than its array"
                raise OccupancyFileError(
                    f"{where}: {problem}: its header declares {shape} {dtype} ({nbytes} bytes) but {member} holds "
                    f"{held} bytes of data: {self.fix}"
                )
            data = f.read(nbytes)
            if len(data) != nbytes or f.read(1):
                raise zipfile.BadZipFile(f"{member} holds other than the {nbytes} bytes the zip records")
        a = np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran else "C")
        return a.copy()  # writable and C-ordered, as np.load's


def read_labels(path: str | os.PathLike) -> OccLabels:
    """One labels.npz, checked: the three arrays (200, 200, 16) uint8, ids 0..17, masks 0/1 (returned as bool).
    Other members of the archive are never read."""
    path = Path(path)
    with _Npz(path, LABELS_FIX) as npz:
        missing = [k for k in LABEL_KEYS if k not in npz.members]
        if missing:
            raise OccupancyFileError(
                f"{path}: missing array(s) {missing} (has {sorted(npz.members)}); an Occ3D labels.npz holds "
                f"{list(LABEL_KEYS)}: {LABELS_FIX}"
            )
        sem, lidar, camera = (npz.read(k, k, mask=k != "semantics") for k in LABEL_KEYS)
    return OccLabels(
        check_semantics(sem, str(path)),
        check_mask(lidar, str(path), "mask_lidar"),
        check_mask(camera, str(path), "mask_camera"),
    )


def read_prediction(path: str | os.PathLike) -> np.ndarray:
    """One prediction (a (200, 200, 16) uint8 array of ids 0..17 under the challenge's key "arr_0", SparseOcc's
    "pred", or both holding the same array), checked. Other members of the archive are never read."""
    path = Path(path)
    with _Npz(path, PREDICTION_FIX) as npz:
        keys = [k for k in PREDICTION_KEYS if k in npz.members]
        if not keys:
            raise OccupancyFileError(
                f"{path}: holds no prediction: expected an array {PREDICTION_KEY!r} (the challenge's key) or "
                f"{SPARSEOCC_KEY!r} (SparseOcc's), found {sorted(npz.members)}: {PREDICTION_FIX}"
            )
        arrays = [npz.read(k, f"the prediction {k!r}", mask=False) for k in keys]
    if len(arrays) == 2 and not np.array_equal(*arrays):
        raise OccupancyFileError(
            f"{path}: its arrays {PREDICTION_KEY!r} and {SPARSEOCC_KEY!r} differ, so the challenge and SparseOcc "
            f"would score different predictions: {PREDICTION_FIX}"
        )
    return check_semantics(arrays[0], str(path), PREDICTION_FIX, f"the prediction {keys[0]!r}")


# ----------------------------------------------------------------------------- writing


def _npz_bytes(**arrays: np.ndarray) -> bytes:
    """An .npz archive (what np.savez_compressed writes: one deflated NAME.npy per array) at zlib level 1:
    occupancy volumes are mostly one value, and level 1 packs them nearly as small at a fraction of the time."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for name, a in arrays.items():
            with z.open(f"{name}.npy", "w") as f:
                np.lib.format.write_array(f, np.ascontiguousarray(a), allow_pickle=False)
    return buf.getvalue()


def write_labels(path: str | os.PathLike, semantics, mask_lidar, mask_camera) -> Path:
    """Write one labels.npz atomically (checked first: a bad array is refused, not written). Masks may be bool."""
    path = Path(path)
    src = f"labels for {path}"
    sem = check_semantics(semantics, src, "pass (200, 200, 16) uint8 ids 0..17")
    masks = {
        k: check_mask(m, src, k, "pass (200, 200, 16) bool or 0/1 uint8")
        for k, m in (("mask_lidar", mask_lidar), ("mask_camera", mask_camera))
    }
    data = _npz_bytes(semantics=sem, **{k: m.astype(np.uint8) for k, m in masks.items()})
    return atomic_write(path, data)


def write_prediction(out_dir: str | os.PathLike, sample_token: str, semantics) -> Path:
    """Write <out_dir>/<sample token>.npz atomically: one uint8 array under the challenge's key "arr_0" and again
    under SparseOcc's "pred". Zip members deflate independently, so the copy doubles the file (about 12 KB to
    25 KB for a prediction like the synthetic world's labels)."""
    path = prediction_path(out_dir, sample_token)
    src, fix = f"prediction for {path}", "pass (200, 200, 16) integer ids 0..17"
    a = np.asarray(semantics)
    if np.issubdtype(a.dtype, np.integer) and a.dtype != np.uint8 and a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi >= NUM_CLASSES:
            raise OccupancyFileError(f"{src}: the prediction holds class id {hi if hi >= NUM_CLASSES else lo}: {fix}")
        a = a.astype(np.uint8)  # e.g. an argmax's int64: the same ids
    sem = check_semantics(a, src, fix, "the prediction")
    return atomic_write(path, _npz_bytes(**dict.fromkeys(PREDICTION_KEYS, sem)))
