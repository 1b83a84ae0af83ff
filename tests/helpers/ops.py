"""The shared ground of the bev.ops tests (CPU, CUDA, emulated CUDA, fuzz): an independent float64
index_add_ reference that shares no code with bev.ops, seeded input generators, dtype tolerances, the
case tables every device runs, and the opcheck / torch.compile scaffolding."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bev import ops


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
    # Points outside the grid are ignored: no value, and a zero gradient even where the other
    # factor is inf or NaN (where() selects in its backward, never multiplies).
    inside = ((coords.long() >= 0) & (coords.long() < torch.tensor(grid_shape[1:], device=coords.device))).all(-1)
    depth = torch.where(inside, depth.to(torch.float64), 0)
    points, flat_coords = frustum_to_points(depth, feats.to(torch.float64), coords)
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
    torch.float64: {"rtol": 1e-10, "atol": 1e-10},
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
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
    native_mark = pytest.mark.skipif(not ops.native_available(device), reason=f"native kernels not built for {device}")
    return ["torch", "quickcumsum", pytest.param("native", marks=native_mark)]


DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# The cases every device runs (the emulated kernels add their own around a warp's width).
VOXEL_CASES = {
    # name: (N, C, grid_shape)
    "single-batch-flat": (300, 5, (1, 1, 6, 7)),
    "batched-3d": (700, 9, (3, 4, 5, 6)),
    "one-channel": (400, 1, (2, 2, 5, 5)),
    "wide-257": (200, 257, (2, 1, 4, 3)),
}
FRUSTUM_CASES = {
    # name: ((B, Nc, D, H, W, C), grid_shape)
    "small": ((1, 2, 4, 3, 5, 6), (1, 1, 5, 4)),
    "batched-3d": ((2, 3, 5, 2, 4, 7), (2, 3, 4, 4)),
    "one-channel": ((2, 1, 6, 3, 3, 1), (2, 2, 3, 3)),
    "wide-257": ((1, 2, 3, 2, 3, 257), (1, 1, 3, 3)),
}


def opcheck_inputs(device="cpu", dtype=torch.float32) -> dict:
    """Arguments of each torch.ops.bev op for torch.library.opcheck: a small frustum and its native plan."""
    gen = torch.Generator().manual_seed(7)
    grid = [2, 2, 3, 4]
    depth, feats, coords = random_frustum(2, 2, 3, 2, 3, 5, grid, dtype, gen, device=device)
    plan = ops.bev_pool_plan(coords, grid, backend="native")
    points = torch.randn(plan.keys.numel(), 5, generator=gen).to(device=device, dtype=dtype)
    grad_out = torch.randn(2, 5, 2, 3, 4, generator=gen).to(device=device, dtype=dtype)
    return {
        "_voxel_keys": (coords, grid, False),
        "_sort_keys": (plan.keys, 2 * 2 * 3 * 4),
        "voxel_sum": (points.requires_grad_(), plan.keys, plan.order, plan.offsets, grid),
        "_voxel_sum_backward": (grad_out, plan.keys, plan.order, plan.offsets),
        "bev_pool": (depth.requires_grad_(), feats.requires_grad_(), plan.keys, plan.order, plan.offsets, grid),
        "_bev_pool_backward": (grad_out, depth.detach(), feats.detach(), plan.keys, plan.offsets),
    }


class SplatModule(torch.nn.Module):
    """What the model does: softmax depth, fused lift-splat, a conv on the BEV grid."""

    def __init__(self, grid_shape, channels):
        super().__init__()
        self.grid_shape = grid_shape
        self.conv = torch.nn.Conv2d(channels * grid_shape[1], 2, 1)

    def forward(self, depth_logits, feats, coords):
        bev = ops.bev_pool(depth_logits.softmax(dim=2), feats, coords, self.grid_shape)
        B, C, Z, X, Y = bev.shape
        return self.conv(bev.reshape(B, C * Z, X, Y))


def assert_compiled_matches_eager(model, depth, feats, coords):
    """torch.compile(fullgraph=True) of model: same output and input gradients as eager."""
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    inputs = [depth.clone().requires_grad_(), feats.clone().requires_grad_()]
    out = compiled(*inputs, coords)
    out.square().sum().backward()
    eager_inputs = [depth.clone().requires_grad_(), feats.clone().requires_grad_()]
    expected = model(*eager_inputs, coords)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    for got, want in zip(inputs, eager_inputs):
        torch.testing.assert_close(got.grad, want.grad)


def native_check_in_subprocess(device: str) -> subprocess.CompletedProcess:
    """Call the native voxel_sum past the Python checks with 1-D feats (a TORCH_CHECK), in a fresh process."""
    code = (
        "import torch, bev.ops\n"
        f"z = lambda *s, **k: torch.zeros(*s, device='{device}', **k)\n"
        "try:\n"
        "    torch.ops.bev.voxel_sum(z(3), z(3, dtype=torch.long), z(3, dtype=torch.long), z(2, dtype=torch.long), [1, 1, 1, 1])\n"
        "except RuntimeError as e:\n"
        "    print('RuntimeError:', str(e).splitlines()[0])\n"
    )
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
