"""nuScenes data for Lift-Splat: reader, transforms, BEV rasterisation, LightningDataModule.

Names are imported lazily, so `import bev.data` is cheap (no lightning import for a DataLoader
worker or the gallery) and make_synthetic (bev.synthetic.writer) is only loaded when used.
"""

from __future__ import annotations

import importlib
from typing import Any

# Registers the `data` group's Hydra schemas, which configs/data/*.yaml extend (stdlib + hydra only).
from bev.data import config as _config  # noqa: F401

_EXPORTS = {
    "DataConfig": "bev.data.config",
    "DatasetConfig": "bev.data.config",
    "LoaderConfig": "bev.data.config",
    "NuScenesBEVDataset": "bev.data.nuscenes",
    "NuScenesDataModule": "bev.data.datamodule",
    "make_synthetic": "bev.synthetic.writer",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'bev.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
