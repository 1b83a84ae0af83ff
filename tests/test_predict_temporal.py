"""A temporal checkpoint through the user's commands: bev-eval's future metrics, bev.predict's instances,
bev-predict's npz with the future frames and its GIF of vehicles and their paths."""

import json

import numpy as np
import pytest

from helpers.cli import TINY, eval_cli, run_cli, train_cli

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def temporal_run(synthetic_root, tmp_path_factory):
    """Two training steps of a tiny temporal model (windows of 2 input frames and 1 future frame)."""
    run = tmp_path_factory.mktemp("temporal_run")
    args = [
        "experiment=synthetic_temporal_cpu",
        *TINY[1:],
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={run}",
        "data.past_frames=1",
        "data.future_frames=1",
        "++trainer.max_steps=2",
        "trainer.max_epochs=2",
    ]
    mp = pytest.MonkeyPatch()
    try:
        assert train_cli(args, mp) == 0
    finally:
        mp.undo()
    return run


def test_bev_eval_scores_the_future_of_a_temporal_checkpoint(
    temporal_run, synthetic_root, tmp_path, monkeypatch, capsys
):
    args = [f"ckpt_path={temporal_run / 'checkpoints'}", f"data.dataroot={synthetic_root}", f"hydra.run.dir={tmp_path}"]
    assert eval_cli(args, monkeypatch) == 0, capsys.readouterr().err
    metrics = json.loads((tmp_path / "metrics.json").read_text())["metrics"]
    for key in ("iou", "future_iou_long", "future_iou_short", "vpq_long", "vpq_short"):
        assert key in metrics, sorted(metrics)
        if key != "iou":  # and the baseline of the present copied to every future frame
            assert f"{key}_present_copied" in metrics, sorted(metrics)
    out = capsys.readouterr().out  # the printed table has a row per range, for the model and the baseline
    assert "VPQ" in out and out.count("long (100 m x 100 m)") == 2 and "present copied to future" in out


def test_bev_predict_writes_future_instances_and_a_gif(temporal_run, synthetic_root, tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from bev import predict_cli
    from bev.inference import build_data_config, load_model, predict, select_samples

    out = tmp_path / "pred"
    args = [
        f"ckpt_path={temporal_run / 'checkpoints'}",
        f"data.dataroot={synthetic_root}",
        f"out={out}",
        f"hydra.run.dir={tmp_path}",
        "gif_width=300",
    ]
    assert run_cli(predict_cli._hydra_main, args, monkeypatch) == 0
    summary = json.loads((out / "predictions.json").read_text())
    assert summary["samples"] and summary["gifs"]
    z = np.load(summary["samples"][0]["npz"])
    X, Y = z["vehicle"].shape
    assert z["future_segmentation"].shape == (2, X, Y) and z["future_instances"].shape == (2, X, Y)
    assert z["future_instances"].dtype == np.int32 and (z["future_instances"] >= 0).all()
    model = load_model(temporal_run / "checkpoints")
    data_cfg = build_data_config(
        OmegaConf.create({"dataroot": str(synthetic_root)}), OmegaConf.create(model.run_config)
    )
    dataset, order, _ = select_samples(data_cfg)
    pred = predict(model, dataset[int(order[0])])  # one window, no batch axis
    assert pred["instances"].shape == (1, 2, X, Y) and pred["bev"].shape[-2:] == (X, Y)
    vehicles = pred["instances"][0] > 0
    assert (vehicles <= (pred["segmentation"][0, :, 0] >= 0.5)).all()  # ids only where the segmentation says vehicle


def test_bev_eval_on_scenes_shorter_than_the_window_says_what_works(temporal_run, tmp_path, monkeypatch, capsys):
    """The checkpoint fixes the window (1 + 1 + 1 frames): the hint is not to shorten it but to use longer scenes."""
    from helpers.cli import assert_one_paragraph
    from helpers.tiny_nuscenes import write_tiny

    root = write_tiny(tmp_path / "short", samples=2)  # scenes of 2 key frames
    args = [
        f"ckpt_path={temporal_run / 'checkpoints'}",
        f"data.dataroot={root}",
        "data.val_split=mini_train",
        f"hydra.run.dir={tmp_path / 'eval'}",
    ]
    assert eval_cli(args, monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-eval: error:", "= 3 key frames", "takes exactly that window")
