"""bev-predict on an occupancy checkpoint: every sample's prediction in the Occ3D challenge's format (equal to the
model's argmax), and the cameras beside the occupancy views in the PNGs and the scene GIF."""

import json
import os

import numpy as np
import pytest
import torch
from test_occupancy_data import occ_root  # noqa: F401 (the synthetic set with Occ3D labels)
from test_occupancy_train import SMALL

from helpers.cli import run_cli, train_cli

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def occ_run(occ_root, tmp_path_factory):  # noqa: F811
    """One training step of the CPU occupancy experiment on 1.6 m lift cells (its logits are still 200 x 200 x 16)."""
    run = tmp_path_factory.mktemp("occ_run")
    coarse = ["grid.xbound=[-40,40,1.6]", "grid.ybound=[-40,40,1.6]", "grid.zbound=[-1,5.4,1.6]"]
    args = ["experiment=synthetic_occ_cpu", *SMALL, *coarse, "data.final_dim=[32,96]", "+trainer.max_steps=1"]
    args = [a for a in args if a != "+trainer.max_steps=2"]
    mp = pytest.MonkeyPatch()
    try:
        assert train_cli([*args, f"data.dataroot={occ_root}", f"hydra.run.dir={run}"], mp) == 0
    finally:
        mp.undo()
    return run / "checkpoints" / "last.ckpt"


def test_bev_predict_writes_challenge_files_and_pictures(occ_run, occ_root, tmp_path, monkeypatch):  # noqa: F811
    from omegaconf import OmegaConf
    from torch.utils.data import default_collate

    from bev import predict_cli
    from bev.inference import build_data_config, load_model, select_samples
    from bev.tasks.occupancy.grid import NUM_CLASSES, OCC_SHAPE

    out = tmp_path / "pred"
    args = [f"ckpt_path={occ_run}", f"data.dataroot={occ_root}", f"out={out}", f"hydra.run.dir={tmp_path}"]
    assert run_cli(predict_cli._hydra_main, [*args, "gif_width=300"], monkeypatch) == 0
    summary = json.loads((out / "predictions.json").read_text())
    records = summary["samples"]
    assert len(records) == 3 and "Occ3D challenge format" in summary["npz_format"]  # mini_val: 3 samples
    assert summary["class_names"][17] == "free"
    # The model's own argmax over the classes, sample by sample, from the logits.
    model = load_model(occ_run)
    data_cfg = build_data_config(OmegaConf.create({"dataroot": str(occ_root)}), OmegaConf.create(model.run_config))
    dataset, order, _ = select_samples(data_cfg)
    with torch.no_grad():
        logits = model(default_collate([dataset[int(k)] for k in order]))["occupancy"]
    want = {dataset.index["sample_token"][int(k)]: a for k, a in zip(order, logits.argmax(1).numpy())}
    for rec in records:
        path = out / "predictions" / f"{rec['sample_token']}.npz"
        assert rec["npz"] == str(path)
        with np.load(path) as z:  # the challenge's key and SparseOcc's, read without the project's reader
            assert z.files == ["arr_0", "pred"]
            pred = z["arr_0"]
            np.testing.assert_array_equal(z["pred"], pred)
        assert pred.shape == OCC_SHAPE and pred.dtype == np.uint8 and int(pred.max()) < NUM_CLASSES
        np.testing.assert_array_equal(pred, want[rec["sample_token"]])
        assert rec["png"].endswith(".png") and os.path.isfile(rec["png"])
    (gif,) = summary["gifs"]
    from PIL import Image

    with Image.open(gif) as im:
        assert im.n_frames == 3 and im.width == 300
    # The same out= again is refused without overwrite=true, naming a challenge file.
    assert run_cli(predict_cli._hydra_main, args, monkeypatch) != 0
