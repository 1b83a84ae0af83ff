"""Pure-PyTorch backends: the "torch" reference and, for comparison, LSS's "quickcumsum".

"torch" (SegmentSum): sort the points by voxel, then sum each occupied voxel's own run with
torch.segment_reduce, sequentially in point order, and write the sums at the occupied voxels
only. Nothing is differenced, so a non-finite value stays in its voxel and float64 results are
exact to rounding (the same sums, in the same order, as index_add_ in point order). The plan
is sparse: memory scales with the points, not the grid. segment_reduce has no atomics on the
CPU or the GPU (one sequential loop per segment and channel), so results are deterministic
everywhere; on the GPU the number of occupied voxels is data-dependent, which costs one host
sync when the plan is built. fp16/bf16 accumulate in float32.

"quickcumsum" (QuickCumsum, the trick of lift-splat-shoot): one prefix sum over all sorted
points, differenced at run boundaries. Kept to compare against; it has two failure modes:
  - one inf/NaN point makes every voxel after it in key order non-finite (inf - inf = NaN);
  - a voxel's sum is the difference of two large prefix sums, so small voxels that follow large
    ones lose their precision even in float64 (voxels [1e17] and [1.0] give [1e17, 0.0]).
Its prefix sum runs in float64 (the original uses the input dtype) and its run boundaries come
from the dense plan (no data-dependent shape, no host sync; 8 bytes per voxel).

Both backward passes are hand-written gathers: grad_feats[p] = grad_out[voxel of p].
"""

from __future__ import annotations

import torch

from ._plan import PoolPlan


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def gather_voxel_grads(grad_out: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(B, C, Z, X, Y) gradient -> (N, C) rows at each point's voxel, zero for ignored points.

    Reads grad_out through a strided view: an expanded (stride-0) gradient, as out.sum().backward()
    gives, is never materialised.
    """
    B, C = grad_out.shape[:2]
    S = grad_out[0, 0].numel()
    V = B * S
    inside = keys < V
    k = torch.where(inside, keys, 0)
    rows = grad_out.reshape(B, C, S).transpose(1, 2)[k // S, k % S]
    return rows.masked_fill_(~inside.unsqueeze(1), 0)


class SegmentSum(torch.autograd.Function):
    """(N, C) point features + sparse plan -> (B, C, Z, X, Y) voxel sums."""

    @staticmethod
    def forward(ctx, feats, keys, order, voxels, counts, grid_shape):
        B, Z, X, Y = grid_shape
        S, C = Z * X * Y, feats.shape[1]
        # The ignored points (sentinel key, sorted last) form one more segment, summed and dropped:
        # their count is a tensor, so no host sync is needed to leave them out.
        lengths = torch.cat([counts, (keys.numel() - counts.sum()).reshape(1)])
        rows = feats.index_select(0, order).to(accumulation_dtype(feats.dtype))
        sums = torch.segment_reduce(rows, "sum", lengths=lengths, axis=0)[:-1]
        out = feats.new_zeros(B, C, S)
        out.transpose(1, 2)[voxels // S, voxels % S] = sums.to(feats.dtype)
        ctx.save_for_backward(keys)
        return out.view(B, C, Z, X, Y)

    @staticmethod
    def backward(ctx, grad_out):
        (keys,) = ctx.saved_tensors
        return gather_voxel_grads(grad_out, keys), None, None, None, None, None


class QuickCumsum(torch.autograd.Function):
    """(N, C) point features + dense plan -> (V, C) voxel sums, by differencing a prefix sum."""

    @staticmethod
    def forward(ctx, feats, keys, order, offsets):
        # Row 0 is zero so that prefix[i] is the sum of the first i sorted rows.
        sorted_feats = feats.new_empty(feats.shape[0] + 1, feats.shape[1])
        sorted_feats[0] = 0
        torch.index_select(feats, 0, order, out=sorted_feats[1:])
        prefix = torch.cumsum(sorted_feats, 0, dtype=torch.float64)
        del sorted_feats
        sums = (prefix.index_select(0, offsets[1:]) - prefix.index_select(0, offsets[:-1])).to(feats.dtype)
        ctx.save_for_backward(keys)
        return sums

    @staticmethod
    def backward(ctx, grad_sums):
        (keys,) = ctx.saved_tensors
        # Each point receives its voxel's gradient; the sentinel key selects an appended zero row.
        padded = torch.cat([grad_sums, grad_sums.new_zeros(1, grad_sums.shape[1])])
        return padded.index_select(0, keys), None, None, None


def voxel_sums_to_grid(sums: torch.Tensor, grid_shape) -> torch.Tensor:
    """(V, C) voxel-major sums -> contiguous (B, C, Z, X, Y)."""
    B, Z, X, Y = grid_shape
    C = sums.shape[1]
    return sums.reshape(B, Z * X * Y, C).transpose(1, 2).contiguous().view(B, C, Z, X, Y)


def voxel_sum(feats: torch.Tensor, plan: PoolPlan) -> torch.Tensor:
    """The "torch" backend (plan with sparse runs)."""
    return SegmentSum.apply(feats, plan.keys, plan.order, plan.voxels, plan.counts, plan.grid_shape)


def quickcumsum_voxel_sum(feats: torch.Tensor, plan: PoolPlan) -> torch.Tensor:
    """The "quickcumsum" backend (plan with dense offsets)."""
    return voxel_sums_to_grid(QuickCumsum.apply(feats, plan.keys, plan.order, plan.offsets), plan.grid_shape)


def materialise(depth: torch.Tensor, feats: torch.Tensor, plan: PoolPlan) -> torch.Tensor:
    """The (N, C) frustum features depth x feats that bev_pool sums; autograd handles the product.

    Ignored points get depth 0 first (torch.where: its backward selects, never multiplies), so
    their gradients are exactly zero even where the other factor is inf or NaN.
    """
    depth = torch.where(plan.keys.view(depth.shape) < plan.num_voxels, depth, 0)
    return (depth.unsqueeze(-1) * feats.unsqueeze(2)).reshape(-1, feats.shape[-1])


def bev_pool(depth: torch.Tensor, feats: torch.Tensor, plan: PoolPlan) -> torch.Tensor:
    return voxel_sum(materialise(depth, feats, plan), plan)


def quickcumsum_bev_pool(depth: torch.Tensor, feats: torch.Tensor, plan: PoolPlan) -> torch.Tensor:
    return quickcumsum_voxel_sum(materialise(depth, feats, plan), plan)
