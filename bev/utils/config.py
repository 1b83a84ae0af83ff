"""Hydra helpers: where the configs live, instantiating config groups, run-mode queries."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

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
