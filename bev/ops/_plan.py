"""Input validation and the sort plan shared by every backend.

A plan turns integer voxel coordinates into three int64 tensors:
  keys    (N,)   flat voxel index of each point, ((b*Z + z)*X + x)*Y + y, or the sentinel
                 V = B*Z*X*Y for points outside the grid (they sort to the end and are ignored)
  order   (N,)   point indices stably sorted by key
  offsets (V+1,) voxel v owns points order[offsets[v]:offsets[v+1]]; offsets[V] = #valid points
Every tensor has a size known from the input shapes alone, so building a plan never needs a
host-device sync, and the kernels can sum each voxel's run in a fixed order (deterministic,
no atomics).
"""
from __future__ import annotations

import numbers
from typing import NamedTuple, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class PoolPlan(NamedTuple):
    """Precomputed sort of points into voxels; reusable while the geometry is fixed."""

    keys: torch.Tensor
    order: torch.Tensor
    offsets: torch.Tensor
    grid_shape: tuple[int, int, int, int]
    points_shape: tuple[int, ...]  # (N,) for voxel_sum, (B, Nc, D, H, W) for bev_pool

    @property
    def num_voxels(self) -> int:
        B, Z, X, Y = self.grid_shape
        return B * Z * X * Y

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def to(self, device) -> "PoolPlan":
        return self._replace(keys=self.keys.to(device), order=self.order.to(device), offsets=self.offsets.to(device))


# ---------------------------------------------------------------------------------------------
# validation
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


# ---------------------------------------------------------------------------------------------
# plan construction
# ---------------------------------------------------------------------------------------------
def flat_keys(batch: torch.Tensor, zxy: torch.Tensor, grid_shape: tuple[int, int, int, int]) -> torch.Tensor:
    """Flat voxel index per point; the sentinel B*Z*X*Y where any coordinate is out of range."""
    B, Z, X, Y = grid_shape
    batch = batch.long()
    z, x, y = zxy.long().unbind(-1)
    valid = (batch >= 0) & (batch < B) & (z >= 0) & (z < Z) & (x >= 0) & (x < X) & (y >= 0) & (y < Y)
    # Invalid points may overflow here; torch.where discards those values.
    keys = ((batch * Z + z) * X + x) * Y + y
    return torch.where(valid, keys, torch.full_like(keys, B * Z * X * Y)).reshape(-1)


def sort_keys(keys: torch.Tensor, num_voxels: int, use_native: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, offsets) for flat keys in [0, num_voxels]."""
    if use_native:
        return torch.ops.bev.sort_keys(keys, num_voxels)
    order = torch.argsort(keys, stable=True)
    boundaries = torch.arange(num_voxels + 1, device=keys.device, dtype=keys.dtype)
    offsets = torch.searchsorted(keys.index_select(0, order), boundaries)
    return order, offsets


def make_plan(keys, grid_shape, points_shape, use_native: bool) -> PoolPlan:
    B, Z, X, Y = grid_shape
    order, offsets = sort_keys(keys, B * Z * X * Y, use_native)
    return PoolPlan(keys, order, offsets, tuple(grid_shape), tuple(points_shape))
