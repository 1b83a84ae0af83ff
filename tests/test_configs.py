"""Every config composes; every experiment instantiates its model and datamodule (no training)."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict

from bev.geometry import Grid
from bev.train import CONFIG_DIR
from bev.utils.precision import resolve_precision

EXPERIMENTS = sorted(p.stem for p in (Path(CONFIG_DIR) / "experiment").glob("*.yaml"))
TRAINERS = sorted(p.stem for p in (Path(CONFIG_DIR) / "trainer").glob("*.yaml"))
DEBUGS = sorted(p.stem for p in (Path(CONFIG_DIR) / "debug").glob("*.yaml"))
SEARCHES = ["lr_grid", "optuna"]  # optuna: the hydra-optuna-sweeper plugin (the test and sweep extras)


def compose_train(tmp_path, overrides=(), keep_hydra=False):
    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
    HydraConfig().set_config(cfg)  # resolves ${hydra:runtime.output_dir} as in a real run
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
        if not keep_hydra:  # the task sees no hydra node, as in a real run
            del cfg.hydra
    return cfg


def test_expected_experiments_exist():
    assert {"synthetic_cpu", "lss_nuscenes_mini", "lss_nuscenes_trainval"} <= set(EXPERIMENTS)
    assert {"cpu", "gpu", "ddp"} <= set(TRAINERS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_composes_and_instantiates(experiment, tmp_path):
    # Pretrained weights off: no download here; the weights code path has its own tests.
    lidar_only = experiment in ("synthetic_lidar_cpu", "lidar_nuscenes")  # no camera branch to download for
    no_download = [] if lidar_only else ["model.net.camera.weights=null"]
    cfg = compose_train(tmp_path, [f"experiment={experiment}", *no_download])
    OmegaConf.resolve(cfg)
    # One grid for data and model, and the model's input size is the data's crop.
    assert cfg.data.grid == cfg.grid == cfg.model.net.grid
    assert list(cfg.model.net.image_size) == list(cfg.data.final_dim)
    dm = instantiate(cfg.data)
    model = instantiate(cfg.model)
    assert dm.grid == Grid.from_any(cfg.grid) == model.net.grid
    if model.net.camera is not None:
        assert model.net.camera.frustum.shape[:3] == (
            Grid.from_any(cfg.grid).depth_bins,
            *(d // 16 for d in cfg.data.final_dim),
        )
    assert cfg.trainer.gradient_clip_val == 5.0
    for cb in cfg.callbacks.values():
        instantiate(cb)


def test_lss_paper_settings():
    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["experiment=lss_nuscenes_trainval"])
    g = Grid.from_any(cfg.grid)
    assert g.bev_shape == (200, 200) and g.depth_bins == 41
    assert (g.xbound, g.ybound, g.dbound) == ((-50, 50, 0.5), (-50, 50, 0.5), (4, 45, 1))
    assert cfg.trainer.gradient_clip_val == 5.0 and cfg.data.version == "v1.0-trainval"
    assert list(cfg.data.final_dim) == [128, 352] and cfg.data.batch_size == 4
    assert cfg.model.optimizer.lr == 1e-3 and cfg.model.optimizer.weight_decay == 1e-7
    assert cfg.model.segmentation.pos_weight == 2.13
    assert cfg.model.net.camera.backbone == "efficientnet_b0"


@pytest.mark.parametrize("trainer", TRAINERS)
def test_trainer_configs_compose(trainer, tmp_path):
    cfg = compose_train(tmp_path, [f"trainer={trainer}"])
    assert cfg.trainer._target_ == "lightning.pytorch.Trainer"
    if cfg.trainer.accelerator == "cpu":
        precision = resolve_precision(cfg.trainer.precision, cfg.trainer.accelerator)[0]  # "auto", as bev.train does
        instantiate(cfg.trainer, precision=precision, logger=False, enable_checkpointing=False)


@pytest.mark.parametrize("debug", DEBUGS)
def test_debug_configs_compose(debug, tmp_path):
    cfg = compose_train(tmp_path, ["experiment=synthetic_cpu", f"debug={debug}"])
    assert cfg.trainer.max_epochs >= 1


@pytest.mark.parametrize("search", SEARCHES)
def test_hparams_search_configs_compose(search, tmp_path):
    cfg = compose_train(tmp_path, ["experiment=synthetic_cpu", f"hparams_search={search}"], keep_hydra=True)
    assert cfg.hydra.sweeper.params


def test_eval_config_composes():
    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        cfg = compose("eval", overrides=["ckpt_path=x.ckpt", "data.dataroot=/d"])
    assert cfg.data.dataroot == "/d" and cfg.data.batch_size is None


def test_slurm_launcher_config_is_optional():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="optional extra: pip install -e '.[cluster]'")
    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    assert "submitit" in cfg.hydra.launcher._target_


def test_make_train_time_budget_overrides_compose(tmp_path):
    # What `make train` passes: no budget, a deadline in Unix seconds (see the Makefile).
    from bev.callbacks import TimeBudget

    cfg = compose_train(
        tmp_path,
        [
            "experiment=synthetic_cpu",
            "callbacks.time_budget.budget=null",
            "callbacks.time_budget.deadline=1800000000",
            "callbacks.time_budget.reserve_validations=1",
            "callbacks.time_budget.min_train_s=120",
            "callbacks.time_budget.reserve_startup=true",
        ],
    )
    callback = instantiate(cfg.callbacks.time_budget)
    assert isinstance(callback, TimeBudget) and callback.budget is None and callback.deadline == 1.8e9
    assert callback.reserve_validations == 1 and callback.skip_epochs == 1  # the experiment's own setting survives
    assert callback.min_train_s == 120 and callback.reserve_startup


@pytest.mark.parametrize("cuda", [False, True])
def test_make_train_takes_the_gpu_when_there_is_one(cuda, tmp_path, monkeypatch, capsys):
    """The embedded experiment resolves its device at start: a (mocked) CUDA device gets the run in bf16,
    a machine without one the CPU as before; the CPU thread tuning applies on the CPU only."""
    import torch

    from bev.train import _resolve_auto_accelerator, _resolve_auto_precision
    from bev.utils.precision import cpu_bf16_support
    from bev.utils.threads import resolve_threads

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Mock GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    cfg = compose_train(tmp_path, ["experiment=synthetic_cpu"])
    assert cfg.trainer.accelerator == "auto" and cfg.trainer.precision == "auto"
    _resolve_auto_accelerator(cfg)
    _resolve_auto_precision(cfg)
    out = capsys.readouterr().out
    if cuda:
        assert cfg.trainer.accelerator == "gpu" and cfg.trainer.precision == "bf16-mixed"
        assert "trainer.accelerator: gpu (Mock GPU)" in out
        assert resolve_threads(cfg.threads, 0, cfg.trainer.accelerator)[0] is None  # torch's own on a GPU
    else:
        assert cfg.trainer.accelerator == "cpu" and "no CUDA device visible" in out
        assert cfg.trainer.precision == ("bf16-mixed" if cpu_bf16_support() else "32-true")
        assert resolve_threads(cfg.threads, 0, cfg.trainer.accelerator)[0] is not None
