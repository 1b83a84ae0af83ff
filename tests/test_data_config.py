"""The data arguments, declared once (bev.data.config): the dataset, the DataModule and the YAML share
DataConfig; unknown names and bad values are refused by name, before any data is read."""

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict

from bev.data import NuScenesBEVDataset, NuScenesDataModule
from bev.data.config import FROM_CHECKPOINT, DataConfig, DatasetConfig, LoaderConfig
from bev.geometry import Grid
from bev.inference import build_data_config
from bev.train import CONFIG_DIR
from helpers.cli import TINY, assert_one_paragraph, train_cli

DATA_YAMLS = Path(CONFIG_DIR) / "data"
LOADER_KEYS = {"batch_size", "num_workers", "pin_memory", "persistent_workers"}
MODULE_KEYS = {"train_split", "val_split", "augment", "cbgs"}


def compose_cfg(name: str, overrides=(), tmp_path=None):
    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        cfg = compose(name, overrides=list(overrides), return_hydra_config=True)
    HydraConfig().set_config(cfg)  # resolves ${hydra:...} as in a real run
    with open_dict(cfg):
        del cfg.hydra
    return cfg


# ---------------------------------------------------------------- one declaration


def test_the_three_parts_split_the_keys_without_overlap():
    dataset, loader, module = set(DatasetConfig.keys()), set(LoaderConfig.keys()), set(DataConfig.keys())
    assert loader == LOADER_KEYS and not dataset & loader
    assert module == dataset | loader | MODULE_KEYS
    # The dataset's own arguments are its constructor's, not shared settings.
    own = set(inspect.signature(NuScenesBEVDataset).parameters) - {"dataroot", "config", "options"}
    assert own == {"split", "augment", "verbose"} and not own & dataset


def test_every_field_has_a_default_a_check_and_a_comment():
    source = Path(inspect.getfile(DataConfig)).read_text()
    lines = source.splitlines()
    commented = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            line, above = lines[node.lineno - 1], lines[node.lineno - 2].strip()
            if "  # " in line or above.startswith("# "):
                commented.add(node.target.id)
    for f in dataclasses.fields(DataConfig):
        assert f.name in commented, f"{f.name} has no comment"
        assert callable(f.metadata["check"]), f.name
        assert (f.default is dataclasses.MISSING) == (f.name == "dataroot"), f.name


def test_the_yaml_states_only_what_differs_from_the_defaults():
    defaults = {f.name: f.default for f in dataclasses.fields(DataConfig)}
    for name in ("nuscenes", "synthetic"):
        stated = yaml.safe_load((DATA_YAMLS / f"{name}.yaml").read_text())
        for key, value in stated.items():
            if key in ("defaults", "_target_"):
                continue
            assert key in defaults, f"{name}.yaml: {key}"
            default = defaults[key]
            assert value not in (default, list(default) if isinstance(default, tuple) else default), key
    assert set(yaml.safe_load((DATA_YAMLS / "synthetic.yaml").read_text())) == {"defaults", "dataroot"}


def test_the_composed_data_node_is_dataconfig_with_its_defaults():
    cfg = compose_cfg("train")
    assert set(cfg.data) == {"_target_", *DataConfig.keys()}
    values = OmegaConf.to_container(cfg.data, resolve=True)
    assert values.pop("_target_") == "bev.data.NuScenesDataModule"
    built = DataConfig.build(values)
    assert built == DataConfig(dataroot=built.dataroot, grid=built.grid)  # the dataclass defaults, independently
    assert built.grid == Grid.from_any(OmegaConf.to_container(cfg.grid, resolve=True))


def test_checkpoint_schema_offers_every_key_but_the_checkpoints_own():
    node = compose_cfg("eval", ["ckpt_path=x"]).data
    assert set(node) == set(DataConfig.keys()) - set(FROM_CHECKPOINT)
    assert all(node[k] is None for k in node if k != "input_memo_mb") and node.input_memo_mb == 0


# ---------------------------------------------------------------- refused by name


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("batch_size", 0, "data.batch_size must be a whole number >= 1, got 0"),
        ("batch_size", -2, "data.batch_size must be a whole number >= 1"),
        ("batch_size", 2.5, "data.batch_size must be a whole number >= 1, got 2.5"),
        ("batch_size", True, "data.batch_size must be a whole number"),
        ("num_workers", -1, "data.num_workers must be a whole number >= 0"),
        ("pin_memory", "yes", "data.pin_memory must be true or false"),
        ("persistent_workers", 1, "data.persistent_workers must be true or false"),
        ("ncams", 7, "data.ncams must be a whole number >= 1 and <= 6"),
        ("final_dim", [128], "data.final_dim must be [H, W]"),
        ("final_dim", [128, 0], "data.final_dim must be [H, W]"),
        ("rot_lim", [5.0, -5.0], "data.rot_lim must be [lo, hi] with lo <= hi"),
        ("resize_lim", "0.2", "data.resize_lim must be [lo, hi]"),
        ("input_memo_mb", -1, "data.input_memo_mb must be >= 0"),
        ("input_memo_mb", float("inf"), "data.input_memo_mb must be a finite number"),
        ("past_frames", 1.5, "data.past_frames must be a whole number >= 0"),
        ("raster", "fill", "unknown data.raster 'fill'"),
        ("label_warp", "warp", "unknown data.label_warp 'warp'"),
        ("map_layers", ["road"], "unknown map layer(s) ['road'] in data.map_layers"),
        ("version", "", "data.version must be a non-empty string"),
        ("augment", "false", "data.augment must be true or false"),
    ],
)
def test_bad_values_are_refused_by_name(key, value, needle, tmp_path):
    # The folder does not exist: an error about it would mean data was read before the check.
    with pytest.raises(ValueError) as e:
        NuScenesDataModule(tmp_path / "none", **{key: value})
    assert needle in str(e.value)


def test_unknown_names_get_a_did_you_mean(tmp_path):
    with pytest.raises(ValueError, match=r"unknown DataConfig key\(s\) 'batch_sise' \(did you mean 'batch_size'\?\)"):
        NuScenesDataModule(tmp_path, batch_sise=2)
    with pytest.raises(ValueError, match=r"'map_layer' \(did you mean 'map_layers'\?\)"):
        NuScenesBEVDataset(tmp_path, map_layer="lss")
    # Loader settings are not the dataset's, module settings not the loader's.
    with pytest.raises(ValueError, match=r"unknown DatasetConfig key\(s\) 'batch_size'"):
        NuScenesBEVDataset(tmp_path, batch_size=2)
    with pytest.raises(ValueError, match=r"'zzz'; the keys are"):
        LoaderConfig.build(zzz=1)
    with pytest.raises(ValueError, match="data.dataroot is required"):
        NuScenesDataModule()


def test_hydra_refuses_bad_types_and_unknown_keys_at_composition_and_instantiation():
    with pytest.raises(ConfigCompositionException, match="data.batch_size=abc"):
        compose_cfg("train", ["data.batch_size=abc"])
    with pytest.raises(ConfigCompositionException, match="data.batch_sise"):
        compose_cfg("train", ["data.batch_sise=2"])
    added = compose_cfg("train", ["+data.batch_sise=2"])  # `+` adds the key; the DataModule refuses it
    with pytest.raises(Exception) as e:
        instantiate(added.data)
    assert "did you mean 'batch_size'" in str(e.value.__cause__ or e.value)


@pytest.mark.e2e
def test_bev_train_refuses_batch_size_0_before_the_data_is_read(tmp_path, monkeypatch, capsys):
    args = [*TINY, "data.batch_size=0", f"data.dataroot={tmp_path / 'none'}", f"hydra.run.dir={tmp_path / 'run'}"]
    assert train_cli(args, monkeypatch) == 1
    err = capsys.readouterr().err
    assert_one_paragraph(err, "bev-train: error:", "data.batch_size must be a whole number >= 1, got 0")
    assert "none" not in err.split("(traceback")[0]  # not the missing dataroot: nothing was read


# ---------------------------------------------------------------- values reach the datasets


def test_hydra_values_are_normalised_and_reach_both_datasets(synthetic_root, tmp_path):
    cfg = compose_cfg(
        "train",
        [
            "experiment=synthetic_cpu",
            f"data.dataroot={synthetic_root}",
            f"data.cache_dir={tmp_path}",
            "data.categories=[[vehicle.],[human.]]",
            "data.rot_lim=[-2,2]",
            "data.ncams=4",
            "data.batch_size=3",
        ],
    )
    dm = instantiate(cfg.data)
    c = dm.config
    assert c.categories == (("vehicle.",), ("human.",)) and c.rot_lim == (-2.0, 2.0) and c.ncams == 4
    assert (
        isinstance(c.final_dim, tuple)
        and isinstance(c.grid, Grid)
        and c.loader
        == LoaderConfig(
            batch_size=3,
            num_workers=int(cfg.data.num_workers),
            pin_memory=False,
            persistent_workers=c.persistent_workers,
        )
    )
    dm.setup("fit")
    for ds, split, augment in ((dm.train_set, "mini_train", c.augment), (dm.val_set, "mini_val", False)):
        assert ds.config == c.dataset and (ds.split, ds.augment) == (split, augment)
        assert ds.rot_lim == (-2.0, 2.0) and ds.ncams == 4 and ds.num_object_classes == 2
    assert dm.train_dataloader().batch_size == 3


def test_a_config_object_and_keywords_combine(tmp_path):
    base = DataConfig(dataroot=str(tmp_path), batch_size=2, map_layers="lss")
    dm = NuScenesDataModule(config=base, num_workers=0)
    assert dm.config == dataclasses.replace(base, num_workers=0) and dm.config.map_layers == (
        "drivable_area",
        "divider",
    )
    assert dm.persistent_workers is False and dm.class_names == ("vehicle", "drivable_area", "divider")
    assert DatasetConfig.build(base, version="v1.0-trainval").version == "v1.0-trainval"


# ---------------------------------------------------------------- checkpoints


# The data node bev-train stored in checkpoints before DataConfig (resolved configs/data/nuscenes.yaml),
# and an older one, from before depth targets and windows existed.
STORED = {
    "_target_": "bev.data.NuScenesDataModule",
    "dataroot": "/data/nuscenes",
    "version": "v1.0-mini",
    "train_split": "mini_train",
    "val_split": "mini_val",
    "grid": {"xbound": [-20, 20, 0.5], "ybound": [-20, 20, 0.5], "zbound": [-10, 10, 20], "dbound": [4, 45, 1]},
    "final_dim": [64, 176],
    "augment": True,
    "resize_lim": None,
    "bot_pct_lim": None,
    "rot_lim": None,
    "rand_flip": True,
    "ncams": 6,
    "categories": ["vehicle."],
    "map_layers": None,
    "raster": "center",
    "depth_target": False,
    "input_memo_mb": 0,
    "past_frames": 0,
    "future_frames": 0,
    "filter_invisible": False,
    "label_warp": "exact",
    "batch_size": 4,
    "num_workers": 2,
    "pin_memory": False,
    "persistent_workers": True,
    "cache_dir": None,
}
OLDER = {k: v for k, v in STORED.items() if k not in ("depth_target", "input_memo_mb", "past_frames", "future_frames")}
OLDER = {k: v for k, v in OLDER.items() if k not in ("filter_invisible", "label_warp", "map_layers", "raster")}


@pytest.mark.parametrize("stored", [STORED, OLDER], ids=["current", "older"])
def test_stored_data_configs_load_with_eval_overrides(stored, tmp_path):
    run = OmegaConf.create({"grid": stored["grid"], "data": stored})
    given = compose_cfg("eval", ["ckpt_path=x", "data.batch_size=8", "data.past_frames=1", f"data.dataroot={tmp_path}"])
    dm = instantiate(build_data_config(given.data, run))
    c = dm.config
    assert (c.batch_size, c.past_frames, c.dataroot, c.augment) == (8, 1, str(tmp_path), False)
    assert c.final_dim == (64, 176) and c.grid == Grid.from_any(stored["grid"]) and c.version == "v1.0-mini"
    assert c.depth_target is False and c.label_warp == "exact"  # the defaults, for keys older checkpoints lack


def test_an_unknown_eval_override_is_refused_by_name(tmp_path):
    run = OmegaConf.create({"grid": STORED["grid"], "data": STORED})
    given = compose_cfg("eval", ["ckpt_path=x", "+data.past_frame=1"])
    with pytest.raises(Exception) as e:
        instantiate(build_data_config(given.data, run))
    assert "did you mean 'past_frames'" in str(e.value.__cause__ or e.value)
