"""bev.ops on the CPU: every backend against an independent float64 index_add_ reference.

The reference, the input generators and the case tables live in tests/helpers/ops.py, shared with the
CUDA (test_ops_cuda.py), emulated CUDA (test_ops_cuda_emulated.py) and fuzz (test_ops_fuzz.py) tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bev import ops
from bev.ops import _native
from bev.ops._plan import flat_keys, sort_keys
from helpers.ops import (
    DTYPES,
    FRUSTUM_CASES,
    VOXEL_CASES,
    SplatModule,
    assert_compiled_matches_eager,
    assert_matches,
    backends_for,
    index_add_bev_pool,
    index_add_voxel_sum,
    native_check_in_subprocess,
    opcheck_inputs,
    random_coords,
    random_frustum,
)

requires_native = pytest.mark.skipif(not ops.native_available("cpu"), reason="native CPU kernels not built")


def assert_gradient_is_exact_gather(out, feats, coords, grid, gen):
    """voxel_sum's backward is a pure gather of grad_out: exact in every dtype (vs float64 index_add_)."""
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    out.backward(grad_out)
    expected = feats.detach().to(torch.float64).requires_grad_()
    index_add_voxel_sum(expected, coords, grid).backward(grad_out.to(torch.float64))
    assert torch.equal(feats.grad.to(torch.float64), expected.grad)


# ---------------------------------------------------------------------------------------------
# voxel_sum: values and gradients
# ---------------------------------------------------------------------------------------------
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

    assert_gradient_is_exact_gather(out, feats, coords, grid, gen)


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


# Outputs and gradients of 8 MB or more take the kernels' streaming-store paths; grids whose
# channel runs are not whole cache lines (X*Y odd) mix streamed and plain rows.
LARGE_CASES = {
    # name: (N, C, grid_shape, dtype)
    "aligned-fp32": (40_000, 64, (2, 1, 128, 128), torch.float32),
    "unaligned-fp32": (40_000, 64, (2, 1, 127, 131), torch.float32),
    "fp64-odd-channels": (20_000, 33, (1, 2, 120, 136), torch.float64),
    "bf16": (80_000, 64, (4, 1, 128, 128), torch.bfloat16),
}


@requires_native
@pytest.mark.parametrize("case", LARGE_CASES, ids=str)
def test_native_voxel_sum_large_outputs(case):
    N, C, grid, dtype = LARGE_CASES[case]
    gen = torch.Generator().manual_seed(N + C)
    coords = random_coords(N, grid, gen)
    coords[: N // 4, 2] = coords[: N // 4, 2] % 7  # a dense band: many points per voxel
    feats = torch.randn(N, C, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    out = ops.voxel_sum(feats, coords, grid, backend="native")
    assert_matches(out, index_add_voxel_sum(feats.detach(), coords, grid), dtype)
    assert_gradient_is_exact_gather(out, feats, coords, grid, gen)


@requires_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_native_bev_pool_large_outputs(dtype):
    B, Nc, D, H, W, C = 2, 2, 12, 8, 22, 64
    grid = (B, 1, 128, 128)
    depth, feats, coords = random_frustum(B, Nc, D, H, W, C, grid, dtype, torch.Generator().manual_seed(5))
    depth.requires_grad_(), feats.requires_grad_()
    out = ops.bev_pool(depth, feats, coords, grid, backend="native")
    assert_matches(out, index_add_bev_pool(depth.detach(), feats.detach(), coords, grid), dtype)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64).to(dtype)
    out.backward(grad_out)
    d64 = depth.detach().double().requires_grad_()
    f64 = feats.detach().double().requires_grad_()
    index_add_bev_pool(d64, f64, coords, grid).backward(grad_out.double())
    assert_matches(depth.grad, d64.grad, dtype)
    assert_matches(feats.grad, f64.grad, dtype)


# ---------------------------------------------------------------------------------------------
# bev_pool: the fused op equals voxel_sum of the materialised product
# ---------------------------------------------------------------------------------------------
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
    loose = backend != "native"  # the references round each depth x feature product to dtype
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
    out = ops.bev_pool(
        torch.zeros(B, Nc, D, 0, W),
        torch.zeros(B, Nc, 0, W, C),
        torch.zeros(B, Nc, D, 0, W, 3, dtype=torch.long),
        grid,
        backend=backend,
    )
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
    for backend in ("torch", "quickcumsum"):
        reference = ops.bev_pool_plan(coords, grid, backend=backend)
        for name in ("keys", "order"):
            assert torch.equal(getattr(native, name), getattr(reference, name)), (backend, name)
    assert torch.equal(native.offsets, ops.bev_pool_plan(coords, grid, backend="quickcumsum").offsets)
    # The torch plan's sparse runs are the non-empty runs of the dense offsets.
    sparse = ops.bev_pool_plan(coords, grid, backend="torch")
    counts = native.offsets[1:] - native.offsets[:-1]
    assert torch.equal(sparse.voxels, counts.nonzero().squeeze(1)) and torch.equal(sparse.counts, counts[counts > 0])
    flat = random_coords(500, grid, gen, margin=3).int()
    assert torch.equal(torch.ops.bev._voxel_keys(flat, list(grid), True), flat_keys(flat[:, 0], flat[:, 1:], grid))


@requires_native
def test_native_sort_matches_a_stable_argsort():
    gen = torch.Generator().manual_seed(12)
    V = 50_000
    keys = torch.randint(-5, V + 5, (120_000,), generator=gen)  # some below 0 and >= V: ignored
    keys[:30_000] %= 97  # long runs
    order, offsets = torch.ops.bev._sort_keys(keys, V)
    bucket = torch.where((keys >= 0) & (keys < V), keys, V)
    want_order, want_offsets = sort_keys(bucket, V, use_native=False)
    assert torch.equal(order, want_order) and torch.equal(offsets, want_offsets)


@requires_native
def test_native_backward_reads_strided_gradients_without_copying_them():
    # out.sum().backward() passes an expanded (stride-0) gradient; the kernels read it through
    # its strides. Every layout must give what its contiguous copy gives.
    gen = torch.Generator().manual_seed(11)
    grid = (2, 2, 5, 6)
    depth, feats, coords = random_frustum(2, 3, 4, 3, 2, 7, grid, torch.float64, gen)
    plan = ops.bev_pool_plan(coords, grid, backend="native")
    B, Z, X, Y = grid
    layouts = {
        "scalar expanded": torch.tensor(0.5, dtype=torch.float64).expand(B, 7, Z, X, Y),
        "channels expanded": torch.randn(B, 1, Z, X, Y, generator=gen, dtype=torch.float64).expand(B, 7, Z, X, Y),
        "spatial transposed": torch.randn(B, 7, Z, Y, X, generator=gen, dtype=torch.float64).transpose(3, 4),
        "channels last": torch.randn(B, Z, X, Y, 7, generator=gen, dtype=torch.float64).permute(0, 4, 1, 2, 3),
    }
    for name, grad in layouts.items():
        dense = grad.contiguous()
        assert torch.equal(
            torch.ops.bev._voxel_sum_backward(grad, plan.keys, plan.order, plan.offsets),
            torch.ops.bev._voxel_sum_backward(dense, plan.keys, plan.order, plan.offsets),
        ), name
        got = torch.ops.bev._bev_pool_backward(grad, depth, feats, plan.keys, plan.offsets)
        want = torch.ops.bev._bev_pool_backward(dense, depth, feats, plan.keys, plan.offsets)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), name


def test_flat_keys_do_not_overflow_int32():
    grid = (2, 3, 70_000, 40_000)  # 1.7e10 voxels
    coords = torch.tensor([[2, 69_999, 39_999], [0, 0, 0], [3, 0, 0]])
    keys = flat_keys(torch.tensor([1, 0, 1]), coords, grid)
    expected_last = ((1 * 3 + 2) * 70_000 + 69_999) * 40_000 + 39_999
    assert keys.tolist() == [expected_last, 0, 2 * 3 * 70_000 * 40_000]


# ---------------------------------------------------------------------------------------------
# gradcheck, opcheck, torch.compile
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", backends_for("cpu"))
def test_gradcheck_float64(backend):
    gen = torch.Generator().manual_seed(6)
    grid = (2, 2, 3, 3)
    coords = random_coords(40, grid, gen)
    feats = torch.randn(40, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda f: ops.voxel_sum(f, coords, grid, backend=backend), (feats,))
    depth, feats, coords = random_frustum(2, 2, 3, 2, 2, 3, grid, torch.float64, gen)
    depth.requires_grad_(), feats.requires_grad_()
    assert torch.autograd.gradcheck(lambda d, f: ops.bev_pool(d, f, coords, grid, backend=backend), (depth, feats))


@requires_native
@pytest.mark.parametrize(
    "op_name", ["_voxel_keys", "_sort_keys", "voxel_sum", "_voxel_sum_backward", "bev_pool", "_bev_pool_backward"]
)
def test_opcheck(op_name):
    args = opcheck_inputs()[op_name]
    torch.library.opcheck(getattr(torch.ops.bev, op_name).default, args)


@requires_native
def test_module_runs_under_torch_compile_fullgraph(fresh_compile_caches):
    grid = (2, 1, 4, 4)
    depth, feats, coords = random_frustum(2, 2, 3, 2, 3, 4, grid, generator=torch.Generator().manual_seed(8))
    assert_compiled_matches_eager(SplatModule(grid, 4), depth, feats, coords)


# ---------------------------------------------------------------------------------------------
# property tests
# ---------------------------------------------------------------------------------------------
@st.composite
def voxel_problems(draw):
    grid = tuple(draw(st.integers(1, 4)) for _ in range(4))
    n = draw(st.integers(0, 60))
    c = draw(st.integers(1, 9))
    margin = draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    coords = random_coords(n, grid, gen, margin=margin)
    feats = torch.randn(n, c, generator=gen, dtype=torch.float64)
    return feats, coords, grid


BACKENDS = ["torch", "quickcumsum", "native"] if ops.native_available("cpu") else ["torch", "quickcumsum"]


@settings(max_examples=40, deadline=None)
@given(problem=voxel_problems(), backend=st.sampled_from(BACKENDS))
def test_property_voxel_sum(problem, backend):
    feats, coords, grid = problem
    feats.requires_grad_()
    out = ops.voxel_sum(feats, coords, grid, backend=backend)
    torch.testing.assert_close(out, index_add_voxel_sum(feats.detach(), coords, grid))
    # Conservation: the grid total is the total of the points that are inside.
    inside = ((coords >= 0) & (coords < torch.tensor(grid))).all(1)
    torch.testing.assert_close(out.sum(dim=(0, 2, 3, 4)), feats.detach()[inside].sum(0))
    out.sum().backward()
    assert torch.equal(feats.grad, inside[:, None].double().expand_as(feats))


@settings(max_examples=40, deadline=None)
@given(
    shape=st.tuples(*[st.integers(1, 3)] * 5),
    channels=st.integers(1, 6),
    grid=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
    seed=st.integers(0, 2**31 - 1),
    backend=st.sampled_from(BACKENDS),
)
def test_property_bev_pool_plan_and_values(shape, channels, grid, seed, backend):
    B, Nc, D, H, W = shape
    grid = (B, *grid)
    depth, feats, coords = random_frustum(
        B, Nc, D, H, W, channels, grid, torch.float64, torch.Generator().manual_seed(seed)
    )
    plan = ops.bev_pool_plan(coords, grid, backend=backend)
    # The plan is a stable sort of the keys with consistent runs.
    N, V = depth.numel(), B * grid[1] * grid[2] * grid[3]
    assert torch.equal(plan.order.sort().values, torch.arange(N))
    sorted_keys = plan.keys[plan.order]
    assert bool((sorted_keys[1:] >= sorted_keys[:-1]).all())
    same = sorted_keys[1:] == sorted_keys[:-1]
    assert bool((plan.order[1:][same] > plan.order[:-1][same]).all())  # stable
    if plan.offsets is not None:
        assert torch.equal(plan.offsets, torch.searchsorted(sorted_keys, torch.arange(V + 1)))
    else:
        valid = sorted_keys[sorted_keys < V]
        assert torch.equal(plan.voxels.repeat_interleave(plan.counts), valid) and bool((plan.counts > 0).all())
    expected = index_add_bev_pool(depth, feats, coords, grid)
    torch.testing.assert_close(ops.bev_pool(depth, feats, plan=plan, backend=backend), expected)
    # A plan built for one backend serves every other.
    for other in BACKENDS:
        torch.testing.assert_close(ops.bev_pool(depth, feats, plan=plan, backend=other), expected)


# ---------------------------------------------------------------------------------------------
# determinism
# ---------------------------------------------------------------------------------------------
@requires_native
def test_native_is_bitwise_deterministic_across_runs_and_thread_counts():
    gen = torch.Generator().manual_seed(9)
    grid = (2, 1, 8, 8)
    # Many collisions: 2*3*20*6*8 points into 128 voxels.
    depth, feats, coords = random_frustum(2, 3, 20, 6, 8, 33, grid, torch.float32, gen, margin=0)
    grad_out = torch.randn(2, 33, 1, 8, 8, generator=gen)

    def run():
        d, f = depth.clone().requires_grad_(), feats.clone().requires_grad_()
        out = ops.bev_pool(d, f, coords, grid, backend="native")
        out.backward(grad_out)
        points = (d.detach().unsqueeze(-1) * f.detach().unsqueeze(2)).reshape(-1, 33).requires_grad_()
        batch = torch.arange(2).view(2, 1, 1, 1, 1, 1).expand(2, 3, 20, 6, 8, 1)
        vs = ops.voxel_sum(points, torch.cat([batch, coords], -1).reshape(-1, 4), grid, backend="native")
        vs.backward(grad_out)
        return out, d.grad, f.grad, vs, points.grad

    threads = torch.get_num_threads()
    try:
        first = run()
        torch.set_num_threads(1)
        single = run()
    finally:
        torch.set_num_threads(threads)
    again = run()
    for a, b, c in zip(first, single, again):
        assert torch.equal(a, b) and torch.equal(a, c)


# ---------------------------------------------------------------------------------------------
# bad inputs, fallback, robustness
# ---------------------------------------------------------------------------------------------
def _good_voxel_args():
    return torch.randn(5, 3), torch.zeros(5, 4, dtype=torch.long), (1, 1, 2, 2)


def _good_frustum_args():
    depth, feats, coords = random_frustum(2, 1, 3, 2, 2, 4, (2, 1, 2, 2), generator=torch.Generator().manual_seed(0))
    return depth, feats, coords, (2, 1, 2, 2)


BAD_VOXEL_INPUTS = [
    # (description, kwargs override, exception, message fragment)
    ("feats not a tensor", {"feats": [[1.0]]}, TypeError, "feats"),
    ("integer feats", {"feats": torch.ones(5, 3, dtype=torch.long)}, TypeError, "feats"),
    ("feats rank 3", {"feats": torch.randn(5, 3, 1)}, ValueError, "feats"),
    ("float coords", {"coords": torch.zeros(5, 4)}, TypeError, "coords"),
    ("bool coords", {"coords": torch.zeros(5, 4, dtype=torch.bool)}, TypeError, "coords"),
    ("coords with 3 columns", {"coords": torch.zeros(5, 3, dtype=torch.long)}, ValueError, "coords"),
    ("coords rank 1", {"coords": torch.zeros(4, dtype=torch.long)}, ValueError, "coords"),
    ("row count mismatch", {"coords": torch.zeros(6, 4, dtype=torch.long)}, ValueError, "coords"),
    ("grid_shape 3 entries", {"grid_shape": (1, 2, 2)}, ValueError, "grid_shape"),
    ("grid_shape zero size", {"grid_shape": (1, 0, 2, 2)}, ValueError, "grid_shape"),
    ("grid_shape negative", {"grid_shape": (1, 1, -2, 2)}, ValueError, "grid_shape"),
    ("grid_shape float", {"grid_shape": (1, 1, 2.0, 2)}, TypeError, "grid_shape"),
    ("grid_shape not a sequence", {"grid_shape": 4}, TypeError, "grid_shape"),
    ("unknown backend", {"backend": "cuda"}, ValueError, "backend"),
    ("meta device coords", {"coords": torch.zeros(5, 4, dtype=torch.long, device="meta")}, ValueError, "device"),
]


@pytest.mark.parametrize("desc,override,exc,fragment", BAD_VOXEL_INPUTS, ids=[c[0] for c in BAD_VOXEL_INPUTS])
def test_voxel_sum_rejects_bad_inputs(desc, override, exc, fragment):
    feats, coords, grid = _good_voxel_args()
    kwargs = {"feats": feats, "coords": coords, "grid_shape": grid, "backend": "auto"}
    kwargs.update(override)
    with pytest.raises(exc, match=fragment):
        ops.voxel_sum(kwargs.pop("feats"), kwargs.pop("coords"), kwargs.pop("grid_shape"), **kwargs)


def _bad_frustum_cases():
    depth, feats, coords, grid = _good_frustum_args()
    return [
        ("depth rank 4", {"depth": depth[0]}, ValueError, "depth"),
        ("feats rank 4", {"feats": feats[0]}, ValueError, "feats"),
        ("feats batch mismatch", {"feats": feats[:1]}, ValueError, "feats"),
        ("feats spatial mismatch", {"feats": feats[:, :, :1]}, ValueError, "feats"),
        ("integer depth", {"depth": depth.long()}, TypeError, "depth"),
        ("float coords", {"coords": coords.float()}, TypeError, "coords"),
        ("coords shape mismatch", {"coords": coords[:, :, :2]}, ValueError, "coords"),
        ("coords missing last dim", {"coords": coords[..., 0]}, ValueError, "coords"),
        ("grid batch mismatch", {"grid_shape": (3, 1, 2, 2)}, ValueError, "grid_shape"),
        ("grid_shape zero size", {"grid_shape": (2, 1, 0, 2)}, ValueError, "grid_shape"),
        ("no coords and no plan", {"coords": None}, ValueError, "plan"),
        ("plan and coords", {"plan": ops.bev_pool_plan(coords, grid)}, ValueError, "plan"),
        ("plan wrong type", {"coords": None, "grid_shape": None, "plan": (1, 2)}, TypeError, "plan"),
        (
            "plan for other shape",
            {"coords": None, "grid_shape": None, "plan": ops.bev_pool_plan(coords[:, :, :2], grid)},
            ValueError,
            "plan",
        ),
        ("meta device feats", {"feats": feats.to("meta")}, ValueError, "device"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_frustum_cases())), ids=[c[0] for c in _bad_frustum_cases()])
def test_bev_pool_rejects_bad_inputs(case):
    _desc, override, exc, fragment = _bad_frustum_cases()[case]
    depth, feats, coords, grid = _good_frustum_args()
    kwargs = {"depth": depth, "feats": feats, "coords": coords, "grid_shape": grid}
    kwargs.update(override)
    with pytest.raises(exc, match=fragment):
        ops.bev_pool(**kwargs)


@pytest.mark.parametrize("backend", backends_for("cpu"))
def test_bev_pool_promotes_mixed_dtypes(backend):
    depth, feats, coords, grid = _good_frustum_args()
    out = ops.bev_pool(depth, feats.to(torch.bfloat16), coords, grid, backend=backend)
    assert out.dtype == torch.float32
    expected = index_add_bev_pool(depth, feats.to(torch.bfloat16).float(), coords, grid)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_bev_pool_plan_rejects_bad_inputs():
    _, _, coords, grid = _good_frustum_args()
    with pytest.raises(TypeError, match="coords"):
        ops.bev_pool_plan(coords.float(), grid)
    with pytest.raises(ValueError, match="grid_shape"):
        ops.bev_pool_plan(coords, (1, 1, 2, 2))
    with pytest.raises(ValueError, match="backend"):
        ops.bev_pool_plan(coords, grid, backend="fast")


@requires_native
def test_a_native_check_raises_instead_of_crashing():
    # In a subprocess: on one GPU machine's image the throw itself killed the process (SIGSEGV,
    # benchmarks/results/gpu_nvidia_h200.md); tests/test_ops_cuda.py checks the CUDA launcher alike.
    r = native_check_in_subprocess("cpu")
    assert r.returncode == 0 and "RuntimeError: feats must be (N, C)" in r.stdout, (
        r.returncode,
        r.stdout,
        r.stderr[-2000:],
    )


@requires_native
def test_native_kernels_survive_a_malformed_plan():
    # Garbage plan entries must never read or write out of bounds (the values are unspecified).
    feats = torch.randn(6, 3)
    keys = torch.tensor([0, -1, 2**40, 3, 4, 2])
    order = torch.tensor([5, -3, 2**40, 0, 7, 1])
    offsets = torch.tensor([4, -2, 2**41, 3, 6])  # 4 voxels
    out = torch.ops.bev.voxel_sum(feats, keys, order, offsets, [1, 1, 2, 2])
    grad = torch.ops.bev._voxel_sum_backward(torch.randn(1, 3, 1, 2, 2), keys, order, offsets)
    assert out.shape == (1, 3, 1, 2, 2) and grad.shape == (6, 3)
    depth, fr, _, _ = _good_frustum_args()
    keys = torch.randint(-(2**40), 2**40, (depth.numel(),))
    order = torch.randint(-100, 100, (depth.numel(),))
    offsets = torch.randint(-100, 100, (2 * 4 + 1,))
    out = torch.ops.bev.bev_pool(depth, fr, keys, order, offsets, [2, 1, 2, 2])
    grads = torch.ops.bev._bev_pool_backward(torch.randn_like(out), depth, fr, keys, offsets)
    assert out.shape == (2, 4, 1, 2, 2) and grads[0].shape == depth.shape and grads[1].shape == fr.shape


def test_auto_uses_native_when_built(monkeypatch):
    if not ops.native_available("cpu"):
        pytest.skip("native CPU kernels not built")

    def reference_called(*args, **kwargs):
        raise AssertionError("auto used the reference although native kernels are built")

    monkeypatch.setattr(ops._reference, "voxel_sum", reference_called)
    monkeypatch.setattr(ops._reference, "bev_pool", reference_called)
    feats, coords, grid = _good_voxel_args()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = ops.voxel_sum(feats, coords, grid)
        ops.bev_pool(*_good_frustum_args())
    assert torch.equal(out, ops.voxel_sum(feats, coords, grid, backend="native"))


def test_auto_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(_native, "available", lambda device=None: False)
    monkeypatch.setattr(ops, "_fallback_warned", set())
    feats, coords, grid = _good_voxel_args()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = ops.voxel_sum(feats, coords, grid)
        ops.voxel_sum(feats, coords, grid)
        ops.bev_pool(*_good_frustum_args())
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "reference" in messages[0]
    torch.testing.assert_close(first, ops.voxel_sum(feats, coords, grid, backend="torch"))
    with pytest.raises(RuntimeError, match="native"):
        ops.voxel_sum(feats, coords, grid, backend="native")


def test_import_survives_a_missing_extension():
    # A broken/missing bev.ops._C must degrade to the reference, never crash `import bev.ops`.
    code = (
        "import sys, warnings; sys.modules['bev.ops._C'] = None\n"
        "import torch, bev.ops as ops\n"
        "assert not ops.native_available()\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    out = ops.voxel_sum(torch.ones(3, 2), torch.zeros(3, 4, dtype=torch.long), (1, 1, 1, 1))\n"
        "assert out.flatten().tolist() == [3.0, 3.0], out\n"
        "assert len(w) == 1 and 'did not load' in str(w[0].message), [str(x.message) for x in w]\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
