"""Shared fixtures."""
from __future__ import annotations

from pathlib import Path

# Lightning gives its logger a StreamHandler on sys.stderr when first imported. Imported first
# inside a capsys test, that handler would keep the test's stream, closed afterwards, and every
# later Lightning log line would print a "Logging error" traceback into other tests' stderr.
import lightning.pytorch  # noqa: F401
import pytest


@pytest.fixture(scope="session")
def synthetic_root(tmp_path_factory) -> Path:
    """A small synthetic nuScenes-format dataroot, written once per test session.

    2 scenes x 3 key frames, seed 0: scene-0061 (mini_train) and scene-0103 (mini_val).
    Load it with NuScenes("v1.0-mini", dataroot=synthetic_root). Treat it as read-only.
    """
    from bev.synthetic.writer import make_synthetic

    return make_synthetic(tmp_path_factory.mktemp("synthetic") / "nuscenes", scenes=2, samples_per_scene=3, seed=0,
                          progress=False)
