"""Environmental faults get one clear message naming the path and the fix: a full disk while saving a
checkpoint, an unwritable run directory, a truncated nuScenes table. Faults are injected (monkeypatched
writers, a path under a regular file), never produced for real (no disk filling; tests run as root, so
chmod cannot make a directory unwritable)."""

from __future__ import annotations

import errno
from collections import namedtuple

import pytest
import torch

from bev.callbacks import AtomicCheckpointIO
from bev.data.index import load_index
from bev.utils import io as bev_io
from helpers.cli import TINY, assert_one_paragraph, eval_cli, train_cli
from helpers.tiny_nuscenes import write_tiny

_Usage = namedtuple("_Usage", "total used free")
UNEXPECTED_POS = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def enospc_save(obj, f, *args, **kwargs):
    """torch.save on a full disk: the zip writer turns the OSError of file.write into a RuntimeError."""
    f.write(b"partial")
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        raise RuntimeError(UNEXPECTED_POS) from None


def bare_unexpected_pos(obj, f, *args, **kwargs):
    """The same failure with the OSError lost (e.g. a C++ writer that only saw a short write)."""
    f.write(b"partial")
    raise RuntimeError(UNEXPECTED_POS)


def plain_enospc(obj, f, *args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


# ----------------------------------------------------------------------------- full disk
@pytest.mark.parametrize("save", [enospc_save, plain_enospc])
def test_checkpoint_on_a_full_disk_names_path_free_space_and_fix(save, tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "save", save)
    path = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(OSError) as e:
        AtomicCheckpointIO().save_checkpoint({"state_dict": {}}, path)
    msg = str(e.value)
    assert e.value.errno == errno.ENOSPC
    assert str(path) in msg and "free" in msg and "paths.output_dir" in msg, msg
    assert list(path.parent.iterdir()) == []  # the partial temporary file is gone


def test_writer_failure_without_errno_is_diagnosed_from_the_free_space(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "save", bare_unexpected_pos)
    monkeypatch.setattr(bev_io.shutil, "disk_usage", lambda p: _Usage(100 << 30, (100 << 30) - 4096, 4096))
    path = tmp_path / "last.ckpt"
    with pytest.raises(OSError, match="No space left") as e:
        AtomicCheckpointIO().save_checkpoint({"state_dict": {}}, path)
    assert str(path) in str(e.value) and "4.0 KiB free" in str(e.value)


def test_writer_failure_with_free_space_is_not_called_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "save", bare_unexpected_pos)
    monkeypatch.setattr(bev_io.shutil, "disk_usage", lambda p: _Usage(100 << 30, 50 << 30, 50 << 30))
    with pytest.raises(RuntimeError, match="unexpected pos"):
        AtomicCheckpointIO().save_checkpoint({"state_dict": {}}, tmp_path / "last.ckpt")


@pytest.mark.e2e
def test_training_on_a_full_disk_ends_with_one_clear_message(synthetic_root, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch, "save", enospc_save)
    run = tmp_path / "run"
    args = [*TINY, "callbacks.bev_png.every_n_steps=0", f"data.dataroot={synthetic_root}", f"hydra.run.dir={run}"]
    assert train_cli(args, monkeypatch) == 1
    err = capsys.readouterr().err
    err = err[err.find("bev-train: error:") :]  # after the indexing progress of the first use of the dataset
    assert_one_paragraph(err, "bev-train: error:", "No space left", str(run / "checkpoints"), "paths.output_dir")
    assert "unexpected pos" in (run / "error.txt").read_text()  # the full story stays in error.txt


@pytest.mark.e2e
def test_error_report_survives_a_full_disk(tmp_path, monkeypatch, capsys):
    """When even error.txt cannot be written, the one-line message still comes out."""
    from bev.utils import errors

    def no_space(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(errors, "atomic_write", no_space)
    assert (
        train_cli(
            ["experiment=synthetic_cpu", f"data.dataroot={tmp_path}/none", f"hydra.run.dir={tmp_path}"], monkeypatch
        )
        == 1
    )
    assert_one_paragraph(capsys.readouterr().err, "bev-train: error:", f"{tmp_path}/none", "error.txt")


# ----------------------------------------------------------------------------- unwritable run directory
@pytest.mark.e2e
@pytest.mark.parametrize("cli", [train_cli, eval_cli])
def test_unwritable_run_dir(cli, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file.txt"  # a directory cannot be made under a regular file, even by root
    blocker.write_text("not a directory")
    run = blocker / "run"
    args = ["experiment=synthetic_cpu"] if cli is train_cli else [f"ckpt_path={tmp_path}/x.ckpt"]
    assert cli([*args, f"hydra.run.dir={run}"], monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "error:", str(run), "hydra.run.dir=")


@pytest.mark.e2e
def test_read_only_run_dir(tmp_path, monkeypatch, capsys):
    """An existing directory that refuses new files (a read-only mount; root ignores chmod, so patched)."""
    import tempfile

    real = tempfile.TemporaryFile
    run = tmp_path / "ro"
    run.mkdir()

    def refuse(*args, dir=None, **kwargs):
        if dir is not None and str(dir) == str(run):
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    assert train_cli(["experiment=synthetic_cpu", f"hydra.run.dir={run}"], monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-train: error:", str(run), "Read-only", "hydra.run.dir=")


@pytest.mark.e2e
def test_unwritable_sweep_dir(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file.txt"
    blocker.write_text("")
    assert (
        train_cli(["-m", "experiment=synthetic_cpu", "seed=1,2", f"hydra.sweep.dir={blocker}/sweep"], monkeypatch) == 1
    )
    assert_one_paragraph(capsys.readouterr().err, str(blocker / "sweep"), "hydra.sweep.dir=")


# ----------------------------------------------------------------------------- damaged tables
@pytest.fixture()
def tiny(tmp_path):
    return write_tiny(tmp_path / "nuscenes", samples=1)


def test_truncated_table_is_named(tiny, tmp_path):
    table = tiny / "v1.0-mini" / "sample_data.json"
    text = table.read_text()
    table.write_text(text[: len(text) // 2])  # an interrupted download
    with pytest.raises(ValueError) as e:
        load_index(tiny, "v1.0-mini", "mini_train", cache_dir=tmp_path / "cache", verbose=False)
    msg = str(e.value)
    assert str(table) in msg and "re-download" in msg, msg
    assert "line" in msg  # where in the file it broke


def test_read_only_index_cache_is_only_a_warning(tiny, tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="cache_dir"):
        index = load_index(tiny, "v1.0-mini", "mini_train", cache_dir=blocker / "cache", verbose=False)
    assert len(index["sample_token"]) == 1


@pytest.mark.e2e
def test_eval_without_a_checkpoint(tmp_path, monkeypatch, capsys):
    assert eval_cli([f"hydra.run.dir={tmp_path}"], monkeypatch) == 1
    err = capsys.readouterr().err
    assert_one_paragraph(err, "bev-eval: error:", "ckpt_path=")
    assert len(err.strip().splitlines()) == 1 and "full_key" not in err  # OmegaConf's detail lines stay in error.txt
