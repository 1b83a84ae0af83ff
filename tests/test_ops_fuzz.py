"""Fuzz every bev.ops backend against a float64 index_add_ oracle, non-finite values and wide
value ranges included, and the regression tests of the reference's old failure modes.

Each fuzz case is drawn from a seeded generator (case i uses seed i, so a failure names the
case to replay). A result passes when its non-finite entries are exactly the oracle's (same NaN
positions, same signed infinities) and every finite entry is within the classic bound of a
sequential sum, n * u * sum(|x|), plus one rounding to the output dtype. "quickcumsum"
differences one prefix sum over all points, so it is held to the bound of that prefix on
well-conditioned cases, and its failures on the others are asserted as known limitations.
"""

from __future__ import annotations

import math

import pytest
import torch

from bev import ops
from bev.ops import _checks
from bev.utils.profiling import peak_cpu_bytes
from helpers.ops import (
    DTYPES,
    backends_for,
    frustum_to_points,
    index_add_bev_pool,
    index_add_voxel_sum,
    random_coords,
)

NATIVE = pytest.mark.skipif(not ops.native_available("cpu"), reason="native CPU kernels not built")
BACKENDS = backends_for("cpu")
MODES = ["normal", "wide", "nonfinite"]
# Exponent ranges (base 10) of "wide" values: inputs stay finite in their dtype, and sums and
# products stay clear of overflow so non-finite outputs come from non-finite inputs only.
WIDE = {torch.float64: 30, torch.float32: 30, torch.bfloat16: 30, torch.float16: 2}
CASES = 240  # voxel_sum cases per backend (20 per dtype x value mode)
FRUSTUM_CASES = 96  # bev_pool cases per backend


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def accumulation(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def draw_values(shape, dtype, mode, gen, exponent=None) -> torch.Tensor:
    """randn, or sign * 10**U(-e, e), with about 10% inf/-inf/NaN in "nonfinite"."""
    if mode == "normal":
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    e = WIDE[dtype] if exponent is None else exponent
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    values = sign * 10.0 ** ((torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * e)
    if mode == "nonfinite":
        specials = torch.tensor([math.inf, -math.inf, math.nan], dtype=torch.float64)
        pick = specials[torch.randint(0, 3, shape, generator=gen)]
        values = torch.where(torch.rand(shape, generator=gen) < 0.1, pick, values)
    return values.to(dtype)


def assert_within_bound(got, oracle, magnitude, terms, dtype, what, extra_u=0.0):
    """got (dtype) vs the float64 oracle: identical non-finite entries; finite ones within
    terms * u_acc * magnitude (+ extra_u * magnitude) + one rounding to dtype."""
    got = got.detach().to(torch.float64)
    assert torch.equal(got.isnan(), oracle.isnan()), f"{what}: NaN positions differ"
    inf = oracle.isinf()
    assert torch.equal(got.isinf(), inf) and torch.equal(got[inf], oracle[inf]), f"{what}: infinities differ"
    finite = oracle.isfinite()
    info = torch.finfo(dtype)
    bound = (terms * unit_roundoff(accumulation(dtype)) + extra_u) * magnitude + unit_roundoff(dtype) * oracle.abs()
    bound = bound + info.tiny * info.eps  # subnormal spacing of the output dtype
    err = (got - oracle).abs()
    bad = finite & ~(err <= bound)
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} entries beyond the rounding bound, worst error {float(err[bad].max()):.3g} "
        f"at bound {float(bound[bad][err[bad].argmax()]):.3g}"
    )


def voxel_case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    grid = tuple(int(torch.randint(1, 5, (1,), generator=gen)) for _ in range(4))
    n = int(torch.randint(0, 80, (1,), generator=gen))
    c = int(torch.randint(1, 7, (1,), generator=gen))
    dtype = DTYPES[seed % len(DTYPES)]
    mode = MODES[(seed // len(DTYPES)) % len(MODES)]
    coords = random_coords(n, grid, gen, margin=int(torch.randint(0, 3, (1,), generator=gen)))
    feats = draw_values((n, c), dtype, mode, gen)
    grad_out = draw_values((grid[0], c, *grid[1:]), dtype, mode, gen)
    return feats, coords, grid, grad_out, dtype, mode


def voxel_oracle(feats, coords, grid):
    """float64 sums, sums of |x| and points per voxel (broadcast over channels)."""
    x = feats.to(torch.float64)
    ones = torch.ones(x.shape[0], 1, dtype=torch.float64)
    return (
        index_add_voxel_sum(x, coords, grid),
        index_add_voxel_sum(x.abs(), coords, grid),
        index_add_voxel_sum(ones, coords, grid),
    )


def check_voxel_case(backend, seed):
    feats, coords, grid, grad_out, dtype, mode = voxel_case(seed)
    what = f"voxel_sum backend={backend} case {seed} ({mode}, {dtype}, grid {grid}, N={feats.shape[0]})"
    feats = feats.requires_grad_()
    out = ops.voxel_sum(feats, coords, grid, backend=backend)
    expected, magnitude, counts = voxel_oracle(feats.detach(), coords, grid)
    if backend == "quickcumsum":
        # Differencing a float64 prefix over all N points: error up to N * u64 * sum of all |x|.
        total = magnitude.sum(dim=(0, 2, 3, 4), keepdim=True)
        assert_within_bound(
            out, expected, total, 0, dtype, what, extra_u=2 * feats.shape[0] * unit_roundoff(torch.float64)
        )
    else:
        assert_within_bound(out, expected, magnitude, counts, dtype, what)
    # The backward is a gather: every point gets exactly its voxel's gradient (zero outside).
    # Every other case uses out.sum(), whose gradient is expanded (stride 0).
    if seed % 2:
        out.sum().backward()
        grad_out = torch.ones_like(out)
    else:
        out.backward(grad_out)
    reference = feats.detach().to(torch.float64).requires_grad_()
    index_add_voxel_sum(reference, coords, grid).backward(grad_out.to(torch.float64))
    torch.testing.assert_close(
        feats.grad.to(torch.float64),
        reference.grad,
        rtol=0,
        atol=0,
        equal_nan=True,
        msg=lambda m: f"{what}: gradient {m}",
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_fuzz_voxel_sum(backend):
    known_failures = 0
    for seed in range(CASES):
        mode = voxel_case(seed)[5]
        if backend == "quickcumsum" and mode != "normal":
            try:
                check_voxel_case(backend, seed)
            except AssertionError:
                known_failures += 1
            continue
        check_voxel_case(backend, seed)
    if backend == "quickcumsum":
        # Known limitation (see bev/ops/_reference.py): differencing a prefix sum spreads
        # non-finite values and cancels small voxels. If this stops failing, update the docs.
        assert known_failures >= CASES // 10, known_failures


def frustum_case(seed: int):
    gen = torch.Generator().manual_seed(10_000 + seed)
    B, Nc, D, H, W = (int(torch.randint(1, 4, (1,), generator=gen)) for _ in range(5))
    C = int(torch.randint(1, 6, (1,), generator=gen))
    grid = (B, *(int(torch.randint(1, 4, (1,), generator=gen)) for _ in range(3)))
    dtype = DTYPES[seed % len(DTYPES)]
    # Products of two wide factors: half the exponent range each, no overflow. Half types only
    # get well-conditioned values: the references round each product to the input dtype.
    mode = "normal" if dtype in (torch.float16, torch.bfloat16) else MODES[(seed // len(DTYPES)) % len(MODES)]
    e = WIDE[dtype] // 2
    depth = draw_values((B, Nc, D, H, W), dtype, mode, gen, e)
    feats = draw_values((B, Nc, H, W, C), dtype, mode, gen, e)
    coords = torch.stack([torch.randint(-1, s + 1, (B, Nc, D, H, W), generator=gen) for s in grid[1:]], dim=-1)
    grad_out = draw_values((B, C, *grid[1:]), dtype, mode, gen, e)
    return depth, feats, coords, grid, grad_out, dtype, mode


def check_frustum_case(backend, seed):
    depth, feats, coords, grid, grad_out, dtype, mode = frustum_case(seed)
    what = f"bev_pool backend={backend} case {seed} ({mode}, {dtype}, grid {grid}, depth {tuple(depth.shape)})"
    depth.requires_grad_(), feats.requires_grad_()
    out = ops.bev_pool(depth, feats, coords, grid, backend=backend)
    out.backward(grad_out)
    d64 = depth.detach().to(torch.float64).requires_grad_()
    f64 = feats.detach().to(torch.float64).requires_grad_()
    expected = index_add_bev_pool(d64, f64, coords, grid)
    expected.backward(grad_out.to(torch.float64))
    # Magnitudes: the same sums over |terms|, via the oracle on absolute values.
    da, fa = d64.detach().abs().requires_grad_(), f64.detach().abs().requires_grad_()
    magnitude = index_add_bev_pool(da, fa, coords, grid)
    magnitude.backward(grad_out.to(torch.float64).abs())
    points, flat = frustum_to_points(depth.detach(), feats.detach(), coords)
    counts = index_add_voxel_sum(torch.ones(points.shape[0], 1, dtype=torch.float64), flat, grid)
    u_in = unit_roundoff(dtype)  # the references round each product to dtype
    extra = 2 * depth.numel() * unit_roundoff(torch.float64) if backend == "quickcumsum" else 0.0
    scale = magnitude.detach().sum(dim=(0, 2, 3, 4), keepdim=True) if backend == "quickcumsum" else magnitude.detach()
    assert_within_bound(
        out, expected.detach(), scale, counts if backend != "quickcumsum" else 0, dtype, what, extra_u=u_in + extra
    )
    # grad_depth: a dot product over C channels; grad_feats: a sum over the D depth bins.
    assert_within_bound(depth.grad, d64.grad, da.grad, feats.shape[-1], dtype, what + " grad_depth", extra_u=u_in)
    assert_within_bound(feats.grad, f64.grad, fa.grad, depth.shape[2], dtype, what + " grad_feats", extra_u=u_in)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fuzz_bev_pool(backend):
    for seed in range(FRUSTUM_CASES):
        mode = frustum_case(seed)[6]
        if backend == "quickcumsum" and mode != "normal":
            continue  # known limitation, asserted in test_fuzz_voxel_sum and the regressions below
        check_frustum_case(backend, seed)


# ---------------------------------------------------------------------------------------------
# regressions: the reference's old failure modes (each failed before the reference was rewritten)
# ---------------------------------------------------------------------------------------------
def diagonal_coords(n):
    return torch.tensor([[0, 0, i, i] for i in range(n)])


@pytest.mark.parametrize("backend", ["torch", pytest.param("native", marks=NATIVE)])
def test_one_inf_stays_in_its_voxel(backend):
    feats = torch.ones(4, 2)
    feats[0, 0] = math.inf
    out = ops.voxel_sum(feats, diagonal_coords(4), (1, 1, 4, 4), backend=backend)
    assert int((~out.isfinite()).sum()) == 1 and out[0, 0, 0, 0, 0] == math.inf
    assert out.nan_to_num(posinf=0).sum() == 7
    # bev_pool: one NaN depth poisons the voxels of its own point only.
    depth = torch.ones(1, 1, 4, 1, 1)
    depth[0, 0, 0] = math.nan
    coords = torch.tensor([[0, i, i] for i in range(4)]).view(1, 1, 4, 1, 1, 3)
    out = ops.bev_pool(depth, torch.ones(1, 1, 1, 1, 2), coords, (1, 1, 4, 4), backend=backend)
    assert int(out.isnan().sum()) == 2 and bool(out[0, :, 0, 0, 0].isnan().all())


def test_quickcumsum_spreads_one_inf_known_limitation():
    feats = torch.ones(4, 2)
    feats[0, 0] = math.inf
    out = ops.voxel_sum(feats, diagonal_coords(4), (1, 1, 4, 4), backend="quickcumsum")
    assert int((~out.isfinite()).sum()) == 16  # every voxel of the grid (those after it are NaN)


@pytest.mark.parametrize("backend", ["torch", pytest.param("native", marks=NATIVE)])
def test_float64_small_voxel_after_a_large_one_is_exact(backend):
    feats = torch.tensor([[1e17], [1.0]], dtype=torch.float64)
    out = ops.voxel_sum(feats, diagonal_coords(2), (1, 1, 2, 2), backend=backend)
    assert out[0, 0, 0].diagonal().tolist() == [1e17, 1.0]


def test_quickcumsum_loses_small_voxels_known_limitation():
    feats = torch.tensor([[1e17], [1.0]], dtype=torch.float64)
    out = ops.voxel_sum(feats, diagonal_coords(2), (1, 1, 2, 2), backend="quickcumsum")
    assert out[0, 0, 0].diagonal().tolist() == [1e17, 0.0]


def test_sparse_plan_memory_scales_with_points():
    # A huge, nearly empty grid: the torch plan holds O(points), never 8 bytes per voxel.
    coords = torch.zeros(1, 1, 1, 1, 1, 3, dtype=torch.long)
    plan = ops.bev_pool_plan(coords, (1, 1, 20_000, 20_000), backend="torch")
    assert plan.offsets is None and all(t.numel() <= 1 for t in (plan.keys, plan.order, plan.voxels, plan.counts))
    # The whole voxel_sum call allocates its (1, 1, 1, 2000, 2000) output and little else
    # (a dense plan would add 32 MB of offsets and 32 MB of searchsorted boundaries).
    grid = (1, 1, 2000, 2000)
    feats, coords = torch.ones(5, 1), torch.tensor([[0, 0, 7, 9]] * 5)
    out_bytes = 2000 * 2000 * 4
    peak = peak_cpu_bytes(lambda: ops.voxel_sum(feats, coords, grid, backend="torch"))
    assert out_bytes <= peak < out_bytes + (1 << 20), peak
    assert ops.voxel_sum(feats, coords, grid, backend="torch")[0, 0, 0, 7, 9] == 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_grid_larger_than_the_device_is_refused_before_allocating(backend, monkeypatch):
    # Pretend the machine has 1 GB, so no test machine ever tries the 40 GB allocation.
    monkeypatch.setattr(_checks, "memory_limit", lambda device: 10**9)
    grid = (1, 1, 100_000, 100_000)
    with pytest.raises(MemoryError, match=r"grid_shape=\(1, 1, 100000, 100000\).* GB"):
        ops.voxel_sum(torch.ones(1, 1), torch.zeros(1, 4, dtype=torch.long), grid, backend=backend)
    depth, feats = torch.ones(1, 1, 1, 1, 1), torch.ones(1, 1, 1, 1, 1)
    coords = torch.zeros(1, 1, 1, 1, 1, 3, dtype=torch.long)
    with pytest.raises(MemoryError, match="GB"):
        ops.bev_pool(depth, feats, coords, grid, backend=backend)
    if backend != "torch":  # the sparse torch plan needs no per-voxel memory: built fine
        with pytest.raises(MemoryError, match="dense plan"):
            ops.bev_pool_plan(coords, grid, backend=backend)


def test_memory_error_names_the_bytes_and_the_limit(monkeypatch):
    monkeypatch.setattr(_checks, "memory_limit", lambda device: 2 * 10**9)
    with pytest.raises(MemoryError, match=r"needs at least 40\.0 GB for the output, more than the 2\.0 GB"):
        _checks.check_memory((1, 1, 100_000, 100_000), 4, "the output", torch.device("cpu"))
    _checks.check_memory((1, 1, 10_000, 10_000), 4, "the output", torch.device("cpu"))  # 0.4 GB: fine


@pytest.mark.parametrize("backend", BACKENDS)
def test_grid_dims_beyond_int64_keys_are_refused(backend):
    grid = (2**31, 2**31, 2**31, 2**31)
    with pytest.raises(ValueError, match=r"X=2147483648 .* limit of 2\*\*62"):
        ops.voxel_sum(torch.ones(1, 1), torch.zeros(1, 4, dtype=torch.long), grid, backend=backend)
    with pytest.raises(ValueError, match=r"Y=2 .* limit of 2\*\*62"):
        ops.bev_pool_plan(torch.zeros(1, 1, 1, 1, 1, 3, dtype=torch.long), (1, 2**31, 2**31, 2), backend=backend)
