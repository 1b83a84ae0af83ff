"""Paths built from data stay inside their folders: bev-predict writes only under out= whatever the
tokens and scene names hold, and image / lidar filenames that leave the dataroot are refused."""

import json
import os
import shutil
from pathlib import Path

import pytest

from bev import predict_cli
from bev.utils.io import inside, safe_name
from helpers.cli import assert_one_paragraph, run_cli

HOSTILE = [
    "../../../escaped",
    "/tmp/abs",
    "..",
    ".",
    "",
    "a/b",
    "a\\b",
    ".hidden",
    "x" * 400,
    "nul\x00byte",
    "é-unicode",
    "../" * 40 + "deep",
]


@pytest.mark.parametrize("name", HOSTILE)
def test_safe_name_is_one_component_inside_its_folder(name, tmp_path):
    safe = safe_name(name)
    assert safe and "/" not in safe and "\\" not in safe and "\x00" not in safe and not safe.startswith(".")
    assert len(safe.encode()) <= 200
    assert (tmp_path / safe).resolve().parent == tmp_path.resolve()


def test_safe_name_keeps_honest_names_and_distinct_names_distinct():
    assert safe_name("3e8750f331d7499e9b5123e9eb70f2e2") == "3e8750f331d7499e9b5123e9eb70f2e2"
    assert safe_name("scene-0061") == "scene-0061"
    names = ["a/b", "a_b", "a\\b", "a b", "../a_b"]
    assert len({safe_name(n) for n in names}) == len(names)


def _copy_with(synthetic_root: Path, dest: Path, replace: dict[str, str]) -> Path:
    """A copy of the synthetic dataroot whose tables have every JSON string in `replace` swapped (all references)."""
    shutil.copytree(synthetic_root, dest, ignore=shutil.ignore_patterns(".bev_cache"))
    for table in (dest / "v1.0-mini").glob("*.json"):
        text = table.read_text()
        for old, new in replace.items():
            text = text.replace(json.dumps(old), json.dumps(new))
        table.write_text(text)
    return dest


def _tables(root: Path, name: str) -> list[dict]:
    return json.loads((root / "v1.0-mini" / f"{name}.json").read_text())


def _val_sample_tokens(root: Path) -> list[str]:
    scene = next(s for s in _tables(root, "scene") if s["name"] == "scene-0103")
    return [s["token"] for s in _tables(root, "sample") if s["scene_token"] == scene["token"]]


def _files_under(folder: Path) -> set[Path]:
    return {Path(d, f).resolve() for d, _, fs in os.walk(folder) for f in fs}


def test_bev_predict_never_writes_outside_out(tiny_run, synthetic_root, tmp_path, monkeypatch):
    tokens = _val_sample_tokens(synthetic_root)
    # out/scene-0103/000_<token>.npz: four levels up from there is tmp_path/box, outside out=.
    evil = {tokens[0]: "../../../../escaped_npz", tokens[1]: "x/../../../../../escaped_too", tokens[2]: ".."}
    root = _copy_with(synthetic_root, tmp_path / "box" / "data", evil)
    out = tmp_path / "box" / "sub" / "pred"
    before = _files_under(tmp_path)
    args = [f"ckpt_path={tiny_run}", f"data.dataroot={root}", f"out={out}", f"hydra.run.dir={tmp_path / 'box' / 'run'}"]
    assert run_cli(predict_cli._hydra_main, args, monkeypatch) == 0
    new = _files_under(tmp_path) - before
    outside = {
        p
        for p in new
        if not p.is_relative_to(out.resolve())
        and not p.is_relative_to(root.resolve())
        and not p.is_relative_to((tmp_path / "box" / "run").resolve())
    }
    assert not outside
    rec = json.loads((out / "predictions.json").read_text())
    assert sorted(s["sample_token"] for s in rec["samples"]) == sorted(
        evil.values()
    )  # the record keeps the data's names
    assert len({s["npz"] for s in rec["samples"]}) == 3 and all(Path(s["npz"]).is_file() for s in rec["samples"])


def test_inside_refuses_a_folder_that_a_link_leads_out_of(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "scene").symlink_to(elsewhere, target_is_directory=True)
    (out / "inner").symlink_to(out, target_is_directory=True)
    assert inside(out, out / "a.npz") == out / "a.npz"
    assert inside(out, out / "new" / "a.npz") == out / "new" / "a.npz"  # not made yet: fine
    assert inside(out, out / "inner" / "a.npz")  # a link that stays inside
    with pytest.raises(ValueError, match="outside .*remove the link"):
        inside(out, out / "scene" / "a.npz")


def test_bev_predict_never_follows_a_link_out_of_out(tiny_run, synthetic_root, tmp_path, monkeypatch, capsys):
    out, elsewhere = tmp_path / "pred", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "scene-0103").symlink_to(elsewhere, target_is_directory=True)  # the val scene's folder
    args = [f"ckpt_path={tiny_run}", f"data.dataroot={synthetic_root}", f"out={out}", f"hydra.run.dir={tmp_path / 'r'}"]
    assert run_cli(predict_cli._hydra_main, args, monkeypatch) != 0
    assert not any(elsewhere.iterdir())
    assert_one_paragraph(capsys.readouterr().err, "bev-predict: error:", "remove the link")


@pytest.mark.parametrize(
    "sensor,bad",
    [("CAM_FRONT", "../outside.jpg"), ("CAM_BACK", "/etc/hostname"), ("LIDAR_TOP", "samples/../../outside.bin")],
)
def test_sample_data_paths_leaving_the_dataroot_are_refused(sensor, bad, synthetic_root, tmp_path):
    from bev.data import NuScenesBEVDataset

    sd = next(
        s
        for s in _tables(synthetic_root, "sample_data")
        if s["is_key_frame"]
        and f"/{sensor}/" in s["filename"]
        and s["sample_token"] in _val_sample_tokens(synthetic_root)
    )
    root = _copy_with(synthetic_root, tmp_path / "data", {sd["filename"]: bad})
    with pytest.raises(ValueError) as e:
        NuScenesBEVDataset(root, split="mini_val", verbose=False)
    msg = str(e.value)
    assert "sample_data" in msg and sd["token"] in msg and repr(bad) in msg and "relative to the dataroot" in msg
    assert len(msg.splitlines()) == 1


def test_bev_predict_names_the_refused_path(tiny_run, synthetic_root, tmp_path, monkeypatch, capsys):
    sd = next(
        s
        for s in _tables(synthetic_root, "sample_data")
        if s["is_key_frame"]
        and "/CAM_FRONT/" in s["filename"]
        and s["sample_token"] in _val_sample_tokens(synthetic_root)
    )
    root = _copy_with(synthetic_root, tmp_path / "data", {sd["filename"]: "/etc/hostname"})
    args = [
        f"ckpt_path={tiny_run}",
        f"data.dataroot={root}",
        f"out={tmp_path / 'pred'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    assert run_cli(predict_cli._hydra_main, args, monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-predict: error:", sd["token"], "'/etc/hostname'")
