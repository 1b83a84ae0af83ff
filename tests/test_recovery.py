"""Runs recover from what earlier runs left: temporary files of killed saves are removed on the next start,
a corrupt last.ckpt does not hide the best checkpoint, a sweep with a failed run exits non-zero, a
second bev-predict into the same out= keeps the first one's scenes, and a second bev-train into a run
directory in use is refused."""

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

import bev
from bev import predict_cli
from bev.utils.io import STALE_TEMP_S, remove_stale_temporaries, run_dir_lock
from helpers.cli import TINY, assert_one_paragraph, run_cli, train_cli


@pytest.fixture
def tiny_run_copy(tiny_run, tmp_path):
    """A copy of the session's tiny training run, which these tests litter."""
    return Path(shutil.copytree(tiny_run, tmp_path / "trained"))


def _litter(folder, name: str, age_s: float):
    path = folder / name
    path.write_bytes(b"half a checkpoint")
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_remove_stale_temporaries_keeps_live_writes_and_other_files(tmp_path):
    old = _litter(tmp_path, ".last.ckpt.k3j4h.tmp", STALE_TEMP_S + 60)
    live = _litter(tmp_path, ".epoch_001.ckpt.a8d7f.tmp", 1)
    other = _litter(tmp_path, "notes.tmp", STALE_TEMP_S + 60)
    assert remove_stale_temporaries(tmp_path) == [old]
    assert not old.exists() and live.exists() and other.exists()


def test_a_new_session_removes_the_litter_of_killed_saves(synthetic_root, tmp_path, monkeypatch):
    (tmp_path / "checkpoints").mkdir()
    old = [
        _litter(tmp_path / "checkpoints", ".last.ckpt.x1y2z3.tmp", 3600),
        _litter(tmp_path, ".metrics.json.q9w8e7.tmp", 3600),
    ]
    live = _litter(tmp_path / "checkpoints", ".epoch_000.ckpt.r5t6y7.tmp", 0)  # another writer's save in progress
    args = [*TINY, "callbacks.bev_png.every_n_steps=0", f"data.dataroot={synthetic_root}", f"hydra.run.dir={tmp_path}"]
    assert train_cli(args, monkeypatch) == 0
    assert not any(p.exists() for p in old) and live.exists()


def test_load_model_of_a_run_with_a_corrupt_last_ckpt_uses_its_best_checkpoint(tiny_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(tiny_run / "checkpoints", copy / "checkpoints")
    last = copy / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:4000])  # a save killed half-way
    with pytest.warns(UserWarning, match="last.ckpt .* cannot be read.*using epoch_000.ckpt"):
        model = bev.load_model(copy)
    best = torch.load(copy / "checkpoints" / "epoch_000.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert all(torch.equal(v, best[k]) for k, v in model.state_dict().items() if k in best)


def test_a_sweep_with_a_failed_run_exits_non_zero(synthetic_root, tmp_path, monkeypatch, capsys):
    args = [
        "-m",
        *TINY,
        "model.optimizer.lr=1e-3,-1.0",
        "callbacks.bev_png.every_n_steps=0",
        f"data.dataroot={synthetic_root}",
        f"hydra.sweep.dir={tmp_path}",
    ]
    assert train_cli(args, monkeypatch) == 1
    err = capsys.readouterr().err
    assert "1 of 2 sweep runs failed" in err and "model.optimizer.lr=-1.0" in err
    status = {json.loads((tmp_path / d / "metrics.json").read_text())["status"][:6] for d in ("0", "1")}
    assert status == {"ok", "failed"}


def _predict(ckpt, root, out, scene, monkeypatch, tmp_path, *extra):
    args = [
        *extra,
        f"ckpt_path={ckpt}",
        f"data.dataroot={root}",
        f"out={out}",
        f"scene={scene}",
        "png=false",
        f"hydra.run.dir={tmp_path / ('run_' + scene)}",
    ]
    assert run_cli(predict_cli._hydra_main, args, monkeypatch) == 0
    return json.loads((out / "predictions.json").read_text())


def test_a_second_bev_predict_into_the_same_out_keeps_the_first_scene(
    tiny_run_copy, synthetic_root, tmp_path, monkeypatch
):
    out = tmp_path / "pred"
    first = _predict(tiny_run_copy, synthetic_root, out, "scene-0061", monkeypatch, tmp_path)
    both = _predict(tiny_run_copy, synthetic_root, out, "scene-0103", monkeypatch, tmp_path)
    assert [s["scene"] for s in both["samples"]] == ["scene-0061"] * 3 + ["scene-0103"] * 3
    assert both["samples"][:3] == first["samples"] and both["scene"] is None and both["split"] is None
    assert sorted(os.path.basename(g) for g in both["gifs"]) == ["scene-0061.gif", "scene-0103.gif"]
    # redone (asked for: its files exist): replaced, not doubled
    again = _predict(tiny_run_copy, synthetic_root, out, "scene-0103", monkeypatch, tmp_path, "overwrite=true")
    assert again["samples"] == both["samples"]
    # Another checkpoint's predictions are not mixed into one index.
    with pytest.warns(UserWarning, match="another checkpoint"):
        other = _predict(
            tiny_run_copy / "checkpoints" / "last.ckpt",
            synthetic_root,
            out,
            "scene-0061",
            monkeypatch,
            tmp_path,
            "overwrite=true",
        )
    assert {s["scene"] for s in other["samples"]} == {"scene-0061"}


def test_a_second_bev_train_into_a_run_dir_in_use_is_refused(synthetic_root, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = [*TINY, "+trainer.fast_dev_run=true", f"data.dataroot={synthetic_root}", f"hydra.run.dir={out}"]
    with run_dir_lock(out):  # a run in progress
        assert train_cli(args, monkeypatch) == 1
        assert_one_paragraph(capsys.readouterr().err, "bev-train: error:", f"{str(out)!r} is in use by bev-train pid")
        assert not (out / "checkpoints").exists()
    assert train_cli(args, monkeypatch) == 0  # the lock goes with its holder


def test_the_run_dir_lock_is_released_when_its_holder_is_killed(tmp_path):
    import subprocess
    import sys

    code = f"from bev.utils.io import run_dir_lock\nwith run_dir_lock({str(tmp_path)!r}):\n    print('held', flush=True)\n    input()"
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match=f"in use by bev-train pid {holder.pid}"):
            with run_dir_lock(tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()
    with run_dir_lock(tmp_path):
        pass
