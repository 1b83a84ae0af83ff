"""A checkpoint never runs code: a stored config naming anything but the project's own targets is refused
by every loader (bev.load_model, bev-eval, bev-predict, bev-export) before anything is built."""

import copy
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

import bev
from bev import export as bev_export
from bev import predict_cli
from bev.utils.config import CONFIG_DIR
from bev.utils.trust import UntrustedCheckpointError, allowed_targets, first_untrusted
from helpers.cli import assert_one_paragraph, eval_cli, run_cli

EXPERIMENTS = sorted(p.stem for p in (Path(CONFIG_DIR) / "experiment").glob("*.yaml"))


def _touch(marker: Path) -> dict:
    return {"_target_": "pathlib.Path.touch", "self": str(marker)}


def _deep_system(marker: Path) -> dict:
    """os.system three levels down, inside the _args_ of an allowed partial."""
    return {
        "_target_": "torch.optim.Adam",
        "_partial_": True,
        "_args_": [{"groups": [{"deep": {"_target_": "os.system", "_args_": [f"touch {marker}"]}}]}],
    }


ATTACKS = {  # name -> (where in the stored config, the node put there, the key path the refusal names)
    "touch": (("model", "optimizer"), _touch, "model.optimizer._target_"),
    "os_system_deep": (("model", "optimizer"), _deep_system, "model.optimizer._args_[0].groups[0].deep._target_"),
    "touch_in_data": (("data", "cache_dir"), _touch, "data.cache_dir._target_"),
}


def crafted(run: Path, tmp_path: Path, attack: str) -> tuple[Path, Path, str]:
    """(checkpoint, marker file the attack would create, key path) of the run's last.ckpt with `attack` injected."""
    where, node, key = ATTACKS[attack]
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    marker = tmp_path / f"pwned_{attack}"
    parent = ckpt["bev_config"]
    for k in where[:-1]:
        parent = parent[k]
    parent[where[-1]] = node(marker)
    path = tmp_path / f"{attack}.ckpt"
    torch.save(ckpt, path)
    return path, marker, key


def test_an_honest_checkpoint_loads(tiny_run):
    assert first_untrusted(torch.load(tiny_run / "checkpoints" / "last.ckpt", weights_only=True)["bev_config"]) is None
    assert bev.load_model(tiny_run).net is not None


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_load_model_refuses_and_runs_nothing(attack, tiny_run, tmp_path):
    path, marker, key = crafted(tiny_run, tmp_path, attack)
    with pytest.raises(UntrustedCheckpointError) as e:
        bev.load_model(path)
    msg = str(e.value)
    assert key in msg and ("os.system" in msg or "pathlib.Path.touch" in msg) and "trusted=True" in msg
    assert len(msg.splitlines()) == 1
    assert not marker.exists()


@pytest.mark.parametrize("attack", ["touch", "os_system_deep", "touch_in_data"])
def test_bev_eval_and_predict_refuse_and_run_nothing(attack, tiny_run, synthetic_root, tmp_path, monkeypatch, capsys):
    path, marker, key = crafted(tiny_run, tmp_path, attack)
    common = [f"ckpt_path={path}", f"data.dataroot={synthetic_root}", f"hydra.run.dir={tmp_path / 'run'}"]
    assert eval_cli(common, monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-eval: error:", key, "trust_checkpoint=true")
    assert run_cli(predict_cli._hydra_main, [*common, f"out={tmp_path / 'pred'}"], monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-predict: error:", key, "trust_checkpoint=true")
    assert not marker.exists() and not list((tmp_path / "pred").rglob("*.npz"))


def test_bev_export_refuses_and_runs_nothing(tiny_run, tmp_path, monkeypatch, capsys):
    path, marker, key = crafted(tiny_run, tmp_path, "touch")
    args = [
        f"ckpt_path={path}",
        f"out={tmp_path / 'm.pt2'}",
        "format=torch_export",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    assert run_cli(bev_export._hydra_main, args, monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-export: error:", key)
    assert not marker.exists() and not (tmp_path / "m.pt2").exists()


def test_trusting_a_file_is_an_explicit_choice(tiny_run, tmp_path):
    path, marker, _ = crafted(tiny_run, tmp_path, "touch")
    bev.load_model(path, trusted=True)  # the user vouched for the file: its config is used as stored
    assert marker.exists()


@pytest.mark.parametrize(
    "value", ["${oc.env:HOME}", "x${oc.env:HOME}", "${bev.num_classes:'${oc.env:USER}'}", "${ oc.decode :'1'}"]
)
def test_resolvers_other_than_the_projects_are_refused(value):
    key, what = first_untrusted({"data": {"dataroot": value}})
    assert key == "data.dataroot" and what.startswith("resolver 'oc.")


def test_the_projects_resolvers_and_plain_interpolations_pass():
    cfg = {
        "data": {"categories": ["vehicle."], "map_layers": None},
        "grid": {"x": 1},
        "model": {
            "num_classes": "${bev.num_classes:${data.categories},${data.map_layers}}",
            "grid": "${grid}",
            "names": "${bev.object_classes:${data.categories}}",
            "lr": "${oc.select:model.base_lr,0.1}",
        },
    }
    assert first_untrusted(cfg) is None


@pytest.mark.parametrize(
    "bad",
    [
        {"_target_": ["os", "system"]},
        {"a": [[{"_target_": "builtins.eval"}]]},
        {"_target_": "bev.utils.io.atomic_write"},
        {"_target_": "torch.load"},
    ],
)
def test_odd_and_unlisted_targets_are_refused(bad):
    assert first_untrusted({"model": bad}) is not None


def test_the_allowlist_comes_from_the_configs():
    targets = allowed_targets()
    assert {
        "bev.lit.BEVLitModule",
        "bev.models.BEVNet",
        "bev.data.NuScenesDataModule",
        "torch.optim.AdamW",
        "bev.schedule.OneCycle",
        "torch.optim.lr_scheduler.OneCycleLR",
        "torch.optim.SGD",
    } <= targets
    assert not any(t.startswith(("hydra", "optuna", "os.", "builtins", "pathlib")) for t in targets)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_config_would_be_accepted(experiment, tmp_path):
    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={experiment}", "logger=many"], return_hydra_config=True)
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
        del cfg.hydra
    stored = OmegaConf.to_container(cfg, resolve=True)  # what bev-train puts into its checkpoints
    assert first_untrusted(stored) is None
    assert first_untrusted(copy.deepcopy(stored) | {"extra": {"_target_": "os.system"}})[0] == "extra._target_"


def test_without_the_configs_folder_nothing_is_trusted(monkeypatch, tmp_path):
    import bev.utils.config

    monkeypatch.setattr(bev.utils.config, "CONFIG_DIR", str(tmp_path / "no_configs"))
    allowed_targets.cache_clear()
    try:
        with pytest.raises(UntrustedCheckpointError, match="configs/ folder .* is missing"):
            first_untrusted({"model": {"_target_": "bev.lit.BEVLitModule"}})
    finally:
        allowed_targets.cache_clear()


def test_a_stored_config_names_no_place_on_disk():
    """Every setting that names a place on disk is dropped from a stored config, wherever it sits (docs/inference.md)."""
    from bev.utils.checkpoint import without_places

    stored = {
        "data": {"dataroot": "/theirs", "cache_dir": "/theirs/cache", "batch_size": 2, "version": "v1.0-mini"},
        "paths": {"output_dir": "/o", "more": {"root_dir": "/r"}, "list": ["/a"]},
        "callbacks": {"model_checkpoint": {"dirpath": "/ck", "monitor": "val/iou"}},
        "logger": [{"save_dir": "/logs", "name": "csv"}],
        "trainer": {"default_root_dir": "/t", "max_epochs": 1},
        "model": {"init_from": "/i.ckpt", "net": {"camera": {"weights_path": "/w.pth", "weights": None}}},
        "ckpt_path": "/resume.ckpt",
        "some_file": "/f",
    }
    assert without_places(stored) == {
        "data": {"dataroot": None, "cache_dir": None, "batch_size": 2, "version": "v1.0-mini"},
        "paths": {"output_dir": None, "more": {"root_dir": None}, "list": [None]},
        "callbacks": {"model_checkpoint": {"dirpath": None, "monitor": "val/iou"}},
        "logger": [{"save_dir": None, "name": "csv"}],
        "trainer": {"default_root_dir": None, "max_epochs": 1},
        "model": {"init_from": None, "net": {"camera": {"weights_path": None, "weights": None}}},
        "ckpt_path": None,
        "some_file": None,
    }
    assert stored["data"]["dataroot"] == "/theirs"  # a copy: the checkpoint's own dict is left as read


DELETE = object()
SHAPES = {  # name -> (where in the stored config, the node put there, the key the refusal names)
    "model-a-string": (("model",), "lss", "config's model is of type str ('lss')"),
    "model-null": (("model",), None, "config's model is null"),
    "model-a-list": (("model",), [1, 2], "config's model is of type list"),
    "net-a-string": (("model", "net"), "x", "config's model.net is of type str"),
    "camera-missing": (("model", "net", "camera"), DELETE, "config's model.net.camera is missing"),
    "grid-a-string": (("grid",), "x", "config's grid is of type str"),
    "data-a-number": (("data",), 5, "config's data is of type int"),
    "trainer-a-string": (("trainer",), "x", "config's trainer is of type str"),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_stored_config_of_the_wrong_shape_is_refused_naming_the_key(shape, tiny_run, tmp_path):
    from bev.utils.checkpoint import CheckpointError

    where, node, said = SHAPES[shape]
    ckpt = torch.load(tiny_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    parent = ckpt["bev_config"]
    for k in where[:-1]:
        parent = parent[k]
    if node is DELETE:
        del parent[where[-1]]
    else:
        parent[where[-1]] = node
    path = tmp_path / f"{shape}.ckpt"
    torch.save(ckpt, path)
    with pytest.raises(CheckpointError) as e:
        bev.load_model(path)
    msg = str(e.value)
    assert said in msg and str(path) in msg and "Use a checkpoint bev-train wrote" in msg, msg
    assert len(msg.splitlines()) == 1
