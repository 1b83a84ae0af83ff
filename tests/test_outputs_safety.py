"""Outputs never replace what they should not, and a checkpoint decides nothing about where files go.

- Every writer (bev.utils.io.atomic_open: bev-export, bev-predict, bev-eval and the rest) replaces only a
  regular file: a symbolic link, a device node, a named pipe or a folder at the path is refused.
- The user-named outputs of bev-export, bev-predict and bev-eval are never replaced unasked: an existing
  one is refused unless overwrite=true.
- Settings that name places on disk (data.dataroot, data.cache_dir, paths.*, ...) never come from a
  checkpoint's stored config.
"""

import json
import os
import re
import stat
from pathlib import Path

import pytest

from bev import eval as bev_eval
from bev import export as bev_export
from bev import predict_cli
from bev.utils.io import NotARegularFileError, atomic_write
from helpers.cli import assert_one_paragraph, eval_cli, run_cli


def _special(kind: str, path: Path, tmp_path: Path) -> Path:
    """A non-regular file at `path`: a symbolic link to a file, a named pipe, a folder or a character device."""
    if kind == "symlink":
        target = tmp_path / "target.txt"
        target.write_text("the user's")
        path.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        try:  # the kind of node /dev/null is (1, 3), in a temporary folder: replacing it would harm nothing
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("making a device node needs root")
    return path


def _same_kind(path: Path, kind: str) -> bool:
    mode = os.lstat(path).st_mode
    test = {"symlink": stat.S_ISLNK, "fifo": stat.S_ISFIFO, "folder": stat.S_ISDIR, "device": stat.S_ISCHR}[kind]
    return test(mode)


KINDS = ["symlink", "fifo", "folder", "device"]


# ------------------------------------------------------------------------------ the atomic-write helper


@pytest.mark.parametrize("kind", KINDS)
def test_atomic_write_replaces_only_a_regular_file(kind, tmp_path):
    path = _special(kind, tmp_path / "out.bin", tmp_path)
    with pytest.raises(NotARegularFileError, match=f"{path}.* is a .*not a regular file") as e:
        atomic_write(path, b"x" * 100)
    assert len(str(e.value).splitlines()) == 1
    assert _same_kind(path, kind)
    assert not list(tmp_path.glob(".*.tmp"))  # refused before a temporary file was made
    if kind == "symlink":
        assert (tmp_path / "target.txt").read_text() == "the user's"


def test_atomic_write_without_overwrite_keeps_an_existing_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text("the user's")
    with pytest.raises(FileExistsError, match="exists: pass overwrite=true"):
        atomic_write(path, "new", overwrite=False)
    assert path.read_text() == "the user's"
    atomic_write(tmp_path / "fresh.json", "new", overwrite=False)  # a new file is written
    assert (tmp_path / "fresh.json").read_text() == "new"
    atomic_write(path, "new")  # the rewrite of a run's own files (caches, metrics.json) goes on
    assert path.read_text() == "new" and not list(tmp_path.glob(".*.tmp"))


def test_a_file_that_appears_while_writing_is_not_replaced_without_overwrite(tmp_path):
    from bev.utils.io import atomic_open

    path = tmp_path / "out.bin"
    with pytest.raises(FileExistsError):
        with atomic_open(path, "wb", overwrite=False) as f:
            f.write(b"ours")
            path.write_bytes(b"someone else's")
    assert path.read_bytes() == b"someone else's" and not list(tmp_path.glob(".*.tmp"))


# ------------------------------------------------------------------------------ bev-export


def export_cli(args, monkeypatch):
    return run_cli(bev_export._hydra_main, args, monkeypatch)


@pytest.mark.parametrize("kind", ["existing", "fifo", "device", "symlink"])
def test_bev_export_never_replaces_what_is_at_out(kind, tiny_run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "model.pt2"
    if kind == "existing":
        out.write_bytes(b"the user's earlier export")
    else:
        _special(kind, out, tmp_path)
    args = [f"ckpt_path={tiny_run}", f"out={out}", "format=torch_export", f"hydra.run.dir={tmp_path / 'run'}"]
    assert export_cli(args, monkeypatch) == 1
    err = capsys.readouterr().err
    assert_one_paragraph(err, "bev-export: error:", f"out={str(out)!r}")
    assert ("overwrite=true" in err) == (kind == "existing")
    if kind == "existing":
        assert out.read_bytes() == b"the user's earlier export"
    else:
        assert _same_kind(out, kind) and "not a regular file" in err
        assert export_cli([*args, "overwrite=true"], monkeypatch) == 1  # overwrite=true replaces files only
        assert _same_kind(out, kind)


def test_bev_export_overwrite_true_replaces_an_earlier_export(tiny_run, tmp_path, monkeypatch):
    out = tmp_path / "model.pt2"
    out.write_bytes(b"an earlier export")
    args = [f"ckpt_path={tiny_run}", f"out={out}", "format=torch_export", "check=false", "overwrite=true"]
    assert export_cli([*args, f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch) == 0
    assert out.stat().st_size > 1000 and not list(tmp_path.glob(".*.tmp"))


# ------------------------------------------------------------------------------ bev-predict


def _predict_args(tiny_run, synthetic_root, out, tmp_path):
    return [
        f"ckpt_path={tiny_run}",
        f"data.dataroot={synthetic_root}",
        f"out={out}",
        "scene=scene-0103",
        "gif=false",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]


def test_bev_predict_refuses_to_replace_an_earlier_runs_files(tiny_run, synthetic_root, tmp_path, monkeypatch, capsys):
    out = tmp_path / "pred"
    args = _predict_args(tiny_run, synthetic_root, out, tmp_path)
    assert run_cli(predict_cli._hydra_main, args, monkeypatch) == 0
    npz = sorted(out.rglob("*.npz"))
    assert len(npz) == 3
    npz[0].write_bytes(b"the user's edit")
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert run_cli(predict_cli._hydra_main, args, monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-predict: error:", f"out={str(out)!r}", "overwrite=true")
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before  # nothing written
    assert run_cli(predict_cli._hydra_main, [*args, "overwrite=true"], monkeypatch) == 0
    assert npz[0].read_bytes() != b"the user's edit"


def test_bev_predict_never_replaces_a_link_in_out(tiny_run, synthetic_root, tmp_path, monkeypatch, capsys):
    out = tmp_path / "pred"
    out.mkdir()
    _special("symlink", out / "predictions.json", tmp_path)
    args = [*_predict_args(tiny_run, synthetic_root, out, tmp_path), "png=false", "overwrite=true"]
    assert run_cli(predict_cli._hydra_main, args, monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-predict: error:", "predictions.json", "not a regular file")
    assert _same_kind(out / "predictions.json", "symlink") and (tmp_path / "target.txt").read_text() == "the user's"
    assert not list(out.rglob("*.npz"))


# ------------------------------------------------------------------------------ bev-eval


def test_bev_eval_refuses_to_replace_an_earlier_evaluation(tiny_run, synthetic_root, tmp_path, monkeypatch, capsys):
    out = tmp_path / "eval"
    out.mkdir()
    (out / "metrics.json").write_text('{"the user": "earlier metrics"}')
    args = [f"ckpt_path={tiny_run}", f"data.dataroot={synthetic_root}", "num_pngs=1", f"hydra.run.dir={out}"]
    assert eval_cli(args, monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-eval: error:", "metrics.json", "overwrite=true")
    assert json.loads((out / "metrics.json").read_text()) == {"the user": "earlier metrics"}
    assert not (out / "sample_000.png").exists()
    assert eval_cli([*args, "overwrite=true"], monkeypatch) == 0  # a re-evaluation the user asked for
    assert json.loads((out / "metrics.json").read_text())["checkpoint"].endswith(".ckpt")
    assert (out / "sample_000.png").is_file()


def test_bev_eval_never_replaces_a_device_node(tiny_run, synthetic_root, tmp_path, monkeypatch, capsys):
    out = tmp_path / "eval"
    out.mkdir()
    _special("fifo", out / "sample_000.png", tmp_path)
    args = [f"ckpt_path={tiny_run}", f"data.dataroot={synthetic_root}", "num_pngs=1", f"hydra.run.dir={out}"]
    assert eval_cli([*args, "overwrite=true"], monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-eval: error:", "sample_000.png", "a named pipe")
    assert _same_kind(out / "sample_000.png", "fifo") and not (out / "metrics.json").exists()


def test_bev_eval_lists_the_files_it_writes():
    names = [p.name for p in bev_eval.output_files(Path("x"), 2)]
    assert names == ["metrics.json", "results_nusc.json", "metrics_summary.json", "sample_000.png", "sample_001.png"]


@pytest.mark.parametrize("main", [bev_export, predict_cli, bev_eval])
def test_overwrite_must_be_a_boolean(main, tmp_path, monkeypatch, capsys):
    args = ["ckpt_path=x.ckpt", f"out={tmp_path / 'o.onnx'}", "overwrite=maybe", f"hydra.run.dir={tmp_path}"]
    if main is bev_eval:
        args = [a for a in args if not a.startswith("out=")]
    assert run_cli(main._hydra_main, args, monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "error:", "overwrite='maybe'")


# ------------------------------------------------------------------------------ places from a checkpoint


def _with_stored(tiny_run: Path, tmp_path: Path, **data) -> Path:
    """tiny_run's last.ckpt with `data` written into its stored data config (what a shared file may carry)."""
    import torch

    ckpt = torch.load(tiny_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    ckpt["bev_config"]["data"].update(data)
    ckpt["bev_config"]["paths"] = {"output_dir": str(tmp_path / "stored_out"), "data_dir": str(tmp_path / "d")}
    ckpt["bev_config"]["model"]["init_from"] = str(tmp_path / "stored_init.ckpt")
    path = tmp_path / "shared.ckpt"
    torch.save(ckpt, path)
    return path


def test_a_checkpoint_names_no_place_on_disk(tiny_run, tmp_path):
    from omegaconf import OmegaConf

    from bev.inference import build_data_config, load_checkpoint

    path = _with_stored(tiny_run, tmp_path, cache_dir=str(tmp_path / "stored_cache"), dataroot="/stored/root")
    loaded = load_checkpoint(path)
    run = loaded.run_config
    assert run.data.cache_dir is None and run.data.dataroot is None and run.model.init_from is None
    assert set(run.paths.values()) == {None} and loaded.model.init_from is None
    assert loaded.model_config.get("init_from") is None
    assert loaded.run_config.data.final_dim == [32, 96]  # the other settings stay the checkpoint's
    data = build_data_config(OmegaConf.create({"dataroot": str(tmp_path)}), run)
    assert data.dataroot == str(tmp_path) and data.cache_dir is None


def test_bev_predict_writes_no_cache_where_a_checkpoint_says(tiny_run, synthetic_root, tmp_path, monkeypatch):
    stored_cache = tmp_path / "stored_cache"
    path = _with_stored(tiny_run, tmp_path, cache_dir=str(stored_cache))
    args = [*_predict_args(path, synthetic_root, tmp_path / "pred", tmp_path), "png=false"]
    assert run_cli(predict_cli._hydra_main, args, monkeypatch) == 0
    assert not stored_cache.exists() and not (tmp_path / "stored_out").exists()
    assert len(list((tmp_path / "pred").rglob("*.npz"))) == 3


def test_bev_eval_takes_the_data_folder_from_the_command_only(tiny_run, synthetic_root, tmp_path, monkeypatch, capsys):
    path = _with_stored(tiny_run, tmp_path, dataroot=str(synthetic_root), cache_dir=str(tmp_path / "stored_cache"))
    out = tmp_path / "eval"
    assert eval_cli([f"ckpt_path={path}", "num_pngs=0", f"hydra.run.dir={out}"], monkeypatch) == 1
    err = capsys.readouterr().err
    assert_one_paragraph(err, "bev-eval: error:", "data.dataroot=", f"trained on {str(synthetic_root)!r}")
    assert not (tmp_path / "stored_cache").exists() and not (out / "metrics.json").exists()


# ------------------------------------------------------------------------------ checkpoints that inflate


def _inflating(tiny_run: Path, tmp_path: Path, numel: int) -> Path:
    """tiny_run's last.ckpt with an extra tensor of `numel` zeros no loader uses, its entries deflated (a few
    kB on disk)."""
    import zipfile

    import torch

    ckpt = torch.load(tiny_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    ckpt["unused"] = torch.zeros(numel)
    plain, deflated = tmp_path / "plain.ckpt", tmp_path / "deflated.ckpt"
    torch.save(ckpt, plain)
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(deflated, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
    return deflated


def test_a_checkpoint_that_inflates_is_refused_before_reading(tiny_run, tmp_path, monkeypatch):
    import bev
    from bev.utils import checkpoint
    from bev.utils.checkpoint import CheckpointError

    path = _inflating(tiny_run, tmp_path, 4 << 20)  # 16 MiB of float32 in a file of about 0.4 MB
    monkeypatch.setattr(checkpoint, "MAX_INFLATION_BYTES", 8 << 20)  # the limit scaled down with the test
    monkeypatch.setattr("torch.load", lambda *a, **k: pytest.fail("torch.load read an inflating checkpoint"))
    with pytest.raises(CheckpointError) as e:
        bev.load_model(path)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and str(path) in msg, msg
    assert re.search(r"declare 16\.\d MiB of data in a file of \d+\.\d KiB", msg), msg  # 16 MiB + the weights


def test_a_checkpoint_within_the_limit_still_loads(tiny_run, tmp_path, monkeypatch):
    import bev
    from bev.utils import checkpoint

    path = _inflating(tiny_run, tmp_path, 1 << 20)  # 4 MiB beyond the file's size
    monkeypatch.setattr(checkpoint, "MAX_INFLATION_BYTES", 8 << 20)
    assert bev.load_model(path).net is not None


def test_a_dropped_place_is_not_named_as_a_model_difference(tiny_run, tmp_path):
    from omegaconf import OmegaConf

    from bev.inference import load_checkpoint
    from bev.utils.checkpoint import CheckpointError

    path = _with_stored(tiny_run, tmp_path)  # its model config names an init_from checkpoint
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, OmegaConf.create({"net": {"camera": {"context_channels": 16}}}))
    assert "model.net.camera.context_channels: 8 -> 16" in str(e.value) and "init_from" not in str(e.value)


@pytest.mark.parametrize("key", ["version", "val_split", "train_split"])
@pytest.mark.parametrize("value", ["../../elsewhere", "v1.0-mini/../../x", "..", "a\\b"])
def test_a_stored_name_that_is_a_path_is_refused(key, value, tmp_path):
    from omegaconf import OmegaConf

    from bev.inference import build_data_config

    data = {"_target_": "bev.data.NuScenesDataModule", "version": "v1.0-mini", "final_dim": [32, 96], key: value}
    run = OmegaConf.create({"grid": None, "data": data})
    with pytest.raises(ValueError, match=f"the checkpoint's data.{key} .* is not a plain name.*Pass data.{key}="):
        build_data_config(OmegaConf.create({"dataroot": str(tmp_path)}), run)
    given = {"dataroot": str(tmp_path), key: "v1.0-mini" if key == "version" else "mini_val"}
    assert build_data_config(OmegaConf.create(given), run)[key] == given[key]  # the user's own value is used
