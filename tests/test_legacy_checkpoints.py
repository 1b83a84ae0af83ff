"""Checkpoints bev-train wrote before models declared their tasks (tests/data/legacy_checkpoints, one per task) load,
score, export and resume: bev.utils.checkpoint.upgrade_checkpoint renames what changed."""

import json
from pathlib import Path

import pytest
import torch
from test_occupancy_data import occ_root  # noqa: F401 (the synthetic set with Occ3D labels)

from bev.utils.checkpoint import RENAMED_MODEL_KEYS, RENAMED_STATE, read_checkpoint
from bev.utils.legacy import SEGMENTATION_KEYS
from helpers.cli import TINY, eval_cli, train_cli

LEGACY = Path(__file__).parent / "data" / "legacy_checkpoints"
TASKS = {
    "segmentation": ("segmentation",),
    "detection": ("segmentation", "detection"),
    "motion": ("segmentation", "motion"),
    "occupancy": ("occupancy",),
}
# occupancy.ckpt's model and a two-step run (tests/data/legacy_checkpoints/README.md).
OCC_TINY = [
    "grid.xbound=[-40,40,1.6]",
    "grid.ybound=[-40,40,1.6]",
    "grid.dbound=[2,46,4]",
    "grid.zbound=[-1,5.4,1.6]",
    "data.final_dim=[32,96]",
    "data.batch_size=1",
    "data.num_workers=0",
    "model.net.camera.context_channels=8",
    "model.net.camera.widths=[8,8,16,16,16]",
    "model.net.camera.mid_channels=16",
    "model.net.decoder.widths=[8,8,8]",
    "model.net.heads.occupancy.channels=8",
    "model.net.decoder.widths=[8,8,8]",
    "+trainer.max_steps=2",
    "trainer.max_epochs=1",
    "+trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false",
    "callbacks.bev_png.every_n_steps=0",
    "callbacks.time_budget.budget=null",
]
# What bev-eval reports for each: a metric of the task, in metrics.json.
SCORED = {"segmentation": "iou", "detection": "NDS", "motion": "future_iou_long", "occupancy": "occ_miou"}


@pytest.mark.parametrize("task", TASKS)
def test_the_fixtures_are_of_the_earlier_layout(task):
    raw = torch.load(LEGACY / f"{task}.ckpt", map_location="cpu", weights_only=True)
    assert set(RENAMED_STATE) <= set(raw["state_dict"])
    if task != "occupancy":  # the occupancy module took no heads argument
        assert set(RENAMED_MODEL_KEYS) <= set(raw["bev_config"]["model"])


@pytest.mark.parametrize("task", TASKS)
def test_a_legacy_checkpoint_loads_with_its_tasks(task):
    import bev

    raw = torch.load(LEGACY / f"{task}.ckpt", map_location="cpu", weights_only=True)
    if task == "detection":  # trained with velocities from tracks over 1 s of past: scored within the rules
        with pytest.warns(UserWarning, match="beyond the nuScenes detection rules"):
            model = bev.load_model(LEGACY / f"{task}.ckpt")
        assert model.task_modules.detection.track.past_frames == 1
    else:
        model = bev.load_model(LEGACY / f"{task}.ckpt")
    assert model.tasks == TASKS[task]
    assert float(model.val_headline_best) == float(raw["state_dict"]["val_iou_best"])
    upgraded = read_checkpoint(LEGACY / f"{task}.ckpt")
    assert "val_iou_best" not in upgraded["state_dict"] and "heads" not in upgraded["bev_config"]["model"]
    # Segmentation's settings, stored at the top of model, are read under model.segmentation.
    stored, model_cfg = raw["bev_config"]["model"], upgraded["bev_config"]["model"]
    assert not set(SEGMENTATION_KEYS) & set(model_cfg)
    moved = {k: stored[k] for k in SEGMENTATION_KEYS if k in stored and task != "occupancy"}  # it stored none
    assert model_cfg.get("segmentation") == (moved or None) and (moved or task == "occupancy")
    if "segmentation" in model.tasks:
        weights = model.task_modules.segmentation.loss_fn.pos_weight.flatten().tolist()
        names = model.class_names
        want = moved["pos_weight"]
        want = [want.get(n, 1.0) for n in names] if isinstance(want, dict) else [float(want)] * len(names)
        assert weights == pytest.approx(want)


CRAFTED = {  # where a stored config of the earlier layout is not what bev-train wrote
    "module target not a string": lambda m: m.update(_target_={"_target_": "os.system"}),
    "net target not a string": lambda m: m["net"].update(_target_=["bev.models.LiftSplatShoot"]),
    "camera a list": lambda m: m["net"].update(camera=[1, 2, 3]),
    "detection a string": lambda m: m["net"].update(detection="os.system"),
    "tasks a number": lambda m: m.update(heads=7),
}


@pytest.mark.parametrize("craft", CRAFTED)
def test_a_crafted_legacy_config_is_refused_in_one_line(craft, tmp_path):
    from bev.inference import load_checkpoint
    from bev.utils.trust import UntrustedCheckpointError

    raw = torch.load(LEGACY / "motion.ckpt", map_location="cpu", weights_only=True)  # a legacy module and net
    CRAFTED[craft](raw["bev_config"]["model"])
    torch.save(raw, tmp_path / "crafted.ckpt")
    with pytest.raises(UntrustedCheckpointError) as e:
        load_checkpoint(tmp_path / "crafted.ckpt")
    assert "\n" not in str(e.value) and "trust_checkpoint=true" in str(e.value)


@pytest.mark.e2e
@pytest.mark.parametrize("task", TASKS)
def test_bev_eval_scores_a_legacy_checkpoint(task, synthetic_root, occ_root, tmp_path, monkeypatch):  # noqa: F811
    root = occ_root if task == "occupancy" else synthetic_root
    args = [f"ckpt_path={LEGACY / f'{task}.ckpt'}", f"data.dataroot={root}", f"hydra.run.dir={tmp_path}"]
    assert eval_cli(args, monkeypatch) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())["metrics"]
    assert SCORED[task] in metrics


@pytest.mark.e2e
def test_bev_export_writes_a_legacy_checkpoint(tmp_path, monkeypatch):
    from bev import export as bev_export
    from helpers.cli import run_cli

    out = tmp_path / "model.pt2"
    args = [f"ckpt_path={LEGACY / 'detection.ckpt'}", f"out={out}", "format=torch_export", "check=false"]
    assert run_cli(bev_export.main, args, monkeypatch) == 0
    assert out.is_file() and out.stat().st_size > 0


@pytest.mark.e2e
def test_a_run_resumes_from_a_legacy_checkpoint(synthetic_root, tmp_path, monkeypatch):
    legacy = LEGACY / "segmentation.ckpt"
    args = [
        *TINY,
        "trainer.max_epochs=2",
        "callbacks.bev_png.every_n_steps=0",
        f"ckpt_path={legacy}",
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={tmp_path}",
    ]
    assert train_cli(args, monkeypatch) == 0
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    started = torch.load(legacy, map_location="cpu", weights_only=True)
    assert last["global_step"] > started["global_step"] and "val_headline_best" in last["state_dict"]


@pytest.mark.e2e
def test_a_voxel3d_occupancy_run_starts_from_a_checkpoint(occ_root, tmp_path, monkeypatch):  # noqa: F811
    # BEVDet-Occ's load_from: model.init_from on the kind without a 2D BEV decoder
    args = [
        "experiment=synthetic_occ_cpu",
        "model=occ_small",
        *OCC_TINY,
        f"model.init_from={LEGACY / 'occupancy.ckpt'}",
        f"data.dataroot={occ_root}",
        f"hydra.run.dir={tmp_path}",
    ]
    assert train_cli(args, monkeypatch) == 0
