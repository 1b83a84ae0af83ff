"""Facts of the real nuScenes v1.0-mini camera rig and scenes, shipped with the package.

Cheap to import (json only): the op benchmark, the geometry tests and the data reader use it
without importing the synthetic renderer. The calibration itself lives in nuscenes_rig.json
next to this file.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

IMAGE_W, IMAGE_H = 1600, 900  # every nuScenes camera image (the rig's image_size)

# Location of each v1.0-mini scene in the real dataset (the log table's `location`, which is
# also the map-expansion map name).
MINI_LOCATIONS = {
    "scene-0061": "singapore-onenorth",
    "scene-0103": "boston-seaport",
    "scene-0553": "boston-seaport",
    "scene-0655": "boston-seaport",
    "scene-0757": "boston-seaport",
    "scene-0796": "singapore-queenstown",
    "scene-0916": "singapore-queenstown",
    "scene-1077": "singapore-hollandvillage",
    "scene-1094": "singapore-hollandvillage",
    "scene-1100": "singapore-hollandvillage",
}


@lru_cache(maxsize=1)
def load_rig() -> dict:
    """The real nuScenes camera rig (bev/data/nuscenes_rig.json): cameras, camera_order, image_size, mini_splits."""
    return json.loads(resources.files("bev.data").joinpath("nuscenes_rig.json").read_text())


def mini_splits() -> dict[str, list[str]]:
    """{"mini_train": [...], "mini_val": [...]}: the devkit's create_splits_scenes() for v1.0-mini,
    bundled (importing the devkit costs seconds; a test checks these lists against it)."""
    return {k: list(v) for k, v in load_rig()["mini_splits"].items()}
