"""Input checks of the bev.ops entry points: one clear error naming the problem and the fix."""
from __future__ import annotations

import numbers

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_grid_shape(grid_shape) -> tuple[int, int, int, int]:
    if isinstance(grid_shape, torch.Size):
        grid_shape = tuple(grid_shape)
    if not isinstance(grid_shape, (tuple, list)):
        raise TypeError(f"grid_shape must be a sequence of 4 ints (B, Z, X, Y), got {type(grid_shape).__name__}")
    if len(grid_shape) != 4:
        raise ValueError(f"grid_shape must have 4 entries (B, Z, X, Y), got {len(grid_shape)}: {tuple(grid_shape)}")
    out = []
    for name, size in zip("BZXY", grid_shape):
        if isinstance(size, bool) or not isinstance(size, (numbers.Integral, torch.SymInt)):
            raise TypeError(f"grid_shape entries must be ints, got {name}={size!r} ({type(size).__name__})")
        if size <= 0:
            raise ValueError(f"grid_shape sizes must be positive, got {name}={size} in grid_shape={tuple(grid_shape)}")
        out.append(size)
    return tuple(out)  # type: ignore[return-value]


def check_float_tensor(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16/bfloat16/float32/float64, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have shape {layout} ({ndim} dims), got {tuple(t.shape)}")


def check_int_tensor(name: str, t, ndim: int, layout: str, last: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (voxel indices; floor-bin them first), got {t.dtype}")
    if t.dim() != ndim or t.shape[-1] != last:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        desc = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all inputs must be on the same device, got {desc}")


def check_backend(backend) -> str:
    if backend not in ("auto", "torch", "native"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'native', got {backend!r}")
    return backend
