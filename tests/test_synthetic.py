"""The synthetic nuScenes-format dataset: devkit compatibility, links, splits, geometry, errors."""
from __future__ import annotations

import json

import pytest

from bev.data.synthetic import TABLES, VERSION


def test_devkit_loads_all_tables(synthetic_root):
    from nuscenes.nuscenes import NuScenes

    nusc = NuScenes(version=VERSION, dataroot=str(synthetic_root), verbose=False)
    for name in TABLES:
        on_disk = json.loads((synthetic_root / VERSION / f"{name}.json").read_text())
        assert len(getattr(nusc, name)) == len(on_disk) > 0, name
    assert len(nusc.scene) == 2 and len(nusc.sample) == 6
    assert len(nusc.sample_data) == 6 * 7
