"""Files the project writes respect the umask (tempfile.mkstemp would make them all 0600), and a replaced
file keeps its mode: metrics, checkpoints, predictions, exports and the synthetic set's tables."""

import os
import stat

import pytest
import torch

from bev.callbacks import AtomicCheckpointIO
from bev.utils.io import atomic_open, atomic_write


@pytest.fixture
def umask():
    """Set the process umask for one test (restored after)."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002, 0o027], ids=oct)
def test_new_files_get_the_umask(mask, umask, tmp_path):
    umask(mask)
    atomic_write(tmp_path / "metrics.json", "{}")
    with atomic_open(tmp_path / "sub" / "pred.npz", "wb") as f:
        f.write(b"x")
    AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(2)}, tmp_path / "last.ckpt")
    for name in ("metrics.json", "sub/pred.npz", "last.ckpt"):
        assert mode(tmp_path / name) == 0o666 & ~mask, name
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_replaced_file_keeps_its_mode(umask, tmp_path):
    umask(0o022)
    path = atomic_write(tmp_path / "metrics.json", "{}")
    os.chmod(path, 0o640)
    atomic_write(path, '{"a": 1}')
    assert mode(path) == 0o640 and path.read_text() == '{"a": 1}'


def test_the_synthetic_tables_get_the_umask(synthetic_root):
    mask = os.umask(0)
    os.umask(mask)  # the fixture was written by this process, under this umask
    tables = sorted((synthetic_root / "v1.0-mini").glob("*.json")) + sorted((synthetic_root / "maps").rglob("*.json"))
    assert tables and {mode(t) for t in tables} == {0o666 & ~mask}
