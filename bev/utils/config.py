"""Hydra helpers: where the configs live, instantiating config groups, run-mode queries."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from bev.classes import class_names, normalize_map_layers

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")


def instantiate_list(node: DictConfig | None) -> list:
    """Instantiate every entry of a config group dict that has a _target_ (null entries switch one off)."""
    from hydra.utils import instantiate

    if not node:
        return []
    return [instantiate(c) for c in node.values() if c is not None and "_target_" in c]


def output_dir(cfg: DictConfig) -> Path | None:
    """The run directory (cfg.paths.output_dir), or None when the config has none."""
    try:
        return Path(cfg.paths.output_dir)
    except Exception:
        return None


def is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def task_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _class_names(categories, map_layers=None) -> list[str]:
    return list(class_names(categories, map_layers))


def _map_classes(map_layers=None) -> list[str]:
    return list(normalize_map_layers(map_layers))


def _as_list(names: list[str]):
    from omegaconf import OmegaConf

    # ListConfig, not list: OmegaConf.resolve can only put a container in place of an interpolation.
    return OmegaConf.create(names)


# The project's resolvers (bev.utils.trust lets stored configs call these and no other of its own).
RESOLVERS = {
    "bev.num_classes": lambda cats, layers=None: len(_class_names(cats, layers)),
    "bev.object_classes": lambda cats: _as_list(_class_names(cats)),
    "bev.map_classes": lambda layers=None: _as_list(_map_classes(layers)),
}


def register_resolvers() -> None:
    """Config resolvers so the model's head follows data.categories + data.map_layers:
    ${bev.num_classes:${data.categories},${data.map_layers}}, ${bev.object_classes:${data.categories}},
    ${bev.map_classes:${data.map_layers}}."""
    from omegaconf import OmegaConf

    for name, fn in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register_resolvers()
