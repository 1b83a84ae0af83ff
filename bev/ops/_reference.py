"""Pure-PyTorch reference in the QuickCumsum style (lift-splat-shoot): sort, prefix sum,
difference at run boundaries; the backward is a hand-written gather.

Unlike QuickCumsum the prefix sum runs in float64, so a long run of large partial sums does
not eat the precision of small voxels, and the run boundaries come from the plan's fixed-size
offsets, so there is no data-dependent shape (no host sync on the GPU).
"""
from __future__ import annotations

import torch

from ._plan import PoolPlan


class QuickCumsum(torch.autograd.Function):
    """(N, C) point features + plan -> ((V, C) voxel sums, (V,) points per voxel)."""

    @staticmethod
    def forward(ctx, feats, keys, order, offsets):
        # Row 0 is zero so that prefix[i] is the sum of the first i sorted rows.
        sorted_feats = feats.new_empty(feats.shape[0] + 1, feats.shape[1])
        sorted_feats[0] = 0
        torch.index_select(feats, 0, order, out=sorted_feats[1:])
        prefix = torch.cumsum(sorted_feats, 0, dtype=torch.float64)
        del sorted_feats
        sums = (prefix.index_select(0, offsets[1:]) - prefix.index_select(0, offsets[:-1])).to(feats.dtype)
        counts = offsets[1:] - offsets[:-1]
        ctx.save_for_backward(keys)
        ctx.mark_non_differentiable(counts)
        return sums, counts

    @staticmethod
    def backward(ctx, grad_sums, grad_counts):
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
    sums, _ = QuickCumsum.apply(feats, plan.keys, plan.order, plan.offsets)
    return voxel_sums_to_grid(sums, plan.grid_shape)


def bev_pool(depth: torch.Tensor, feats: torch.Tensor, plan: PoolPlan) -> torch.Tensor:
    # The reference materialises the (B, Nc, D, H, W, C) frustum features; autograd handles
    # the product, QuickCumsum the pooling.
    frustum = depth.unsqueeze(-1) * feats.unsqueeze(2)
    return voxel_sum(frustum.reshape(-1, feats.shape[-1]), plan)
