"""bev-make-synthetic --no-occupancy / --occupancy-only: a set written without the Occ3D labels is every other file
of a full write, byte for byte, and adding the labels later gives the full write's files, its manifest included;
a set written otherwise (another writer, other parameters) is refused with nothing written."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from bev.synthetic import samples, writer
from bev.synthetic.writer import MANIFEST, STAGING, NotTheSameSet, add_occupancy, make_synthetic

ARGS = {"scenes": 2, "samples_per_scene": 2, "seed": 0, "render_scale": 4}
CLI = ["--scenes", "2", "--samples-per-scene", "2", "--seed", "0", "--render-scale", "4"]


def _tree(root: Path) -> dict[str, str]:
    """Every file under root (relative path) -> md5 of its bytes."""
    return {
        p.relative_to(root).as_posix(): hashlib.md5(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """(a full write, the same written with --no-occupancy): 2 scenes x 2 samples at render scale 4."""
    root = tmp_path_factory.mktemp("occ_flags")
    full = make_synthetic(root / "full", workers=1, progress=False, **ARGS)
    bare = make_synthetic(root / "bare", workers=2, progress=False, occupancy=False, **ARGS)
    return full, bare


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_no_occupancy_writes_everything_else_the_same(sets):
    full, bare = sets
    assert not (bare / "gts").exists()
    full_files, bare_files = _tree(full), _tree(bare)
    labels = {f for f in full_files if f.startswith("gts/")}
    assert len(labels) == 4 and all(f.endswith("/labels.npz") for f in labels)
    assert bare_files.keys() == full_files.keys() - labels
    assert {f: h for f, h in bare_files.items() if f != MANIFEST} == {
        f: h for f, h in full_files.items() if f not in labels and f != MANIFEST
    }
    full_m, bare_m = (json.loads((r / MANIFEST).read_text()) for r in (full, bare))
    assert full_m["parameters"] == {**ARGS, "occupancy": True, "image_size": "full", "lidar_sweeps": 0}
    assert bare_m["parameters"] == {**ARGS, "occupancy": False, "image_size": "full", "lidar_sweeps": 0}
    assert set(bare_m["files"]) == set(full_m["files"]) - labels


def test_occupancy_only_adds_the_labels_of_a_full_write(sets, tmp_path, capsys):
    full, bare = sets
    out = _copy(bare, tmp_path / "set")
    assert writer.main(["--out", str(out), *CLI, "--workers", "2", "--occupancy-only"]) == 0
    assert "added the occupancy labels of 4 samples" in capsys.readouterr().err
    assert _tree(out) == _tree(full)  # gts/ and the manifest too; nothing else touched
    assert not (out / STAGING).exists()
    # Once there, nothing to do (a full write too).
    assert add_occupancy(out, workers=1, progress=False, **ARGS) == 0
    assert add_occupancy(_copy(full, tmp_path / "full"), workers=1, progress=False, **ARGS) == 0
    assert writer.main(["--out", str(out), *CLI, "--occupancy-only"]) == 0
    assert "nothing written" in capsys.readouterr().err


def test_an_interrupted_occupancy_only_leaves_no_gts_and_is_run_again(sets, tmp_path, monkeypatch):
    """The labels go to a staging folder moved to gts/ once all are there: a gts/ folder is always whole."""
    full, bare = sets
    out = _copy(bare, tmp_path / "set")
    real, calls = samples._occupancy_task, []

    def fail_second(task):
        calls.append(task)
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        return real(task)

    monkeypatch.setattr(samples, "_occupancy_task", fail_second)
    with pytest.raises(RuntimeError, match="interrupted"):
        add_occupancy(out, workers=1, progress=False, **ARGS)
    assert not (out / "gts").exists() and (out / STAGING).is_dir()
    monkeypatch.setattr(samples, "_occupancy_task", real)
    assert add_occupancy(out, workers=1, progress=False, **ARGS) == 4
    assert _tree(out) == _tree(full)
    # --overwrite after an interruption removes the staged labels too.
    again = _copy(bare, tmp_path / "again")
    monkeypatch.setattr(samples, "_occupancy_task", fail_second)
    calls.clear()
    with pytest.raises(RuntimeError, match="interrupted"):
        add_occupancy(again, workers=1, progress=False, **ARGS)
    make_synthetic(again, workers=1, progress=False, occupancy=False, overwrite=True, **ARGS)
    assert _tree(again) == _tree(bare)


def _refused(out: Path, match: str, **kwargs) -> None:
    before = _tree(out) if out.exists() else None
    with pytest.raises(NotTheSameSet, match=match):
        add_occupancy(out, workers=1, progress=False, **{**ARGS, **kwargs})
    assert (_tree(out) if out.exists() else None) == before  # nothing written


def test_occupancy_only_refuses_a_set_it_did_not_write(tmp_path, sets):
    _refused(tmp_path / "missing", "holds no set to add occupancy labels to")
    foreign = tmp_path / "foreign"
    (foreign / "v1.0-mini").mkdir(parents=True)
    (foreign / "v1.0-mini" / "scene.json").write_text("[]")
    _refused(foreign, "no .bev_synthetic_manifest.json")


def test_occupancy_only_refuses_other_parameters(tmp_path, sets, capsys):
    _, bare = sets
    out = _copy(bare, tmp_path / "set")
    _refused(out, r"written with --samples-per-scene 2 .*not --samples-per-scene 3", samples_per_scene=3)
    _refused(out, r"written with --render-scale 4 .*not --render-scale 2", render_scale=2)
    _refused(out, r"written with --seed 0 .*not --seed 1", seed=1)
    _refused(out, r"written with --image-size full .*not --image-size render", image_size="render")
    assert writer.main(["--out", str(out), *CLI[:-1], "2", "--occupancy-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bev-make-synthetic: error: ") and "--render-scale 4" in err[0]
    with pytest.raises(SystemExit) as e:  # the labels only: nothing to overwrite, and they are asked for
        writer.main(["--out", str(out), *CLI, "--occupancy-only", "--overwrite"])
    assert e.value.code == 2


def test_occupancy_only_checks_a_set_whose_manifest_has_no_parameters(tmp_path, sets):
    """A set from a writer that did not record its parameters: its file list, its tables and its first samples'
    images stand for them."""
    full, bare = sets
    out = _copy(bare, tmp_path / "set")
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest["parameters"]
    (out / MANIFEST).write_text(json.dumps(manifest, indent=0))
    _refused(out, "lists others", seed=1)  # other tokens, other file names
    _refused(out, "another --render-scale", render_scale=2)  # the same names, other pixels
    _refused(out, "calibrated_sensor.json is not what", image_size="render")  # the same names, other intrinsics
    ego = out / "v1.0-mini" / "ego_pose.json"
    text = ego.read_text()
    ego.write_text(text.replace('"timestamp": ', '"timestamp": 1', 1))  # one pose's time moved
    _refused(out, "ego_pose.json is not what")  # another version of the world
    ego.write_text(text)
    assert add_occupancy(out, workers=1, progress=False, **ARGS) == 4
    assert _tree(out) == _tree(full)  # the manifest now records the parameters


def test_occupancy_only_with_render_size_images(tmp_path):
    """--image-size render: the labels added later are a full write's too; a manifest from before image_size was
    recorded stands for full-size JPEGs."""
    kw = {**ARGS, "scenes": 1, "progress": False, "workers": 1}
    full = make_synthetic(tmp_path / "full", image_size="render", **kw)
    bare = make_synthetic(tmp_path / "bare", image_size="render", occupancy=False, **kw)
    assert add_occupancy(bare, image_size="render", **kw) == 2 and _tree(bare) == _tree(full)
    old = make_synthetic(tmp_path / "old", occupancy=False, **kw)
    manifest = json.loads((old / MANIFEST).read_text())
    del manifest["parameters"]["image_size"]
    (old / MANIFEST).write_text(json.dumps(manifest, indent=0))
    _refused(old, r"written with --image-size full .*not --image-size render", image_size="render", scenes=1)
    assert add_occupancy(old, **kw) == 2


def test_occupancy_only_keeps_the_sets_lidar_sweeps(tmp_path):
    """A set written with LiDAR sweeps: --occupancy-only takes its lidar_sweeps from the manifest and adds the
    labels of a full write (the sweeps listed, none rewritten); another lidar_sweeps is refused."""
    kw = {**ARGS, "scenes": 1, "progress": False, "workers": 1}
    full = make_synthetic(tmp_path / "full", lidar_sweeps=1, **kw)
    bare = make_synthetic(tmp_path / "bare", lidar_sweeps=1, occupancy=False, **kw)
    assert any(f.startswith("sweeps/LIDAR_TOP/") for f in _tree(bare))
    _refused(bare, r"written with --lidar-sweeps 1 .*not --lidar-sweeps 2", lidar_sweeps=2, scenes=1)
    assert add_occupancy(bare, **kw) == 2 and _tree(bare) == _tree(full)
