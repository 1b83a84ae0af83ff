"""bev.ops on the CPU: every backend against an independent float64 index_add_ reference.

CUDA counterparts live in test_ops_cuda.py and reuse the helpers defined here.
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import bev.ops as ops
from bev.ops import _native
from bev.ops._plan import flat_keys

# ---------------------------------------------------------------------------------------------
# Independent reference (shares no code with bev.ops) and input generators
# ---------------------------------------------------------------------------------------------

import torch


def index_add_voxel_sum(feats: torch.Tensor, coords: torch.Tensor, grid_shape) -> torch.Tensor:
    """(N, C) + (N, 4) (batch, z, x, y) -> float64 (B, C, Z, X, Y) by index_add_."""
    B, Z, X, Y = grid_shape
    coords = coords.long()
    upper = torch.tensor([B, Z, X, Y], device=coords.device)
    inside = ((coords >= 0) & (coords < upper)).all(dim=1)
    b, z, x, y = coords[inside].unbind(1)
    flat = ((b * Z + z) * X + x) * Y + y
    out = torch.zeros(B * Z * X * Y, feats.shape[1], dtype=torch.float64, device=feats.device)
    out.index_add_(0, flat, feats[inside].to(torch.float64))
    return out.view(B, Z, X, Y, -1).permute(0, 4, 1, 2, 3)


def frustum_to_points(depth, feats, coords):
    """The materialised (N, C) frustum features and (N, 4) coords that bev_pool must equal."""
    B, Nc, D, H, W = depth.shape
    product = depth.unsqueeze(-1) * feats.unsqueeze(2)
    batch = torch.arange(B, device=coords.device).view(B, 1, 1, 1, 1, 1).expand(B, Nc, D, H, W, 1)
    return product.reshape(-1, feats.shape[-1]), torch.cat([batch, coords.long()], dim=-1).reshape(-1, 4)


def index_add_bev_pool(depth, feats, coords, grid_shape) -> torch.Tensor:
    points, flat_coords = frustum_to_points(depth.to(torch.float64), feats.to(torch.float64), coords)
    return index_add_voxel_sum(points, flat_coords, grid_shape)


def random_coords(n: int, grid_shape, generator=None, margin: int = 1, device="cpu") -> torch.Tensor:
    """(n, 4) coords drawn from [-margin, size + margin) per axis: some fall outside the grid."""
    cols = [torch.randint(-margin, s + margin, (n,), generator=generator) for s in grid_shape]
    return torch.stack(cols, dim=1).to(device)


def random_frustum(B, Nc, D, H, W, C, grid_shape, dtype=torch.float32, generator=None, margin=1, device="cpu"):
    """depth (B, Nc, D, H, W), feats (B, Nc, H, W, C), coords (B, Nc, D, H, W, 3) with collisions."""
    depth = torch.rand(B, Nc, D, H, W, generator=generator, dtype=torch.float64).to(dtype)
    feats = torch.randn(B, Nc, H, W, C, generator=generator, dtype=torch.float64).to(dtype)
    _, Z, X, Y = grid_shape
    coords = torch.stack(
        [torch.randint(-margin, s + margin, (B, Nc, D, H, W), generator=generator) for s in (Z, X, Y)], dim=-1
    )
    return depth.to(device), feats.to(device), coords.to(device)


# Tolerances for results rounded once from a float64 (or fp32-accumulated) sum.
TOLERANCE = {
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, loose: bool = False):
    """actual (dtype) vs a float64 expectation; `loose` for paths that round intermediate products."""
    tol = dict(TOLERANCE[dtype])
    if loose and dtype in (torch.float16, torch.bfloat16):
        tol = {k: 5 * v for k, v in tol.items()}
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.to(torch.float64), expected.to(torch.float64), **tol)


def backends_for(device: str) -> list:
    """Explicit backends to test on `device`; native is skipped (not silently dropped) if unbuilt."""
    native_mark = pytest.mark.skipif(
        not ops.native_available(device), reason=f"native kernels not built for {device}"
    )
    return ["torch", pytest.param("native", marks=native_mark)]


requires_native = pytest.mark.skipif(not ops.native_available("cpu"), reason="native CPU kernels not built")
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]

# ---------------------------------------------------------------------------------------------
# voxel_sum: values and gradients
# ---------------------------------------------------------------------------------------------
VOXEL_CASES = {
    # name: (N, C, grid_shape)
    "single-batch-flat": (300, 5, (1, 1, 6, 7)),
    "batched-3d": (700, 9, (3, 4, 5, 6)),
    "one-channel": (400, 1, (2, 2, 5, 5)),
    "wide-257": (200, 257, (2, 1, 4, 3)),
}


@pytest.mark.parametrize("backend", backends_for("cpu"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", VOXEL_CASES, ids=str)
def test_voxel_sum_matches_index_add(backend, dtype, case):
    N, C, grid = VOXEL_CASES[case]
    gen = torch.Generator().manual_seed(N * C)
    coords = random_coords(N, grid, gen)
    feats = torch.randn(N, C, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    out = ops.voxel_sum(feats, coords, grid, backend=backend)
    assert out.shape == (grid[0], C, *grid[1:]) and out.is_contiguous()
    assert_matches(out, index_add_voxel_sum(feats.detach(), coords, grid), dtype)

    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
    out.backward(grad_out)
    expected = feats.detach().to(torch.float64).requires_grad_()
    index_add_voxel_sum(expected, coords, grid).backward(grad_out.to(torch.float64))
    # The gradient is a pure gather: exact in every dtype.
    assert torch.equal(feats.grad.to(torch.float64), expected.grad)


@pytest.mark.parametrize("backend", backends_for("cpu"))
def test_voxel_sum_adversarial_cases(backend):
    grid = (2, 3, 4, 5)
    C = 4
    cases = {
        "empty": torch.zeros(0, 4, dtype=torch.long),
        "all-outside": torch.tensor([[-1, 0, 0, 0], [2, 0, 0, 0], [0, 3, 0, 0], [0, 0, -4, 0], [0, 0, 0, 5]] * 7),
        "one-voxel": torch.tensor([[1, 2, 3, 4]]).repeat(500, 1),
        "huge-coords": torch.tensor([[0, 0, 2**40, 0], [0, -(2**62), 0, 0], [2**62, 1, 1, 1], [1, 1, 1, 1]]),
        "int32-coords": torch.tensor([[0, 0, 0, 0], [1, 2, 3, 4], [1, 2, 3, 4], [0, 3, 0, 0]], dtype=torch.int32),
    }
    for name, coords in cases.items():
        feats = torch.randn(coords.shape[0], C, dtype=torch.float64, requires_grad=True)
        out = ops.voxel_sum(feats, coords, grid, backend=backend)
        expected = index_add_voxel_sum(feats.detach(), coords, grid)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10, msg=name)
        out.sum().backward()
        inside = ((coords.long() >= 0) & (coords.long() < torch.tensor(grid))).all(1)
        assert torch.equal(feats.grad, inside[:, None].double().expand_as(feats)), name
    # All points outside: the output is exactly zero, no stray write.
    assert ops.voxel_sum(torch.ones(35, C), cases["all-outside"], grid, backend=backend).abs().sum() == 0


@pytest.mark.parametrize("backend", backends_for("cpu"))
def test_voxel_sum_non_contiguous_inputs(backend):
    gen = torch.Generator().manual_seed(1)
    grid = (2, 2, 6, 5)
    coords = random_coords(300, grid, gen)
    wide_coords = torch.cat([coords, coords], dim=1)[:, :4]  # row stride 8
    feats_t = torch.randn(6, 300, generator=gen, dtype=torch.float64).t()  # transposed view
    assert not feats_t.is_contiguous() and not wide_coords.is_contiguous()
    out = ops.voxel_sum(feats_t, wide_coords, grid, backend=backend)
    torch.testing.assert_close(out, index_add_voxel_sum(feats_t.contiguous(), coords, grid))


@pytest.mark.parametrize("backend", backends_for("cpu"))
def test_voxel_sum_zero_channels(backend):
    out = ops.voxel_sum(torch.zeros(10, 0), torch.zeros(10, 4, dtype=torch.long), (1, 1, 2, 2), backend=backend)
    assert out.shape == (1, 0, 1, 2, 2)


@pytest.mark.parametrize("backend", backends_for("cpu"))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_inputs_accumulate_in_fp32(backend, dtype):
    # 1 + 1 + ... stalls at 2048 in fp16 and at 256 in bf16 if accumulated in the input type.
    n = 3000 if dtype == torch.float16 else 1024
    coords = torch.tensor([[0, 0, 1, 1]]).repeat(n, 1)
    out = ops.voxel_sum(torch.ones(n, 2, dtype=dtype), coords, (1, 1, 2, 2), backend=backend)
    assert out[0, :, 0, 1, 1].tolist() == [float(n), float(n)]
    assert out.sum().item() == 2 * n


# ---------------------------------------------------------------------------------------------
# bev_pool: the fused op equals voxel_sum of the materialised product
# ---------------------------------------------------------------------------------------------
FRUSTUM_CASES = {
    # name: ((B, Nc, D, H, W, C), grid_shape)
    "small": ((1, 2, 4, 3, 5, 6), (1, 1, 5, 4)),
    "batched-3d": ((2, 3, 5, 2, 4, 7), (2, 3, 4, 4)),
    "one-channel": ((2, 1, 6, 3, 3, 1), (2, 2, 3, 3)),
    "wide-257": ((1, 2, 3, 2, 3, 257), (1, 1, 3, 3)),
}


@pytest.mark.parametrize("backend", backends_for("cpu"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", FRUSTUM_CASES, ids=str)
def test_bev_pool_matches_index_add(backend, dtype, case):
    (B, Nc, D, H, W, C), grid = FRUSTUM_CASES[case]
    gen = torch.Generator().manual_seed(B * Nc * D * C)
    depth, feats, coords = random_frustum(B, Nc, D, H, W, C, grid, dtype, gen)
    depth.requires_grad_(), feats.requires_grad_()
    out = ops.bev_pool(depth, feats, coords, grid, backend=backend)
    assert out.shape == (B, C, *grid[1:]) and out.is_contiguous()
    loose = backend == "torch"  # the reference rounds each depth x feature product to dtype
    assert_matches(out, index_add_bev_pool(depth.detach(), feats.detach(), coords, grid), dtype, loose)

    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
    out.backward(grad_out)
    d64 = depth.detach().double().requires_grad_()
    f64 = feats.detach().double().requires_grad_()
    index_add_bev_pool(d64, f64, coords, grid).backward(grad_out.double())
    assert_matches(depth.grad, d64.grad, dtype, loose)
    assert_matches(feats.grad, f64.grad, dtype, loose)


@pytest.mark.parametrize("backend", backends_for("cpu"))
def test_bev_pool_adversarial_cases(backend):
    B, Nc, D, H, W, C = 2, 2, 3, 2, 3, 4
    grid = (B, 2, 3, 3)
    shape = (B, Nc, D, H, W, 3)
    cases = {
        "all-outside": torch.full(shape, -1),
        "one-voxel": torch.ones(shape, dtype=torch.long),
        "huge-coords": torch.full(shape, 2**40).index_fill_(5, torch.tensor([0]), 0),
        "random": random_frustum(B, Nc, D, H, W, C, grid, generator=torch.Generator().manual_seed(3))[2],
    }
    for name, coords in cases.items():
        depth = torch.rand(B, Nc, D, H, W, dtype=torch.float64, requires_grad=True)
        feats = torch.randn(B, Nc, H, W, C, dtype=torch.float64, requires_grad=True)
        out = ops.bev_pool(depth, feats, coords, grid, backend=backend)
        torch.testing.assert_close(out, index_add_bev_pool(depth.detach(), feats.detach(), coords, grid), msg=name)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
        d64, f64 = depth.detach().clone().requires_grad_(), feats.detach().clone().requires_grad_()
        index_add_bev_pool(d64, f64, coords, grid).backward(grad_out)
        torch.testing.assert_close(depth.grad, d64.grad, msg=name)
        torch.testing.assert_close(feats.grad, f64.grad, msg=name)
    # Empty frustum (H = 0).
    out = ops.bev_pool(torch.zeros(B, Nc, D, 0, W), torch.zeros(B, Nc, 0, W, C), torch.zeros(B, Nc, D, 0, W, 3, dtype=torch.long), grid, backend=backend)
    assert out.shape == (B, C, 2, 3, 3) and out.abs().sum() == 0


@pytest.mark.parametrize("backend", backends_for("cpu"))
def test_bev_pool_non_contiguous_and_plan_reuse(backend):
    B, Nc, D, H, W, C = 2, 3, 4, 3, 5, 6
    grid = (B, 1, 4, 4)
    gen = torch.Generator().manual_seed(4)
    depth, feats, coords = random_frustum(B, Nc, D, H, W, C, grid, torch.float64, gen)
    # Channels-first storage seen through a permute, depth through a transpose, coords strided.
    feats_nc = feats.permute(0, 1, 4, 2, 3).contiguous().permute(0, 1, 3, 4, 2)
    depth_nc = depth.transpose(3, 4).contiguous().transpose(3, 4)
    coords_nc = torch.cat([coords, coords], dim=-1)[..., :3]
    assert not (feats_nc.is_contiguous() or depth_nc.is_contiguous() or coords_nc.is_contiguous())
    expected = index_add_bev_pool(depth, feats, coords, grid)
    torch.testing.assert_close(ops.bev_pool(depth_nc, feats_nc, coords_nc, grid, backend=backend), expected)
    plan = ops.bev_pool_plan(coords_nc, grid)
    for _ in range(2):  # the plan is reusable
        torch.testing.assert_close(ops.bev_pool(depth, feats, plan=plan, backend=backend), expected)


@requires_native
def test_native_and_torch_plans_are_identical():
    gen = torch.Generator().manual_seed(5)
    grid = (2, 2, 5, 5)
    _, _, coords = random_frustum(2, 3, 6, 4, 4, 1, grid, generator=gen, margin=2)
    native = ops.bev_pool_plan(coords, grid, backend="native")
    reference = ops.bev_pool_plan(coords, grid, backend="torch")
    for name in ("keys", "order", "offsets"):
        assert torch.equal(getattr(native, name), getattr(reference, name)), name


def test_flat_keys_do_not_overflow_int32():
    grid = (2, 3, 70_000, 40_000)  # 1.7e10 voxels
    coords = torch.tensor([[2, 69_999, 39_999], [0, 0, 0], [3, 0, 0]])
    keys = flat_keys(torch.tensor([1, 0, 1]), coords, grid)
    expected_last = ((1 * 3 + 2) * 70_000 + 69_999) * 40_000 + 39_999
    assert keys.tolist() == [expected_last, 0, 2 * 3 * 70_000 * 40_000]
