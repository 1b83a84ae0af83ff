"""The CUDA kernels of bev.ops, run on the CPU by a SIMT emulation: every CI run checks them.

tests/cuda_emulation/emu_ops.cpp compiles bev/ops/csrc/cuda/pool_kernels.cuh (the kernels)
and pool_launchers.h (their host side: checks, tensor preparation, launch geometry) unchanged,
with simt.h standing in for the GPU: every block of the grid, every thread of a block as a
fiber, __syncthreads, per-block __shared__ memory and 32-lane warp shuffles. It is built once
per source version (keyed by a hash of the sources) into the pytest cache: the `emu` fixture
(tests/conftest.py, helpers/cuda_emulation.py).

What the emulation cannot show: speed, memory-model races between blocks, and the stream /
device-guard code of pool_cuda.cu (tests/test_ops_cuda.py covers those on a GPU).
"""

from __future__ import annotations

import pytest
import torch

from bev import ops
from helpers.cuda_emulation import emulated_bev_pool, emulated_voxel_sum
from helpers.ops import (
    DTYPES,
    FRUSTUM_CASES,
    VOXEL_CASES,
    assert_matches,
    index_add_bev_pool,
    index_add_voxel_sum,
    random_coords,
    random_frustum,
)

pytestmark = pytest.mark.cuda_emulated


# ---------------------------------------------------------------------------------------------
# cases: those of the CPU kernels (helpers/ops.py) plus channel counts around a warp, partial
# tiles (voxels per sample not a multiple of 32), B > 1 and Z > 1
# ---------------------------------------------------------------------------------------------
EMU_VOXEL_CASES = {
    **VOXEL_CASES,
    "c31-partial-tile": (150, 31, (2, 1, 5, 7)),
    "c32-z2": (150, 32, (1, 2, 4, 9)),
    "c33-b3": (120, 33, (3, 1, 4, 11)),
}
EMU_FRUSTUM_CASES = {
    **FRUSTUM_CASES,
    "c31-partial-tile": ((2, 2, 3, 2, 3, 31), (2, 1, 5, 7)),
    "c32-z2": ((1, 3, 4, 2, 2, 32), (1, 2, 4, 5)),
    "c33-b2": ((2, 1, 3, 3, 2, 33), (2, 1, 6, 6)),
}


# ---------------------------------------------------------------------------------------------
# values and gradients against the references
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", EMU_VOXEL_CASES, ids=str)
def test_voxel_sum_kernels(emu, dtype, case):
    N, C, grid = EMU_VOXEL_CASES[case]
    gen = torch.Generator().manual_seed(N * C + 1)
    coords = random_coords(N, grid, gen)
    feats = torch.randn(N, C, generator=gen, dtype=torch.float64).to(dtype)
    grad_out = torch.randn(grid[0], C, *grid[1:], generator=gen, dtype=torch.float64).to(dtype)
    out, grad = emulated_voxel_sum(emu, feats, coords, grid, grad_out)
    assert out.shape == (grid[0], C, *grid[1:]) and out.dtype == dtype
    assert_matches(out, index_add_voxel_sum(feats, coords, grid), dtype)
    reference = ops.voxel_sum(feats, coords, grid, backend="torch")
    assert_matches(out, reference.to(torch.float64), dtype)

    expected = feats.to(torch.float64).requires_grad_()
    index_add_voxel_sum(expected, coords, grid).backward(grad_out.to(torch.float64))
    assert torch.equal(grad.to(torch.float64), expected.grad)  # a gather: exact in every dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", EMU_FRUSTUM_CASES, ids=str)
def test_bev_pool_kernels(emu, dtype, case):
    (B, Nc, D, H, W, C), grid = EMU_FRUSTUM_CASES[case]
    gen = torch.Generator().manual_seed(B * Nc * D * C + 2)
    depth, feats, coords = random_frustum(B, Nc, D, H, W, C, grid, dtype, gen)
    grad_out = torch.randn(B, C, *grid[1:], generator=gen, dtype=torch.float64).to(dtype)
    out, grad_depth, grad_feats = emulated_bev_pool(emu, depth, feats, coords, grid, grad_out)
    assert_matches(out, index_add_bev_pool(depth, feats, coords, grid), dtype)
    reference = ops.bev_pool(depth.double(), feats.double(), coords, grid, backend="torch")
    assert_matches(out, reference, dtype)

    d64, f64 = depth.double().requires_grad_(), feats.double().requires_grad_()
    index_add_bev_pool(d64, f64, coords, grid).backward(grad_out.double())
    assert grad_depth.dtype == grad_feats.dtype == dtype
    assert_matches(grad_depth, d64.grad, dtype)
    assert_matches(grad_feats, f64.grad, dtype)


def test_half_types_accumulate_in_fp32(emu):
    # 4096 ones into one voxel: an fp16 accumulator would stop at 2048.
    for dtype in (torch.float16, torch.bfloat16):
        feats = torch.ones(4096, 3, dtype=dtype)
        coords = torch.tensor([[0, 0, 1, 1]]).repeat(4096, 1)
        grid = (1, 1, 2, 2)
        out, _ = emulated_voxel_sum(emu, feats, coords, grid, torch.zeros(1, 3, 1, 2, 2, dtype=dtype))
        assert out[0, :, 0, 1, 1].float().tolist() == [4096.0] * 3, dtype


@pytest.mark.parametrize("name", ["empty", "all-outside", "one-hot-voxel", "huge-coords"])
def test_adversarial_voxel_sum(emu, name):
    grid = (2, 3, 4, 5)
    coords = {
        "empty": torch.zeros(0, 4, dtype=torch.long),
        "all-outside": torch.tensor([[-1, 0, 0, 0], [2, 0, 0, 0], [0, 3, 0, 0], [0, 0, -4, 0], [0, 0, 0, 5]] * 7),
        "one-hot-voxel": torch.tensor([[1, 2, 3, 4]]).repeat(700, 1),
        "huge-coords": torch.tensor([[0, 0, 2**40, 0], [0, -(2**62), 0, 0], [2**62, 1, 1, 1], [1, 1, 1, 1]]),
    }[name]
    gen = torch.Generator().manual_seed(3)
    feats = torch.randn(coords.shape[0], 40, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(2, 40, 3, 4, 5, generator=gen, dtype=torch.float64)
    out, grad = emulated_voxel_sum(emu, feats, coords, grid, grad_out)
    torch.testing.assert_close(out, index_add_voxel_sum(feats, coords, grid))
    expected = feats.clone().requires_grad_()
    index_add_voxel_sum(expected, coords, grid).backward(grad_out)
    assert torch.equal(grad, expected.grad)


@pytest.mark.parametrize("name", ["empty", "all-outside", "one-hot-voxel"])
def test_adversarial_bev_pool(emu, name):
    grid = (2, 1, 3, 3)
    B, Nc, D, H, W, C = {
        "empty": (2, 1, 0, 2, 2, 5),
        "all-outside": (2, 2, 3, 2, 2, 5),
        "one-hot-voxel": (2, 2, 4, 3, 3, 33),
    }[name]
    gen = torch.Generator().manual_seed(4)
    depth, feats, coords = random_frustum(B, Nc, D, H, W, C, grid, torch.float64, gen)
    if name == "all-outside":
        coords[..., 1] = 3  # x == X
    if name == "one-hot-voxel":
        coords[..., 0], coords[..., 1], coords[..., 2] = 0, 2, 1
    grad_out = torch.randn(B, C, *grid[1:], generator=gen, dtype=torch.float64)
    out, grad_depth, grad_feats = emulated_bev_pool(emu, depth, feats, coords, grid, grad_out)
    torch.testing.assert_close(out, index_add_bev_pool(depth, feats, coords, grid))
    d, f = depth.clone().requires_grad_(), feats.clone().requires_grad_()
    index_add_bev_pool(d, f, coords, grid).backward(grad_out)
    torch.testing.assert_close(grad_depth, d.grad)
    torch.testing.assert_close(grad_feats, f.grad)


def test_kernels_are_bitwise_deterministic(emu):
    (B, Nc, D, H, W, C), grid = EMU_FRUSTUM_CASES["c33-b2"]
    gen = torch.Generator().manual_seed(5)
    depth, feats, coords = random_frustum(B, Nc, D, H, W, C, grid, torch.float32, gen)
    grad_out = torch.randn(B, C, *grid[1:], generator=gen)
    first = emulated_bev_pool(emu, depth, feats, coords, grid, grad_out)
    second = emulated_bev_pool(emu, depth, feats, coords, grid, grad_out)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_malformed_plan_stays_in_bounds(emu):
    # Offsets past N and negative order entries must be clamped/skipped, as in the CPU kernels.
    feats = torch.arange(12, dtype=torch.float32).view(4, 3)
    keys = torch.tensor([0, 1, 2, 3])
    order = torch.tensor([0, -5, 99, 3])
    offsets = torch.tensor([0, 2, 3, 50, -7])
    out = emu.voxel_sum(feats, keys, order, offsets, [1, 1, 2, 2])
    assert out.flatten(2).transpose(1, 2).reshape(4, 3)[0].tolist() == feats[0].tolist()
    assert out.flatten(2).transpose(1, 2).reshape(4, 3)[1].tolist() == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------
# launch geometry and 64-bit indexing
# ---------------------------------------------------------------------------------------------
# (B, Nc, D, H, W, C, (Z, X, Y)): the LSS paper config, BEVDet, and a large trainval batch.
PROBLEMS = {
    "lss": (4, 6, 41, 8, 22, 64, (1, 200, 200)),
    "bevdet": (1, 6, 118, 32, 88, 80, (1, 256, 256)),
    "trainval-batch": (64, 6, 118, 32, 88, 80, (1, 256, 256)),
}
MAX_GRID_X, MAX_GRID_YZ, MAX_BLOCK, MAX_SHARED = 2**31 - 1, 65535, 1024, 48 * 1024


def _within_cuda_limits(launch):
    gx, gy, gz = launch["grid"]
    bx, by, bz = launch["block"]
    assert 1 <= gx <= MAX_GRID_X and 1 <= gy <= MAX_GRID_YZ and gz == 1
    assert bx * by * bz <= MAX_BLOCK and bx % 32 == 0
    assert launch["shared_bytes"] <= MAX_SHARED
    assert launch["fits_one_launch"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
def test_launch_dims_within_cuda_limits(emu, problem, dtype):
    B, Nc, D, H, W, C, (Z, X, Y) = PROBLEMS[problem]
    sizes = emu.kernel_sizes()
    S = Z * X * Y
    forward = emu.forward_launch(B, S, C, dtype)
    _within_cuda_limits(forward)
    # The grid covers every voxel of every sample and every channel, with no empty block row.
    tiles = forward["tiles_per_batch"]
    assert tiles * sizes["tile_voxels"] >= S > (tiles - 1) * sizes["tile_voxels"]
    assert forward["grid"][0] == B * tiles
    assert forward["grid"][1] * sizes["tile_channels"] >= C > (forward["grid"][1] - 1) * sizes["tile_channels"]
    acc_bytes = 8 if dtype == "float64" else 4  # half types accumulate in fp32
    assert forward["shared_bytes"] == acc_bytes * sizes["tile_voxels"] * (sizes["tile_channels"] + 1)
    for rows in (B * Nc * D * H * W, B * Nc * H * W):  # points (voxel_sum backward), pixels (bev_pool backward)
        launch = emu.rows_launch(rows)
        _within_cuda_limits(launch)
        assert launch["grid"][0] * launch["block"][1] >= rows > (launch["grid"][0] - 1) * launch["block"][1]


def test_too_large_launch_is_refused_clearly(emu):
    assert not emu.forward_launch(1, 32, 32 * 65536, "float32")["fits_one_launch"]  # gridDim.y = 65536
    assert not emu.rows_launch(8 * 2**31)["fits_one_launch"]  # gridDim.x = 2^31
    feats = torch.empty(0, 32 * 65536)
    no_points = torch.empty(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match="too large for one CUDA launch"):
        emu.voxel_sum(feats, no_points, no_points, torch.zeros(2, dtype=torch.long), [1, 1, 1, 1])


def test_index_helpers_are_64_bit(emu):
    # Values past 2^31 and 2^32: an int32 intermediate anywhere would wrap.
    D, HW = 118, 32 * 88
    for p in (2**31 + 12345, 3 * 2**32 + 7, 2**40 + 99):
        assert emu.frustum_feature_row(p, D, HW) == (p // (D * HW)) * HW + p % HW
    for pix in (2**31 // HW + 5, 2**33 + 3):
        for d in (0, D - 1):
            assert emu.frustum_point(pix, d, D, HW) == ((pix // HW) * D + d) * HW + pix % HW
    C, S = 520, 2048 * 2048
    for b, c, s in ((0, 519, S - 1), (3, 7, 11), (1000, 519, S - 1)):
        assert emu.grid_index(b, c, s, C, S) == (b * C + c) * S + s
    assert emu.grid_index(0, 519, S - 1, C, S) > 2**31


# ---------------------------------------------------------------------------------------------
# the emulation itself enforces SIMT rules (so the tests above cannot pass by accident)
# ---------------------------------------------------------------------------------------------
def test_emulation_refuses_a_shuffle_in_a_partial_warp(emu):
    with pytest.raises(RuntimeError, match="shuffle was reached by 16 of 32 lanes"):
        emu.run_test_kernel("partial_warp_shuffle", 48, 0.0)


def test_emulation_refuses_an_invalid_launch(emu):
    with pytest.raises(RuntimeError, match="invalid launch configuration"):
        emu.run_test_kernel("missing_barrier", 2048, 0.0)


def test_emulation_exposes_a_missing_barrier(emu):
    # Thread t reads the value of thread 63 - t without __syncthreads: threads run until they
    # block, so the first half reads values not yet written (on a GPU: a race).
    for base in (100.0, 200.0):
        out = emu.run_test_kernel("missing_barrier", 64, base)
        correct = base + torch.arange(63, -1, -1, dtype=torch.float32)
        assert not torch.equal(out, correct)
        assert torch.equal(out[32:], correct[32:])  # the second half reads values already written
