"""Bad settings end in one clear message before the work starts, not in a traceback late (or silence):
more training processes than batches, GIF options, a negative synthetic seed, bev-eval model=<group>,
depth bins that never reach the grid."""

import json
import math
import subprocess
import sys

import pytest
import torch

from bev import predict_cli
from bev.geometry import Grid, depth_bins_in_grid
from helpers.cli import TINY, assert_one_paragraph, eval_cli, run_cli, train_cli


def test_more_training_processes_than_batches_is_refused_once(synthetic_root, tmp_path):
    # A subprocess: were the check missing, Lightning would launch the 4 processes by re-running the command.
    args = [*TINY, "trainer.devices=4", f"data.dataroot={synthetic_root}", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run([sys.executable, "-m", "bev.train", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("bev-train: error:")]
    assert_one_paragraph(error, "trainer.devices=4", "4 training processes", "3 samples", "data.batch_size=2")
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(
    "option,value,needle",
    [
        ("gif_fps", 0, "gif_fps=0"),
        ("gif_fps", -2, "gif_fps=-2"),
        ("gif_fps", "nan", "gif_fps=nan"),
        ("gif_width", 0, "gif_width=0"),
        ("gif_width", 10.5, "gif_width=10.5"),
        ("batch_size", 0, "batch_size=0"),
    ],
)
def test_bev_predict_options_are_checked_before_anything_runs(option, value, needle, tmp_path, monkeypatch, capsys):
    # The checkpoint does not exist: a check made after loading would report that instead.
    args = [
        f"ckpt_path={tmp_path / 'none.ckpt'}",
        f"out={tmp_path / 'pred'}",
        f"{option}={value}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    assert run_cli(predict_cli._hydra_main, args, monkeypatch) == 1
    err = capsys.readouterr().err
    assert_one_paragraph(err, "bev-predict: error:", needle)
    assert "does not exist" not in err


def test_synthetic_writer_refuses_a_negative_seed(tmp_path, capsys):
    from bev.synthetic.writer import main

    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "set"), "--seed", "-5"])
    assert e.value.code == 2
    assert_one_paragraph(capsys.readouterr().err, "seed must be >= 0, got -5")
    assert not (tmp_path / "set").exists()


def test_bev_eval_with_a_model_group_reads_the_checkpoints_grid_and_data(
    tiny_run, synthetic_root, tmp_path, monkeypatch
):
    base = [f"ckpt_path={tiny_run}", f"data.dataroot={synthetic_root}", "num_pngs=0"]
    assert eval_cli([*base, f"hydra.run.dir={tmp_path / 'plain'}"], monkeypatch) == 0
    model = ["model=lss_small", *(a for a in TINY if a.startswith("model."))]  # the group the run was trained with
    assert eval_cli([*base, *model, f"hydra.run.dir={tmp_path / 'group'}"], monkeypatch) == 0
    plain, group = (json.loads((tmp_path / d / "metrics.json").read_text())["metrics"] for d in ("plain", "group"))
    # The same network and weights: the same predictions (the loss differs: the group has no class weights).
    ious = [k for k in plain if k.startswith("iou")]
    assert ious and all(math.isnan(plain[k]) and math.isnan(group[k]) or math.isclose(plain[k], group[k]) for k in ious)


def test_bev_eval_with_a_model_group_that_does_not_fit_names_the_differences(
    tiny_run, synthetic_root, tmp_path, monkeypatch, capsys
):
    args = [f"ckpt_path={tiny_run}", f"data.dataroot={synthetic_root}", "model=lss", f"hydra.run.dir={tmp_path}"]
    assert eval_cli(args, monkeypatch) == 1
    err = capsys.readouterr().err
    assert_one_paragraph(err, "bev-eval: error:", "different model config", "model.net.camera.backbone")
    assert "Interpolation" not in err


def _forward_camera(depth_bins: tuple[float, float, float], xbound=(-10.0, 10.0, 1.0)) -> tuple[Grid, list]:
    """A grid and one camera at the ego origin looking along +x (camera z), image 32 x 64, focal 32."""
    grid = Grid(xbound=xbound, ybound=(-10.0, 10.0, 1.0), zbound=(-5.0, 5.0, 10.0), dbound=depth_bins)
    K = torch.tensor([[32.0, 0, 32], [0, 32, 16], [0, 0, 1]])
    R = torch.tensor([[0.0, 0, 1], [-1, 0, 0], [0, -1, 0]])  # camera x right -> ego -y, y down -> -z, z -> x
    cams = [K, R, torch.zeros(3), torch.eye(3), torch.zeros(3)]
    return grid, [c.expand(1, 1, *c.shape) for c in cams]


def test_depth_bins_in_grid_against_the_camera_geometry():
    grid, cams = _forward_camera((4.0, 30.0, 2.0))
    reach = depth_bins_in_grid(grid, (32, 64), *cams)
    # Along +x a point at depth d has x = d: the bins starting before the grid's end at x = 10 m reach it.
    assert reach.tolist() == [d < 10.0 for d in grid.depths().tolist()]
    far, cams = _forward_camera((12.0, 20.0, 2.0))
    assert not depth_bins_in_grid(far, (32, 64), *cams).any()
    assert math.isclose(float(grid.depths()[reach].max()), 8.0)


def test_depth_bins_beyond_the_grid_are_refused_before_training(synthetic_root, tmp_path, monkeypatch, capsys):
    args = [*TINY, "grid.dbound=[80,120,8.0]", f"data.dataroot={synthetic_root}", f"hydra.run.dir={tmp_path}"]
    assert train_cli(args, monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-train: error:", "no depth bin", "grid.dbound [80.0, 120.0, 8.0]")


def test_depth_bins_partly_beyond_the_grid_are_named_in_a_warning(synthetic_root, tmp_path, monkeypatch):
    # The grid's farthest corner is 34 m away: of bins starting at 4, 12, ..., 92 m, those from 36 m never reach it.
    args = [
        *TINY,
        "grid.dbound=[4,100,8.0]",
        "+trainer.fast_dev_run=true",
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={tmp_path}",
    ]
    with pytest.warns(UserWarning, match=r"8 of 12 depth bins \(36-100 m\)"):
        assert train_cli(args, monkeypatch) == 0


def test_a_grid_too_large_for_memory_is_refused_up_front_naming_the_grid_keys(
    synthetic_root, tmp_path, monkeypatch, capsys
):
    # 20000 x 20000 cells x 8 channels x batch 2: ~51 GiB of BEV features; refused before any target is made.
    fine = ["grid.xbound=[-50,50,0.005]", "grid.ybound=[-50,50,0.005]"]
    args = [*TINY, *fine, f"data.dataroot={synthetic_root}", f"hydra.run.dir={tmp_path}"]
    monkeypatch.setattr("bev.utils.precision.available_memory", lambda accelerator="cpu": 16 * 2**30)
    assert train_cli(args, monkeypatch) == 1
    assert_one_paragraph(
        capsys.readouterr().err,
        "bev-train: error:",
        "20000 x 20000 x 1 cells",
        "grid.xbound [-50.0, 50.0, 0.005]",
        "more than the 16.0 GiB available",
        "data.batch_size",
    )


def test_bev_export_into_a_folder_is_refused_before_the_export(tmp_path, monkeypatch, capsys):
    from bev import export as bev_export

    # The checkpoint does not exist: a check made after loading (or exporting) would report that instead.
    args = [
        f"ckpt_path={tmp_path / 'none.ckpt'}",
        f"out={tmp_path}",
        "format=torch_export",
        f"hydra.run.dir={tmp_path}",
    ]
    assert run_cli(bev_export._hydra_main, args, monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-export: error:", "is a folder", "model.pt2")


@pytest.mark.parametrize(
    ("fmt", "out", "fix"), [("torch_export", "model.onnx", "model.pt2"), ("onnx", "m.pt2", "m.onnx")]
)
def test_bev_export_to_a_file_named_for_the_other_format_is_refused(tmp_path, monkeypatch, capsys, fmt, out, fix):
    from bev import export as bev_export

    args = [
        f"ckpt_path={tmp_path / 'none.ckpt'}",
        f"out={tmp_path / out}",
        f"format={fmt}",
        f"hydra.run.dir={tmp_path}",
    ]
    assert run_cli(bev_export._hydra_main, args, monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-export: error:", f"names a {out[out.rfind('.') :]} file", fix)


@pytest.mark.parametrize(
    "value,needle",
    [("[1,2]", "model.optimizer.lr=[1, 2] is refused by torch.optim"), ("-1.0", "model.optimizer.lr=-1.0 is refused")],
)
def test_an_optimizer_setting_torch_refuses_is_named_before_the_data_is_read(
    value, needle, tmp_path, monkeypatch, capsys
):
    # data.dataroot does not exist: a check made after the data is indexed would report that instead.
    args = [*TINY, f"model.optimizer.lr={value}", f"data.dataroot={tmp_path / 'nowhere'}", f"hydra.run.dir={tmp_path}"]
    assert train_cli(args, monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-train: error:", needle, "(its default: lr=0.001)")
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(
    "override, needle",
    [
        ("model.depth_weight=nan", "model.depth_weight=nan is not a finite number"),
        ("model.net.image_size=[64,176]", "model.net.image_size=[64, 176] differs from data.final_dim=[32, 96]"),
        ("data.final_dim=[31,96]", "data.final_dim=[31, 96] is not a multiple of model.net.camera.downsample=16"),
        ("data.bev_aug=bevdet", "data.bev_aug=bevdet does nothing with data.augment=false"),
    ],
)
def test_a_model_or_training_setting_is_named_before_the_data_is_read(override, needle, tmp_path, monkeypatch, capsys):
    # data.dataroot does not exist: a check made after the data is indexed would report that instead.
    args = [*TINY, override, f"data.dataroot={tmp_path / 'nowhere'}", f"hydra.run.dir={tmp_path}"]
    assert train_cli(args, monkeypatch) == 1
    err = capsys.readouterr().err
    assert_one_paragraph(err, "bev-train: error:", needle)
    assert "nowhere" not in err and not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("option", ["rayiou", "trust_checkpoint"])
def test_bev_eval_takes_only_true_or_false_for_its_switches(option, tmp_path, monkeypatch, capsys):
    # The checkpoint does not exist: a check made after loading it would report that instead.
    args = [
        f"ckpt_path={tmp_path / 'none.ckpt'}",
        "data.dataroot=/nowhere",
        f"{option}=maybe",
        f"hydra.run.dir={tmp_path}",
    ]
    assert eval_cli(args, monkeypatch) == 1
    err = capsys.readouterr().err
    assert_one_paragraph(err, "bev-eval: error:", f"{option}='maybe' must be true or false")
    assert "none.ckpt" not in err
