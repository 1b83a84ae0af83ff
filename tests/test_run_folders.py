"""A run folder given as ckpt_path resolves by one stated rule (bev.utils.checkpoint.choose_checkpoint): the best
by the monitor that the newest last checkpoint names, else that last checkpoint; without one, the best score
the checkpoints recorded; the commands say which file they chose, and make their output folders only once the
checkpoint is checked."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from bev import export as bev_export
from bev import predict_cli
from bev.utils.checkpoint import CheckpointError, choose_checkpoint, resolve_checkpoint
from helpers.cli import TINY, assert_one_paragraph, run_cli, train_cli

KEY = "ModelCheckpoint{'monitor': 'val/iou', 'mode': 'max', 'every_n_train_steps': 0, 'every_n_epochs': 1, 'train_time_interval': None}"


def _ckpt(folder: Path, name: str, score=None, best="", age_s: float = 0.0, key: str = KEY, step: int = 1) -> Path:
    """A checkpoint file carrying only what the choice reads: a ModelCheckpoint state and its modification time."""
    state = {"best_model_path": best, "current_score": None if score is None else torch.tensor(score)}
    path = folder / name
    torch.save({"state_dict": {}, "global_step": step, "callbacks": {key: state}}, path)
    then = 1_700_000_000 - age_s
    os.utime(path, (then, then))
    return path


def test_epoch_checkpoints_without_a_best_link_resolve_to_the_best_recorded_score(tmp_path):
    # Copied out of their run: each names a best that is not here, and there is no last.ckpt.
    for n, score in enumerate([0.2, 0.5, 0.3]):
        _ckpt(tmp_path, f"epoch_{n:03d}.ckpt", score, best="/elsewhere/epoch_009.ckpt", age_s=10 - n)
    chosen = choose_checkpoint(tmp_path)
    assert chosen.path == tmp_path / "epoch_001.ckpt"
    assert "best by val/iou (max)" in chosen.reason


def test_the_recorded_score_follows_the_monitor_mode(tmp_path):
    key = KEY.replace("val/iou", "val/loss").replace("'max'", "'min'")
    for n, score in enumerate([0.9, 0.4, 0.7]):
        _ckpt(tmp_path, f"epoch_{n:03d}.ckpt", score, key=key)
    assert resolve_checkpoint(tmp_path) == tmp_path / "epoch_001.ckpt"


def test_checkpoints_without_scores_resolve_to_the_newest(tmp_path):
    for n in range(3):
        _ckpt(tmp_path, f"epoch_{n:03d}.ckpt", key="ModelCheckpoint{'monitor': None}", age_s=[5, 1, 9][n])
    chosen = choose_checkpoint(tmp_path)
    assert chosen.path == tmp_path / "epoch_001.ckpt" and "newest" in chosen.reason


def test_a_second_run_in_the_same_folder_wins_by_its_last_checkpoint(tmp_path):
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    # The first run's best scored higher: the rule follows the newest run, not the best score of any run.
    _ckpt(ck, "epoch_003.ckpt", 0.6, age_s=100)
    _ckpt(ck, "last.ckpt", 0.5, best=str(ck / "epoch_003.ckpt"), age_s=90)
    _ckpt(ck, "epoch_000-v1.ckpt", 0.3, age_s=20)
    _ckpt(ck, "last-v1.ckpt", 0.3, best="/moved/run/checkpoints/epoch_000-v1.ckpt", age_s=10)
    chosen = choose_checkpoint(tmp_path)
    assert chosen.path == ck / "epoch_000-v1.ckpt"
    assert "last-v1.ckpt (the newest of 2 last checkpoints)" in chosen.reason
    # Resuming the first run later makes its last.ckpt the newest again.
    os.utime(ck / "last.ckpt")
    assert resolve_checkpoint(tmp_path) == ck / "epoch_003.ckpt"


def test_a_last_checkpoint_that_names_no_best_is_chosen_itself(tmp_path):
    _ckpt(tmp_path, "epoch_000.ckpt", 0.9, age_s=50)
    _ckpt(tmp_path, "last.ckpt", 0.1, best=str(tmp_path / "epoch_007.ckpt"))  # its best was deleted
    chosen = choose_checkpoint(tmp_path)
    assert chosen.path == tmp_path / "last.ckpt" and "names no readable best" in chosen.reason


def test_a_hostile_state_key_is_not_evaluated(tmp_path):
    key = "ModelCheckpoint" + "[" * 5000 + "__import__('os').system('false')"
    _ckpt(tmp_path, "epoch_000.ckpt", 0.4, key=key, age_s=5)
    _ckpt(tmp_path, "epoch_001.ckpt", 0.1, key=key)
    assert resolve_checkpoint(tmp_path) == tmp_path / "epoch_001.ckpt"  # no monitor read: the newest


def test_a_folder_with_nothing_readable_says_so(tmp_path):
    (tmp_path / "epoch_000.ckpt").write_bytes(b"half a checkpoint")
    with pytest.raises(CheckpointError, match="no readable checkpoint in .*epoch_000.ckpt cannot be read"):
        choose_checkpoint(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        choose_checkpoint(empty)


@pytest.fixture
def two_runs(tiny_run, synthetic_root, tmp_path, monkeypatch):
    """tiny_run's folder after a second bev-train into it (no ckpt_path): last-v1.ckpt beside last.ckpt."""
    run = Path(shutil.copytree(tiny_run, tmp_path / "run"))
    args = [*TINY, "callbacks.bev_png.every_n_steps=0", f"data.dataroot={synthetic_root}", f"hydra.run.dir={run}"]
    with pytest.warns(
        UserWarning, match=r"holds an earlier run's checkpoints \(last.ckpt\).*pass ckpt_path=.*last.ckpt"
    ):
        assert train_cli(args, monkeypatch) == 0
    assert (run / "checkpoints" / "last-v1.ckpt").is_file()
    return run


def test_bev_predict_of_a_folder_of_two_runs_uses_the_newer_and_says_so(
    two_runs, synthetic_root, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "pred"
    args = [f"ckpt_path={two_runs}", f"data.dataroot={synthetic_root}", f"out={out}", "png=false", "gif=false"]
    assert run_cli(predict_cli._hydra_main, [*args, f"hydra.run.dir={tmp_path / 'p'}"], monkeypatch) == 0
    said = capsys.readouterr().out
    assert f"checkpoint: {two_runs / 'checkpoints' / 'epoch_000-v1.ckpt'} (the best by val/iou (max)" in said


@pytest.mark.parametrize("command", ["predict", "export"])
def test_no_output_folder_is_made_before_the_checkpoint_is_checked(command, tmp_path, monkeypatch, capsys):
    runs = tmp_path / "run" / "checkpoints"
    runs.mkdir(parents=True)
    (runs / "last.ckpt").write_bytes(b"half a checkpoint")
    deep = tmp_path / "out" / "a" / "b"
    main = predict_cli._hydra_main if command == "predict" else bev_export._hydra_main
    out = f"out={deep}" if command == "predict" else f"out={deep / 'model.pt2'}"
    extra = ["data.dataroot=/nowhere"] if command == "predict" else ["format=torch_export"]
    args = [f"ckpt_path={tmp_path / 'run'}", out, *extra, f"hydra.run.dir={tmp_path / 'hydra'}"]
    assert run_cli(main, args, monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "no readable checkpoint in", "last.ckpt cannot be read")
    assert not (tmp_path / "out").exists()
