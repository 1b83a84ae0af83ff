"""bev.utils: the one atomic-write helper."""
from __future__ import annotations

import pytest

from bev.utils.io import atomic_open, atomic_write


def test_atomic_write_text_and_bytes(tmp_path):
    p = tmp_path / "sub" / "a.json"
    atomic_write(p, "hello")
    assert p.read_text() == "hello"
    atomic_write(p, b"\x00\x01")
    assert p.read_bytes() == b"\x00\x01"
    assert [q.name for q in p.parent.iterdir()] == ["a.json"]  # no temporary file left


def test_failed_write_keeps_the_old_file(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_open(p, "w") as f:
            f.write("half")
            raise RuntimeError("crash mid-write")
    assert p.read_text() == "old"
    assert [q.name for q in tmp_path.iterdir()] == ["a.txt"]


def test_atomic_open_rejects_append(tmp_path):
    with pytest.raises(ValueError, match="whole files"):
        with atomic_open(tmp_path / "a", "a"):
            pass
