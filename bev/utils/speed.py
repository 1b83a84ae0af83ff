"""Speed switches of a training run: the torch.compile mode (model.compile) and the fused optimiser step."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

# torch.compile modes model.compile takes ("off" / false: eager; true: "default"). "reduce-overhead" adds CUDA
# graphs on a GPU (on a CPU it compiles as "default"); "max-autotune" also benchmarks kernel choices.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


def compile_mode(value) -> str | None:
    """model.compile -> the torch.compile mode, or None for eager (false, null, "off")."""
    if value is None or value is False or (isinstance(value, str) and value.lower() in ("off", "false", "none")):
        return None
    if value is True or (isinstance(value, str) and value.lower() in ("true", "on")):
        return "default"
    if isinstance(value, str) and value in COMPILE_MODES:
        return value
    raise ValueError(
        f"model.compile must be false (eager), true (= default) or a torch.compile mode "
        f"({', '.join(COMPILE_MODES)}), got {value!r}"
    )


def fused_default(
    factory: Callable[..., torch.optim.Optimizer], device_type: str, precision: str | None = None
) -> dict:
    """{"fused": True} for Adam or AdamW on CUDA parameters when the config chose neither fused nor foreach.

    On a GPU the default multi-tensor step still loops over every parameter tensor in Python (two
    scalars per tensor), host time that a launch-bound step cannot hide; the fused kernel does not.
    Only the two measured optimisers (others' fused kernels may be CPU-only, e.g. Adagrad's), and not
    under fp16 "16-mixed", where the gradients are still scaled when Lightning clips them. CPUs keep
    the default: fused did not pay there, and CPU runs stay as they were measured."""
    given = getattr(factory, "keywords", {})
    cls = getattr(factory, "func", factory)
    if device_type != "cuda" or precision == "16-mixed" or "fused" in given or "foreach" in given:
        return {}
    return {"fused": True} if inspect.isclass(cls) and issubclass(cls, (torch.optim.Adam, torch.optim.AdamW)) else {}
