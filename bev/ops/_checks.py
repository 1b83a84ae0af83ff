"""Input checks of the bev.ops entry points: one clear error naming the problem and the fix."""

from __future__ import annotations

import functools
import numbers
import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BACKENDS = ("auto", "torch", "quickcumsum", "native")
# Flat keys, the sentinel V and the offsets' V+1 entries are int64: keep B*Z*X*Y well inside.
MAX_VOXELS = 2**62


# ---------------------------------------------------------------------------------------------
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
        voxels = _product(out)
        if isinstance(voxels, int) and voxels > MAX_VOXELS:
            raise ValueError(
                f"grid_shape={tuple(grid_shape)} is too large: {name}={size} takes the voxel count "
                f"{'*'.join('BZXY'[: len(out)])} to {voxels}, over the limit of 2**62 (flat voxel keys are int64); "
                "use a coarser grid"
            )
    return tuple(out)  # type: ignore[return-value]


def _product(sizes) -> int:
    total = 1
    for s in sizes:
        total = total * s
    return total


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
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(repr(b) for b in BACKENDS)}, got {backend!r}")
    return backend


@functools.cache
def memory_limit(device: torch.device) -> int | None:
    """Bytes a device can ever hold: RAM + swap on the CPU (Linux), total memory on a GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return sum(int(info[k].split()[0]) * 1024 for k in ("MemTotal", "SwapTotal"))
    except (OSError, KeyError, ValueError):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None


def check_memory(grid_shape, bytes_per_voxel: int, what: str, device: torch.device) -> None:
    """One clear error, before anything is allocated, for a grid the device can never hold."""
    if torch.compiler.is_compiling():
        return  # tracing allocates nothing, and Dynamo cannot trace reading /proc/meminfo
    voxels = _product(grid_shape)
    if not isinstance(voxels, int) or not isinstance(bytes_per_voxel, int):
        return  # symbolic shapes: nothing is allocated here
    needed = voxels * bytes_per_voxel
    limit = memory_limit(device)
    if limit is not None and needed > limit:
        raise MemoryError(
            f"bev.ops: grid_shape={tuple(grid_shape)} ({voxels:,} voxels) needs at least {needed / 1e9:,.1f} GB "
            f"for {what}, more than the {limit / 1e9:,.1f} GB this {device.type} device can hold; "
            "use a coarser or smaller grid, fewer channels or a smaller batch"
        )
