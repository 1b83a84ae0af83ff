"""The sort plan shared by every backend (input checks: _checks.py).

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

from typing import NamedTuple

import torch


class PoolPlan(NamedTuple):
    """Precomputed sort of points into voxels; reusable while the geometry is fixed."""

    keys: torch.Tensor
    order: torch.Tensor
    offsets: torch.Tensor
    grid_shape: tuple[int, int, int, int]
    points_shape: tuple[int, ...]  # (N,) for voxel_sum, (B, Nc, D, H, W) for bev_pool


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
        return torch.ops.bev._sort_keys(keys, num_voxels)
    order = torch.argsort(keys, stable=True)
    boundaries = torch.arange(num_voxels + 1, device=keys.device, dtype=keys.dtype)
    offsets = torch.searchsorted(keys.index_select(0, order), boundaries)
    return order, offsets


def make_plan(keys, grid_shape, points_shape, use_native: bool) -> PoolPlan:
    B, Z, X, Y = grid_shape
    order, offsets = sort_keys(keys, B * Z * X * Y, use_native)
    return PoolPlan(keys, order, offsets, tuple(grid_shape), tuple(points_shape))
