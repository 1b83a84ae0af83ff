"""Using a trained model: bev.load_model / bev.predict, bev-predict files and GIFs, and one clear
message for each bad input. The model is `tiny_run` (tests/conftest.py), a real bev-train run: the
tests that use it are end-to-end (marker e2e)."""

import json
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import bev
from bev import predict_cli
from helpers.cli import assert_one_paragraph, run_cli
from helpers.models import CLASSES, val_batch


def test_import_bev_is_cheap():
    code = "import sys, bev; assert 'torch' not in sys.modules and 'lightning' not in sys.modules; print(bev.load_model.__module__)"
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "bev.inference"


@pytest.mark.e2e
def test_load_model_round_trip(tiny_run, synthetic_root):
    ckpt_path = tiny_run / "checkpoints" / "last.ckpt"
    model = bev.load_model(ckpt_path)
    assert not model.training and list(model.class_names) == CLASSES
    assert model.grid.bev_shape == (24, 24) and model.image_size == (32, 96)
    batch = val_batch(synthetic_root, model)
    probs = bev.predict(model, batch)
    assert probs.shape == (2, len(CLASSES), 24, 24) and probs.dtype == torch.float32

    # Independently: the same weights put into a freshly built network give the same logits.
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(model.run_config)
    cfg.model.net.camera.weights = None
    fresh = instantiate(cfg.model)
    state = torch.load(ckpt_path, weights_only=True)["state_dict"]
    fresh.load_state_dict(state)
    fresh.eval()
    with torch.no_grad():
        logits = fresh(batch)["segmentation"]
    torch.testing.assert_close(probs, logits.sigmoid(), rtol=0, atol=1e-6)
    # The bare network and a single unbatched sample work too.
    one = {k: v[1] for k, v in batch.items() if torch.is_tensor(v)}
    torch.testing.assert_close(bev.predict(model.net, one), probs[1:2], rtol=0, atol=1e-6)
    # A run directory resolves to its best checkpoint.
    assert list(bev.load_model(tiny_run).class_names) == CLASSES


@pytest.mark.e2e
def test_predict_batch_without_cameras_is_a_clear_error(tiny_run):
    model = bev.load_model(tiny_run / "checkpoints" / "last.ckpt")
    with pytest.raises(KeyError, match="batch lacks intrinsics"):
        bev.predict(model, {"images": torch.zeros(1, 6, 3, 32, 96)})


def predict_cli_run(args, monkeypatch):
    return run_cli(predict_cli._hydra_main, args, monkeypatch)


@pytest.mark.e2e
def test_bev_predict_writes_npz_png_and_a_gif_per_scene(tiny_run, synthetic_root, tmp_path, monkeypatch):
    out = tmp_path / "pred"
    args = [
        f"ckpt_path={tiny_run}",
        f"data.dataroot={synthetic_root}",
        f"out={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    assert predict_cli_run(args, monkeypatch) == 0
    rec = json.loads((out / "predictions.json").read_text())
    assert rec["split"] == "mini_val" and rec["class_names"] == CLASSES
    assert [s["scene"] for s in rec["samples"]] == ["scene-0103"] * 3
    times = [s["timestamp"] for s in rec["samples"]]
    assert times == sorted(times)
    for s in rec["samples"]:
        z = np.load(s["npz"])
        assert all(z[c].dtype == np.uint8 and z[c].shape == (24, 24) for c in CLASSES)
        assert str(z["_sample_token"]) == s["sample_token"]
        assert Image.open(s["png"]).format == "PNG"
    # The stored probabilities are the model's, quantised to 1/255.
    model = bev.load_model(tiny_run)
    from bev.data import NuScenesBEVDataset

    ds = NuScenesBEVDataset(
        synthetic_root, split="mini_val", grid=model.run_config["grid"], final_dim=(32, 96), verbose=False
    )
    first = torch.utils.data.default_collate(
        [ds[i] for i in range(len(ds)) if ds.index["sample_token"][i] == rec["samples"][0]["sample_token"]]
    )
    expect = bev.predict(model, first)[0].numpy()
    z = np.load(rec["samples"][0]["npz"])
    got = np.stack([z[c] for c in CLASSES]) / 255.0
    assert np.abs(got - expect).max() <= 0.5 / 255 + 1e-6
    gif = Image.open(out / "scene-0103.gif")
    assert gif.format == "GIF" and gif.n_frames == 3
    assert not list(out.rglob("*.tmp"))


@pytest.mark.e2e
def test_bev_predict_one_scene_of_the_train_split(tiny_run, synthetic_root, tmp_path, monkeypatch):
    out = tmp_path / "pred"
    args = [
        f"ckpt_path={tiny_run}",
        f"data.dataroot={synthetic_root}",
        "scene=scene-0061",
        "png=false",
        f"out={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    assert predict_cli_run(args, monkeypatch) == 0
    rec = json.loads((out / "predictions.json").read_text())
    assert rec["split"] == "mini_train" and len(rec["samples"]) == 3 and "png" not in rec["samples"][0]
    assert Image.open(out / "scene-0061.gif").n_frames == 3
    assert sorted(p.name for p in out.iterdir()) == ["predictions.json", "scene-0061", "scene-0061.gif"]


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["missing_checkpoint", "unknown_scene", "unwritable_out"])
def test_bev_predict_bad_input(case, tiny_run, synthetic_root, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    args = {
        "ckpt_path": tiny_run,
        "data.dataroot": synthetic_root,
        "out": tmp_path / "pred",
        "hydra.run.dir": tmp_path / "run",
    }
    needles = {
        "missing_checkpoint": ("does not exist", "nope.ckpt"),
        "unknown_scene": ("unknown scene 'scene-9999'", "scene-0103", "scene-0061"),
        "unwritable_out": ("not a writable folder", "out="),
    }[case]
    if case == "missing_checkpoint":
        args["ckpt_path"] = tmp_path / "nope.ckpt"
    elif case == "unknown_scene":
        args["scene"] = "scene-9999"
    else:
        args["out"] = blocker / "pred"  # a folder under a file: cannot be created, even by root
    assert predict_cli_run([f"{k}={v}" for k, v in args.items()], monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-predict: error:", *needles)
