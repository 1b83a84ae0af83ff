"""The LiDAR encoder (bev.models.lidar): pillar features against a per-pillar Python loop on a small cloud, the
pillar sums of bev.ops against index_add_, the SECOND backbone's shape, clouds of no and one point."""

from __future__ import annotations

import math

import pytest
import torch

from bev.geometry import Grid
from bev.models.lidar import LidarEncoder, PillarEncoder, pillar_keys

GRID = Grid(xbound=(-4.0, 4.0, 1.0), ybound=(-3.0, 3.0, 1.0), zbound=(-2.0, 2.0, 4.0))


def small_cloud(seed: int = 0, n: int = 90) -> torch.Tensor:
    """(n + 4, 6) rows (batch, x, y, z, intensity, time lag), 2 batches, clustered so that pillars hold several
    points, plus points outside the grid (x, z), one on the upper x edge and one with a NaN coordinate."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[-3.5, -2.5], [0.2, 0.7], [2.9, 1.1], [-0.4, -0.6]])
    pick = torch.randint(0, len(centres), (n,), generator=g)
    xy = centres[pick] + (torch.rand(n, 2, generator=g) - 0.5) * 1.6
    rows = torch.cat(
        [
            torch.randint(0, 2, (n, 1), generator=g).float(),
            xy,
            torch.rand(n, 1, generator=g) * 3 - 1.5,
            torch.rand(n, 1, generator=g) * 255,
            torch.randint(0, 3, (n, 1), generator=g).float() * 0.05,
        ],
        1,
    )
    odd = torch.tensor(
        [
            [0, 4.0, 0.0, 0.0, 9, 0],
            [1, 0.5, 0.5, 2.5, 9, 0],
            [1, float("nan"), 0.5, 0.0, 9, 0],
            [0, 3.999, 2.5, 0, 9, 0],
        ]
    )
    return torch.cat([rows, odd])


def loop_pillars(points: torch.Tensor, grid: Grid, batch_size: int) -> dict[tuple[int, int, int], torch.Tensor]:
    """{(b, ix, iy): (n, 11) PFN inputs of its points} by plain Python over each point (module doc of lidar.py)."""
    (xlo, xhi, xs), (ylo, yhi, ys), (zlo, zhi, _) = grid.xbound, grid.ybound, grid.zbound
    groups: dict[tuple[int, int, int], list[list[float]]] = {}
    for b, x, y, z, i, t in points.tolist():
        if not all(math.isfinite(v) for v in (x, y, z)) or not (xlo <= x < xhi and ylo <= y < yhi and zlo <= z < zhi):
            continue
        key = (int(b), math.floor((x - xlo) / xs), math.floor((y - ylo) / ys))
        groups.setdefault(key, []).append([x, y, z, i, t])
    out = {}
    for (b, ix, iy), rows in groups.items():
        pts = torch.tensor(rows, dtype=torch.float64)
        mean = pts[:, :3].mean(0)
        centre = torch.tensor([xlo + (ix + 0.5) * xs, ylo + (iy + 0.5) * ys, (zlo + zhi) / 2], dtype=torch.float64)
        out[(b, ix, iy)] = torch.cat([pts, pts[:, :3] - mean, pts[:, :3] - centre], 1)
    return out


def loop_encoder(enc: PillarEncoder, points: torch.Tensor, batch_size: int) -> torch.Tensor:
    """PillarEncoder's canvas by the loop: each PFN layer as x W^T, BN (batch statistics over every kept point in
    training, running ones in eval), ReLU; each pillar's max (or mean) taken pillar by pillar."""
    pillars = loop_pillars(points, enc.grid, batch_size)
    keys = list(pillars)
    feats = {k: v for k, v in pillars.items()}
    for n, layer in enumerate(enc.pfn):
        W = layer.linear.weight.double()
        lin = {k: v @ W.T for k, v in feats.items()}
        allrows = torch.cat([lin[k] for k in keys])
        bn = layer.norm
        if enc.training:
            mu, var = allrows.mean(0), allrows.var(0, unbiased=False)
        else:
            mu, var = bn.running_mean.double(), bn.running_var.double()
        norm = {
            k: torch.relu((v - mu) / torch.sqrt(var + bn.eps) * bn.weight.double() + bn.bias.double())
            for k, v in lin.items()
        }
        if n < len(enc.pfn) - 1:
            feats = {k: torch.cat([v, v.max(0).values.expand_as(v)], 1) for k, v in norm.items()}
        else:
            feats = norm
    C = enc.out_channels
    canvas = torch.zeros(batch_size, C, enc.grid.nx, enc.grid.ny, dtype=torch.float64)
    for (b, ix, iy), v in feats.items():
        canvas[b, :, ix, iy] = v.max(0).values if enc.reduce == "max" else v.mean(0)
    return canvas


def _random_bn(enc: torch.nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for m in enc.modules():
        if isinstance(m, torch.nn.BatchNorm1d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g))
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.randn(m.num_features, generator=g))
            m.bias.data.copy_(torch.randn(m.num_features, generator=g))


@pytest.mark.parametrize("reduce", ["max", "mean"])
@pytest.mark.parametrize("channels", [(8,), (6, 10)])
@pytest.mark.parametrize("training", [False, True])
def test_pillar_features_equal_a_per_pillar_loop(reduce, channels, training):
    torch.manual_seed(0)
    enc = PillarEncoder(GRID, channels, reduce=reduce).train(training)
    _random_bn(enc)
    points = small_cloud()
    with torch.no_grad():
        got = enc(points, 2)
    want = loop_encoder(enc, points, 2)
    assert got.shape == (2, channels[-1], GRID.nx, GRID.ny)
    assert (want.abs().sum(1) > 0).sum() >= 6  # several occupied pillars in both batches
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_pillar_keys_floor_bin_and_drop_what_lies_outside():
    points = small_cloud()
    cells, kept = pillar_keys(points, GRID, 2)
    loop = loop_pillars(points, GRID, 2)
    assert int(kept.sum()) == sum(len(v) for v in loop.values())
    assert set(map(tuple, cells.tolist())) == set(loop)
    assert not kept[-4:-1].any() and kept[-1]  # x = xhi, z = zhi and NaN out; x just below xhi in the last cell
    assert cells[-1].tolist() == [0, GRID.nx - 1, 5]
    assert not pillar_keys(points, GRID, 1)[1][points[:, 0] == 1].any()  # a batch index past the batch size


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_the_pillar_sums_of_the_op_equal_index_add(backend):
    from bev import ops

    if backend == "native" and not ops.native_available("cpu"):
        pytest.skip("the native CPU kernel is not built here")
    enc = PillarEncoder(GRID, (8,), reduce="mean", pool_backend=backend)
    points = small_cloud(3)
    cells, kept = pillar_keys(points, GRID, 2)
    feats = torch.randn(len(cells), 5, dtype=torch.float64)
    got = enc._sums(feats, cells, 2)
    flat = (cells[:, 0] * GRID.nx + cells[:, 1]) * GRID.ny + cells[:, 2]
    want = torch.zeros(2 * GRID.nx * GRID.ny, 5, dtype=torch.float64).index_add_(0, flat, feats)
    torch.testing.assert_close(got.permute(0, 2, 3, 1).reshape(-1, 5), want)


def test_scatter_max_gradient_goes_to_each_pillars_largest_point():
    """The max per pillar (scatter_reduce amax) sends each pillar's gradient to the point that is its max."""
    enc = PillarEncoder(GRID, (4,))
    flat = torch.tensor([0, 0, 0, 5, 5])
    x = torch.tensor([[1.0, 7, 3, 2], [3, 1, 3, 2], [2, 2, 3, 1], [0, 0, 4, 4], [1, 1, 1, 5]], requires_grad=True)
    out = enc._pillar_max(x, flat, 1)
    assert out[0].tolist() == [3, 7, 3, 2] and out[5].tolist() == [1, 1, 4, 5] and out[1].abs().sum() == 0
    out[[0, 5]].sum().backward()
    want = torch.tensor([[0, 1, 1 / 3, 0.5], [1, 0, 1 / 3, 0.5], [0, 0, 1 / 3, 0], [0, 0, 1, 0], [1, 1, 0, 1]])
    torch.testing.assert_close(x.grad, want)


def test_encoder_gives_the_grid_and_gradients_reach_every_part():
    torch.manual_seed(0)
    grid = Grid(xbound=(-5.0, 5.0, 0.5), ybound=(-4.0, 4.0, 0.5), zbound=(-2.0, 2.0, 4.0))
    enc = LidarEncoder(grid, (8,), widths=(8, 12, 16), blocks=(1, 1, 1), strides=(1, 2, 2), up_channels=(4, 4, 6))
    points = small_cloud(1, 400)
    points[:, 1:3] *= 1.2
    out = enc(points, 2)
    assert out.shape == (2, 14, 20, 16) and enc.out_channels == 14
    out.square().mean().backward()
    for name, p in enc.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_odd_grid_sides_come_back_at_the_grid_size():
    grid = Grid(xbound=(-5.0, 5.0, 1.0), ybound=(-3.5, 3.5, 1.0), zbound=(-2.0, 2.0, 4.0))  # 10 x 7 cells
    enc = LidarEncoder(grid, (4,), widths=(4, 4, 4), blocks=(0, 0, 0), strides=(1, 2, 2), up_channels=(2, 2, 2))
    assert enc(small_cloud(), 2).shape == (2, 6, 10, 7)


@pytest.mark.parametrize("n", [0, 1])
def test_clouds_of_no_or_one_point_train_without_nan(n):
    enc = LidarEncoder(GRID, (4,), widths=(4, 4, 4), blocks=(1, 1, 1), up_channels=(2, 2, 2)).train()
    points = torch.tensor([[1, 0.3, 0.2, 0.1, 10.0, 0.0]])[:n]
    out = enc(points, 2)
    assert out.shape == (2, 6, GRID.nx, GRID.ny) and torch.isfinite(out).all()
    out.sum().backward()
    bn = enc.pillars.pfn[0].norm
    assert torch.isfinite(bn.running_mean).all() and torch.isfinite(bn.running_var).all()


def test_bad_options_and_points_are_one_clear_error():
    with pytest.raises(ValueError, match="reduce must be one of max, mean"):
        PillarEncoder(GRID, (4,), reduce="sum")
    with pytest.raises(ValueError, match="need one entry per stage"):
        LidarEncoder(GRID, (4,), widths=(4, 4), blocks=(1,))
    with pytest.raises(ValueError, match=r"points must be \(P, 6\) rows"):
        LidarEncoder(GRID, (4,), widths=(4,), blocks=(1,), strides=(1,), up_channels=(2,))(torch.zeros(3, 5), 1)


def test_pillar_max_equals_scatter_reduce_values_and_gradients():
    """PillarMax (the encoder's max) against torch's scatter_reduce "amax" forward and backward, ties included
    (rounded values put several points at one pillar's max), and a float64 gradcheck."""
    from bev.models.lidar import PillarMax

    g = torch.Generator().manual_seed(0)
    flat = torch.randint(0, 40, (500,), generator=g)
    x = (torch.randn(500, 6, generator=g) * 2).round().requires_grad_()
    grad = torch.randn(64, 6, generator=g)
    ours = PillarMax.apply(x, flat, 64)
    (gx,) = torch.autograd.grad(ours, x, grad)
    ref = torch.full((64, 6), -1e9).scatter_reduce(0, flat[:, None].expand(-1, 6), x, "amax", include_self=False)
    (want,) = torch.autograd.grad(ref, x, grad)
    used = torch.zeros(64, dtype=torch.bool)
    used[flat] = True
    torch.testing.assert_close(ours[used], ref[used])
    assert ours[~used].abs().sum() == 0
    torch.testing.assert_close(gx, want)
    assert ((x == ours[flat]).sum(0) > 40).all()  # many points at their pillar's max: ties are exercised
    xd = torch.randn(30, 3, dtype=torch.float64, generator=g).requires_grad_()
    assert torch.autograd.gradcheck(lambda v: PillarMax.apply(v, flat[:30] % 7, 8), (xd,))
