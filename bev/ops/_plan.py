"""Input validation and the sort plan shared by every backend.

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

import functools
import numbers
import os
from typing import NamedTuple, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BACKENDS = ("auto", "torch", "quickcumsum", "native")
# Flat keys, the sentinel V and the offsets' V+1 entries are int64: keep B*Z*X*Y well inside.
MAX_VOXELS = 2**62


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

    def to(self, device) -> "PoolPlan":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return self._replace(keys=move(self.keys), order=move(self.order), offsets=move(self.offsets),
                             voxels=move(self.voxels), counts=move(self.counts))


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
        voxels = _product(out)
        if isinstance(voxels, int) and voxels > MAX_VOXELS:
            raise ValueError(
                f"grid_shape={tuple(grid_shape)} is too large: {name}={size} takes the voxel count "
                f"{'*'.join('BZXY'[:len(out)])} to {voxels}, over the limit of 2**62 (flat voxel keys are int64); "
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


@functools.lru_cache(maxsize=None)
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
    voxels = _product(grid_shape)
    if torch.compiler.is_compiling() or not isinstance(voxels, int) or not isinstance(bytes_per_voxel, int):
        return  # tracing (torch.compile): checked when run eagerly, nothing is allocated here
    needed = voxels * bytes_per_voxel
    limit = memory_limit(device)
    if limit is not None and needed > limit:
        raise MemoryError(
            f"bev.ops: grid_shape={tuple(grid_shape)} ({voxels:,} voxels) needs at least {needed / 1e9:,.1f} GB "
            f"for {what}, more than the {limit / 1e9:,.1f} GB this {device.type} device can hold; "
            "use a coarser or smaller grid, fewer channels or a smaller batch"
        )


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
    """(order, dense offsets) for flat keys in [0, num_voxels]."""
    if use_native:
        return torch.ops.bev.sort_keys(keys, num_voxels)
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


def make_plan(keys, grid_shape, points_shape, use_native: bool, dense: bool) -> PoolPlan:
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
