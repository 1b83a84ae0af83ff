"""The sort plan shared by every backend (input checks: _checks.py).

A plan turns integer voxel coordinates into int64 tensors:
  keys    (N,)   flat voxel index of each point, ((b*Z + z)*X + x)*Y + y, or the sentinel
                 V = B*Z*X*Y for points outside the grid (they sort to the end and are ignored)
  order   (N,)   point indices stably sorted by key
and the runs of points per voxel, in one of two forms:
  offsets (V+1,) dense: voxel v owns points order[offsets[v]:offsets[v+1]]; offsets[V] = #valid
                 points. Sizes known from the input shapes alone, so building it never needs a
                 host-device sync (native kernels, "quickcumsum"); 8 bytes per voxel.
  voxels, counts (R,) sparse: the R occupied voxels in key order and how many points each owns,
                 so the i-th occupied voxel owns the next counts[i] entries of order ("torch"
                 reference). Memory scales with the points, not the grid; R is data-dependent
                 (one host sync on the GPU).
Either way each voxel sums its own run in a fixed order: deterministic, no atomics.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._checks import _product, check_memory


class PoolPlan(NamedTuple):
    """Precomputed sort of points into voxels; reusable while the geometry is fixed."""

    keys: torch.Tensor
    order: torch.Tensor
    offsets: torch.Tensor | None  # dense runs (V+1,), or None in a sparse plan
    grid_shape: tuple[int, int, int, int]
    points_shape: tuple[int, ...]  # (N,) for voxel_sum, (B, Nc, D, H, W) for bev_pool
    voxels: torch.Tensor | None = None  # sparse runs (R,), or None in a dense plan
    counts: torch.Tensor | None = None

    @property
    def num_voxels(self) -> int:
        B, Z, X, Y = self.grid_shape
        return B * Z * X * Y

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def to(self, device) -> PoolPlan:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return self._replace(
            keys=move(self.keys),
            order=move(self.order),
            offsets=move(self.offsets),
            voxels=move(self.voxels),
            counts=move(self.counts),
        )


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
    """(order, dense offsets) for flat keys in [0, num_voxels]."""
    if use_native:
        return torch.ops.bev._sort_keys(keys, num_voxels)
    order = torch.argsort(keys, stable=True)
    boundaries = torch.arange(num_voxels + 1, device=keys.device, dtype=keys.dtype)
    offsets = torch.searchsorted(keys.index_select(0, order), boundaries)
    return order, offsets


def sparse_runs(keys: torch.Tensor, order: torch.Tensor, num_voxels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(voxels, counts) of the occupied voxels, from keys sorted by order (the sentinel run dropped)."""
    voxels, counts = torch.unique_consecutive(keys.index_select(0, order), return_counts=True)
    inside = voxels < num_voxels
    return voxels[inside], counts[inside]


# Plan bytes per voxel at most, for check_memory: dense offsets (V+1), plus searchsorted's
# boundaries (V+1) in the torch sort (the native CPU sort needs only the offsets). Sparse: none.
DENSE_PLAN_BYTES = 16


def make_plan(keys, grid_shape, points_shape, use_native: bool, dense: bool = True) -> PoolPlan:
    """A dense plan (native kernels, quickcumsum) or a sparse one (the torch reference)."""
    V = _product(grid_shape)
    if dense:
        check_memory(grid_shape, DENSE_PLAN_BYTES, "the dense plan (run offsets per voxel)", keys.device)
        order, offsets = sort_keys(keys, V, use_native)
        return PoolPlan(keys, order, offsets, tuple(grid_shape), tuple(points_shape))
    order = torch.argsort(keys, stable=True)
    voxels, counts = sparse_runs(keys, order, V)
    return PoolPlan(keys, order, None, tuple(grid_shape), tuple(points_shape), voxels, counts)


def as_dense(plan: PoolPlan, use_native: bool) -> PoolPlan:
    """The plan with dense offsets (a sparse plan passed to a dense backend)."""
    if plan.offsets is not None:
        return plan
    check_memory(plan.grid_shape, DENSE_PLAN_BYTES, "the dense plan (run offsets per voxel)", plan.device)
    return plan._replace(offsets=sort_keys(plan.keys, plan.num_voxels, use_native)[1])


def as_sparse(plan: PoolPlan) -> PoolPlan:
    """The plan with sparse runs (a dense plan passed to the torch reference)."""
    if plan.voxels is not None:
        return plan
    return plan._replace(**dict(zip(("voxels", "counts"), sparse_runs(plan.keys, plan.order, plan.num_voxels))))
