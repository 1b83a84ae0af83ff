"""bev-eval writes only inside its output folder (hydra.run.dir): a symbolic link there that leads out of it, or a
file where it writes a folder, is refused in one line before the model runs, and nothing of the user's is replaced
or deleted (the predictions folder of an occupancy checkpoint, the devkit's plots folder, Hydra's .hydra/ and log)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from test_occupancy_data import occ_root  # noqa: F401 (the synthetic set with Occ3D labels)
from test_occupancy_predict import occ_run  # noqa: F401 (one training step of the CPU occupancy experiment)

from bev import eval as bev_eval
from bev.utils.io import check_output_folder
from helpers.cli import assert_one_paragraph, eval_cli

# ------------------------------------------------------------------------------ the folder check


def _user_folder(tmp_path: Path) -> Path:
    """A folder of the user's, outside every output folder, holding one file."""
    user = tmp_path / "users_folder"
    user.mkdir()
    (user / "mine.npz").write_bytes(b"the user's")
    return user


def test_a_folder_to_write_in_is_absent_or_a_folder_inside_its_root(tmp_path):
    out = tmp_path / "out"
    (out / "real").mkdir(parents=True)
    (out / "inner").symlink_to(out / "real", target_is_directory=True)
    assert check_output_folder(out, out / "new") == out / "new"  # made later
    assert check_output_folder(out, out / "real") == out / "real"
    assert check_output_folder(out, out / "inner") == out / "inner"  # a link that stays inside


def test_a_folder_that_a_link_leads_out_of_the_root_is_refused(tmp_path):
    out, user = tmp_path / "out", _user_folder(tmp_path)
    out.mkdir()
    (out / "predictions").symlink_to(user, target_is_directory=True)
    with pytest.raises(ValueError) as e:
        check_output_folder(out, out / "predictions", "challenge-format predictions")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1, msg
    assert f"{out / 'predictions'} leads to {user.resolve()}, outside {out}" in msg and "remove the link" in msg


@pytest.mark.parametrize(
    ("kind", "said"),
    [("file", "a file"), ("dangling", "a symbolic link to nothing"), ("file_link", "a symbolic link to a file")],
)
def test_a_non_folder_where_a_folder_goes_is_refused(kind, said, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    path = out / "predictions"
    if kind == "file":
        path.write_text("the user's")
    elif kind == "dangling":
        path.symlink_to(out / "gone")
    else:
        (out / "notes.txt").write_text("the user's")
        path.symlink_to(out / "notes.txt")
    with pytest.raises(NotADirectoryError) as e:
        check_output_folder(out, path, "challenge-format predictions")
    assert str(e.value) == (
        f"{path} is {said}, not a folder: it is where the challenge-format predictions go. Move it away, or choose "
        "another output folder"
    )


# ------------------------------------------------------------------------------ bev-eval


def test_bev_eval_never_follows_a_predictions_link_out_of_its_folder(occ_run, occ_root, tmp_path, monkeypatch, capsys):  # noqa: F811
    out, user = tmp_path / "eval", _user_folder(tmp_path)
    out.mkdir()
    (out / "predictions").symlink_to(user, target_is_directory=True)
    args = [f"ckpt_path={occ_run}", f"data.dataroot={occ_root}", "num_pngs=0", "rayiou=false", f"hydra.run.dir={out}"]
    assert eval_cli([*args, "overwrite=true"], monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-eval: error:", "predictions leads to", "outside")
    assert [p.name for p in user.iterdir()] == ["mine.npz"] and (user / "mine.npz").read_bytes() == b"the user's"
    assert not (out / "metrics.json").exists()
    (out / "predictions").unlink()  # the link gone, the same evaluation writes its own folder
    assert eval_cli(args, monkeypatch) == 0, capsys.readouterr().err[-3000:]
    assert len(list((out / "predictions").glob("*.npz"))) == 3


def _stub_checkpoint(monkeypatch, heads: tuple[str, ...]) -> None:
    """load_checkpoint answering a model of `heads` at once; the model must never run."""
    import bev.inference

    loaded = SimpleNamespace(
        model=SimpleNamespace(tasks=heads, task_modules={t: _task(t) for t in heads}),
        chosen=None,
        run_config=SimpleNamespace(grid=None),
    )
    monkeypatch.setattr(bev.inference, "load_checkpoint", lambda *a, **k: loaded)
    monkeypatch.setattr(bev.inference, "trained_on", lambda *a: None)
    monkeypatch.setattr(bev.inference, "build_data_config", lambda *a, **k: pytest.fail("the data was read"))
    monkeypatch.setattr(bev_eval, "_test_metrics", lambda *a, **k: pytest.fail("the model ran"))


def _task(name: str):
    """A task's training and evaluation side, as a checkpoint with that task builds it."""
    from bev.geometry import Grid
    from bev.tasks.detection.task import DetectionTask
    from bev.tasks.occupancy.task import OccupancyTask
    from bev.tasks.segmentation.task import SegmentationTask

    made = {"segmentation": lambda: SegmentationTask(Grid(), ["vehicle"]), "detection": lambda: DetectionTask(Grid())}
    return {**made, "occupancy": OccupancyTask}[name]()


@pytest.mark.parametrize(
    ("heads", "folder", "said"),
    [
        (("occupancy",), "predictions", "is a file, not a folder: it is where the challenge-format predictions go"),
        (("segmentation", "detection"), "plots", "is a file, not a folder: it is where the devkit's plots go"),
    ],
)
def test_bev_eval_checks_its_folders_before_the_data_is_read(heads, folder, said, tmp_path, monkeypatch, capsys):
    out = tmp_path / "eval"
    out.mkdir()
    (out / folder).write_text("the user's")
    _stub_checkpoint(monkeypatch, heads)
    args = ["ckpt_path=any.ckpt", "data.dataroot=/nowhere", "overwrite=true", f"hydra.run.dir={out}"]
    assert eval_cli(args, monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-eval: error: NotADirectoryError:", f"{out / folder} {said}")
    assert (out / folder).read_text() == "the user's"


def test_bev_eval_of_a_segmentation_model_leaves_those_names_alone(tmp_path, monkeypatch):
    out = tmp_path / "eval"
    out.mkdir()
    for name in ("predictions", "plots"):
        (out / name).write_text("the user's")
    _stub_checkpoint(monkeypatch, ("segmentation",))
    args = ["ckpt_path=any.ckpt", "data.dataroot=/nowhere", f"hydra.run.dir={out}"]
    with pytest.raises(pytest.fail.Exception, match="the data was read"):  # past the folder checks
        eval_cli(args, monkeypatch)


@pytest.mark.parametrize("name", [".hydra", "eval.log"])
def test_hydra_never_writes_through_a_link_out_of_the_eval_folder(name, tmp_path, monkeypatch, capsys):
    out, user = tmp_path / "eval", _user_folder(tmp_path)
    out.mkdir()
    (user / "config.yaml").write_text("the user's")
    (out / name).symlink_to(user if name == ".hydra" else user / "config.yaml")
    args = ["ckpt_path=any.ckpt", "data.dataroot=/nowhere", f"hydra.run.dir={out}"]
    assert eval_cli(args, monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-eval: error:", str(out / name))
    assert sorted(p.name for p in user.iterdir()) == ["config.yaml", "mine.npz"]
    assert (user / "config.yaml").read_text() == "the user's"
    assert sorted(p.name for p in out.iterdir()) == [name]  # nothing written beside it
