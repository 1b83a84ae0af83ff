"""The split index's cache: one .npz per version, split and class list under <dataroot>/.bev_cache (or
cache_dir), keyed by the index format, the split, the classes and the content of the table (and map)
files, and checked against a checksum of its arrays when loaded. No pickle: a cache file found in a
downloaded dataroot must not be able to run code when loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bev.utils.io import atomic_open, atomic_write

INDEX_FORMAT = 9  # 9: tables validated at build (types, intrinsics, sizes, time order): older caches are rebuilt


def cache_key(
    dataroot: str | os.PathLike,
    table_root: Path,
    version: str,
    split: str,
    groups,
    layers: tuple[str, ...],
    cache_root: Path,
) -> dict:
    """What a cached index must match: format, split, classes, the tables' and the map files' contents."""
    key = {
        "format": INDEX_FORMAT,
        "version": version,
        "split": split,
        "categories": [list(g) for g in groups],
        "tables": _content_signature(list(table_root.glob("*.json")), cache_root),
    }
    if layers:
        maps = list((Path(dataroot) / "maps" / "expansion").glob("*.json"))
        key.update(map_layers=list(layers), maps=_content_signature(maps, cache_root))
    return key


def cache_file(dataroot: str | os.PathLike, cache_dir: str | os.PathLike | None, key: dict) -> Path:
    """Where the index of `key` is cached: one file per version, split and class list."""
    classes = [key["categories"], key.get("map_layers", [])]
    cat_hash = hashlib.sha1(json.dumps(classes).encode()).hexdigest()[:10]
    return cache_root(dataroot, cache_dir) / f"{key['version']}__{key['split']}__{cat_hash}.npz"


def cache_root(dataroot: str | os.PathLike, cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else Path(dataroot) / ".bev_cache"


def read_cache(cache_file: Path, key: dict) -> dict | None:
    """The cached index when cache_file holds one of this key, else None."""
    if not cache_file.is_file():
        return None
    try:
        return _load_npz(cache_file, key)
    except Exception as e:  # a corrupt cache is rebuilt, never fatal
        warnings.warn(f"ignoring unreadable index cache {cache_file} (rebuilt from the tables): {e}", stacklevel=2)
        return None


def save_npz(index: dict, key: dict, path: Path) -> None:
    """Write the index atomically as .npz (no pickle: a cache file found in a downloaded dataroot
    must not be able to run code when loaded)."""
    with atomic_open(path, "wb") as f:
        np.savez(
            f,
            __key__=np.asarray(json.dumps(key, sort_keys=True)),
            __digest__=np.asarray(_arrays_digest(index)),
            **index,
        )


def _load_npz(path: Path, key: dict) -> dict | None:
    """The cached index, or None when its key differs (stale); ValueError when its arrays do not match
    the checksum written with them (edited, damaged, an array missing)."""
    with np.load(path, allow_pickle=False) as z:
        if str(z["__key__"]) != json.dumps(key, sort_keys=True):
            return None
        index = {k: z[k] for k in z.files if k not in ("__key__", "__digest__")}
        if "__digest__" not in z.files or str(z["__digest__"]) != _arrays_digest(index):
            raise ValueError("its arrays do not match the checksum written with them (edited or damaged)")
        return index


def _content_signature(files: Sequence[Path], memo_dir: Path) -> dict[str, str]:
    """The content digest of each file, by name. Sizes and mtimes survive cp -a, tar and edits that restore
    them, so the key is the content; a digest is rehashed only when a file's size, mtime, ctime or inode
    changed (memo in memo_dir/table_digests.json; the kernel sets ctime, no copy can carry it over)."""
    memo_file = memo_dir / "table_digests.json"
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    sig, fresh = {}, {}
    for p in sorted(files):
        st = p.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        known = memo.get(str(p.resolve()))
        digest = known["digest"] if isinstance(known, dict) and known.get("stamp") == stamp else _file_digest(p)
        sig[p.name], fresh[str(p.resolve())] = digest, {"stamp": stamp, "digest": digest}
    if fresh != {k: memo.get(k) for k in fresh}:
        with contextlib.suppress(OSError):  # a read-only mount: hashed again next time
            atomic_write(memo_file, json.dumps({**memo, **fresh}))
    return sig


def _file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _arrays_digest(index: dict) -> str:
    """A checksum of the index arrays (names, dtypes, shapes, bytes): what a loaded cache must match."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(index):
        a = np.ascontiguousarray(index[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()
