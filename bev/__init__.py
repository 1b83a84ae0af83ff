"""Lift-Splat bird's-eye-view perception training pipeline.

    model = bev.load_model("path/to/run_or.ckpt")   # eval-mode BEVLitModule (see bev.inference)
    probs = bev.predict(model, batch)               # (B, K, X, Y) probabilities

Names are imported lazily, so `import bev` stays cheap (no torch or lightning import).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {"load_model": "bev.inference", "predict": "bev.inference"}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'bev' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
