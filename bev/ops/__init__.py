"""Voxel pooling, the "splat" of Lift-Splat: sum point features into a BEV voxel grid.

Public API (grid conventions in bev.geometry: voxel grids are (Z, X, Y), coords (z, x, y)):

  voxel_sum(feats, coords, grid_shape, *, backend="auto") -> (B, C, Z, X, Y)
      feats (N, C) float, coords (N, 4) int (batch, z, x, y), grid_shape (B, Z, X, Y).
  bev_pool(depth, feats, coords, grid_shape, *, plan=None, backend="auto") -> (B, C, Z, X, Y)
      fused lift + splat: depth (B, Nc, D, H, W), feats (B, Nc, H, W, C),
      coords (B, Nc, D, H, W, 3) int (z, x, y); equals
      voxel_sum(depth[..., None] * feats[:, :, None]) without materialising that product.
  bev_pool_plan(coords, grid_shape) -> PoolPlan   the sort for fixed geometry, reusable:
      bev_pool(depth, feats, plan=plan).

Points with any coordinate outside the grid are ignored and get zero gradient. Integer
coordinates are not differentiable. Backends (all deterministic, no atomics, fp32
accumulation for fp16/bf16):
  "native"       C++ CPU / CUDA kernels.
  "torch"        pure-PyTorch reference: each occupied voxel sums its own sorted run
                 (segment_reduce); memory scales with the points; one host sync on the GPU.
  "quickcumsum"  the lift-splat-shoot prefix-sum trick, for comparison only: one inf/NaN point
                 makes every later voxel non-finite, and small voxels lose precision after
                 large ones, even in float64 (see _reference.py).
  "auto"         native where built for the tensor's device, else "torch" with one warning.
A grid the device can never hold (output plus plan above its RAM + swap or GPU memory) is
refused with one clear MemoryError before anything is allocated.

How it works (see _plan.py): every call turns coordinates into a plan: flat voxel keys, the
points stably sorted by key, and the runs of points per voxel: dense per-voxel offsets for the
native kernels (sizes known from the input shapes, so the GPU path never waits on the host),
or the occupied voxels only for the torch reference. Each voxel then sums its own run in a
fixed order: bitwise-reproducible results without atomics. The backward passes are gathers
(voxel_sum) and, for bev_pool, per-feature-pixel loops over the pixel's own D points, again
without atomics. Half types accumulate in float32; all indices are int64. For fixed
calibration build the plan once with bev_pool_plan and pass plan=.
"""

from __future__ import annotations

import warnings

import torch

from . import _native, _reference
from ._checks import (
    check_backend,
    check_float_tensor,
    check_grid_shape,
    check_int_tensor,
    check_memory,
    check_same_device,
)
from ._plan import DENSE_PLAN_BYTES, PoolPlan, as_dense, as_sparse, flat_keys, make_plan

__all__ = ["voxel_sum", "bev_pool", "bev_pool_plan", "PoolPlan", "native_available"]

_fallback_warned: set[str] = set()


def native_available(device: torch.device | str | None = None) -> bool:
    """Whether the native kernels are built and loaded for `device` ("cpu", "cuda", or any)."""
    return _native.available(device)


def _use_native(backend: str, device: torch.device) -> bool:
    """Whether `backend` runs the native kernels on `device` ("auto" falls back to torch with one warning)."""
    check_backend(backend)
    if backend in ("torch", "quickcumsum"):
        return False
    if _native.available(device):
        return True
    reason = _native.unavailable_reason(device)
    if backend == "native":
        raise RuntimeError(f"backend='native' requested but {reason}")
    if device.type not in _fallback_warned:
        _fallback_warned.add(device.type)
        warnings.warn(
            f"bev.ops: {reason}; using the pure-torch reference instead (slower, more memory). "
            "This warning is shown once.",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


def _keys(coords: torch.Tensor, grid_shape, batch_column: bool, native: bool) -> torch.Tensor:
    """Flat voxel key per point (sentinel B*Z*X*Y outside the grid); one native pass on the CPU."""
    if native and coords.device.type == "cpu":
        return torch.ops.bev._voxel_keys(coords, list(grid_shape), batch_column)
    if batch_column:
        return flat_keys(coords[:, 0], coords[:, 1:], grid_shape)
    B = coords.shape[0]
    return flat_keys(torch.arange(B, device=coords.device).view(B, 1, 1, 1, 1), coords, grid_shape)


def voxel_sum(feats: torch.Tensor, coords: torch.Tensor, grid_shape, *, backend: str = "auto") -> torch.Tensor:
    """Sum rows of feats (N, C) into the voxels coords (N, 4) = (batch, z, x, y) -> (B, C, Z, X, Y)."""
    check_float_tensor("feats", feats, 2, "(N, C)")
    check_int_tensor("coords", coords, 2, "(N, 4) with columns (batch, z, x, y)", 4)
    if coords.shape[0] != feats.shape[0]:
        raise ValueError(f"coords has {coords.shape[0]} rows but feats has {feats.shape[0]}; they must match")
    check_same_device(feats=feats, coords=coords)
    grid_shape = check_grid_shape(grid_shape)
    native = _use_native(backend, feats.device)
    _check_output_memory(grid_shape, feats, backend, native)
    keys = _keys(coords, grid_shape, batch_column=True, native=native)
    plan = make_plan(keys, grid_shape, (feats.shape[0],), native, dense=_dense(backend, native))
    feats = feats.contiguous()
    if native:
        return torch.ops.bev.voxel_sum(feats, plan.keys, plan.order, plan.offsets, list(grid_shape))
    if backend == "quickcumsum":
        return _reference.quickcumsum_voxel_sum(feats, plan)
    return _reference.voxel_sum(feats, plan)


def _dense(backend: str, native: bool) -> bool:
    """Whether the backend needs a dense plan (per-voxel offsets) or a sparse one (occupied voxels)."""
    return native or backend == "quickcumsum"


def _check_output_memory(grid_shape, feats: torch.Tensor, backend: str, native: bool) -> None:
    """The output (B, C, Z, X, Y), plus the dense plan and quickcumsum's (V, C) sums where built."""
    out_bytes = feats.shape[-1] * feats.element_size()
    per_voxel = out_bytes * (2 if backend == "quickcumsum" else 1) + (
        DENSE_PLAN_BYTES if _dense(backend, native) else 0
    )
    check_memory(grid_shape, per_voxel, "the output (B, C, Z, X, Y) and the plan", feats.device)


def _check_frustum_coords(coords, grid_shape) -> tuple[int, int, int, int]:
    """grid_shape checked, for frustum coords (B, Nc, D, H, W, 3) of the same batch size."""
    check_int_tensor("coords", coords, 6, "(B, Nc, D, H, W, 3) with (z, x, y) last", 3)
    grid_shape = check_grid_shape(grid_shape)
    if coords.shape[0] != grid_shape[0]:
        raise ValueError(f"coords has batch size {coords.shape[0]} but grid_shape has B={grid_shape[0]}")
    return grid_shape


def bev_pool_plan(coords: torch.Tensor, grid_shape, *, backend: str = "auto") -> PoolPlan:
    """Sort the frustum points coords (B, Nc, D, H, W, 3) into the grid once, for reuse with bev_pool."""
    grid_shape = _check_frustum_coords(coords, grid_shape)
    native = _use_native(backend, coords.device)
    keys = _keys(coords, grid_shape, batch_column=False, native=native)
    return make_plan(keys, grid_shape, tuple(coords.shape[:5]), native, dense=_dense(backend, native))


def bev_pool(
    depth: torch.Tensor,
    feats: torch.Tensor,
    coords: torch.Tensor | None = None,
    grid_shape=None,
    *,
    plan: PoolPlan | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Fused lift + splat: sum depth (B, Nc, D, H, W) x feats (B, Nc, H, W, C) into (B, C, Z, X, Y)."""
    depth, feats = _check_depth_feats(depth, feats)
    native = _use_native(backend, depth.device)
    if plan is None:
        plan = _new_plan(depth, feats, coords, grid_shape, backend, native)
    else:
        plan = _given_plan(plan, depth, feats, coords, grid_shape, backend, native)
    depth, feats = depth.contiguous(), feats.contiguous()
    if native:
        return torch.ops.bev.bev_pool(depth, feats, plan.keys, plan.order, plan.offsets, list(plan.grid_shape))
    if backend == "quickcumsum":
        return _reference.quickcumsum_bev_pool(depth, feats, plan)
    return _reference.bev_pool(depth, feats, plan)


def _check_depth_feats(depth: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bev_pool's depth and feats checked against each other, promoted to one dtype."""
    check_float_tensor("depth", depth, 5, "(B, Nc, D, H, W)")
    check_float_tensor("feats", feats, 5, "(B, Nc, H, W, C)")
    if depth.dtype != feats.dtype:
        # Same promotion as depth[..., None] * feats (e.g. fp32 softmax depth with bf16 features under autocast).
        dtype = torch.promote_types(depth.dtype, feats.dtype)
        depth, feats = depth.to(dtype), feats.to(dtype)
    B, Nc, D, H, W = depth.shape
    if tuple(feats.shape[:4]) != (B, Nc, H, W):
        raise ValueError(
            f"feats must have shape (B, Nc, H, W, C) = ({B}, {Nc}, {H}, {W}, C) to match depth {tuple(depth.shape)}, "
            f"got {tuple(feats.shape)}"
        )
    check_same_device(depth=depth, feats=feats)
    return depth, feats


def _new_plan(depth: torch.Tensor, feats: torch.Tensor, coords, grid_shape, backend: str, native: bool) -> PoolPlan:
    """bev_pool's plan from coords and grid_shape, checked against depth and the device's memory first."""
    if coords is None or grid_shape is None:
        raise ValueError("bev_pool needs coords and grid_shape, or a plan from bev_pool_plan")
    grid_shape = _check_frustum_coords(coords, grid_shape)
    if tuple(coords.shape[:5]) != tuple(depth.shape):
        raise ValueError(
            f"coords must have shape (B, Nc, D, H, W, 3) = {tuple(depth.shape) + (3,)} to match depth, got {tuple(coords.shape)}"
        )
    check_same_device(depth=depth, coords=coords)
    _check_output_memory(grid_shape, feats, backend, native)
    return bev_pool_plan(coords, grid_shape, backend="native" if native else backend)


def _given_plan(
    plan, depth: torch.Tensor, feats: torch.Tensor, coords, grid_shape, backend: str, native: bool
) -> PoolPlan:
    """A plan passed to bev_pool, checked against depth and the device's memory, in the form this backend needs."""
    if not isinstance(plan, PoolPlan):
        raise TypeError(f"plan must be a PoolPlan from bev_pool_plan, got {type(plan).__name__}")
    if coords is not None or grid_shape is not None:
        raise ValueError("pass either plan or (coords, grid_shape) to bev_pool, not both")
    if tuple(plan.points_shape) != tuple(depth.shape):
        raise ValueError(
            f"plan was built for points of shape {tuple(plan.points_shape)} but depth has shape {tuple(depth.shape)}"
        )
    check_same_device(depth=depth, plan=plan.keys)
    _check_output_memory(plan.grid_shape, feats, backend, native)
    # A plan built for another backend gets the form of runs this one needs.
    return as_dense(plan, native) if _dense(backend, native) else as_sparse(plan)
