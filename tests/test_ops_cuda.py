"""bev.ops on a CUDA device: the same checks as test_ops.py plus stream, sync and 64-bit cases,
and the GPU's results against the CPU emulation of the same kernels (the `emu` fixture).

Skipped without a GPU. On a GPU machine, `make gpu-check` (scripts/gpu_check.sh) builds for the
device and runs these; by hand: build in place first, e.g.
  TORCH_CUDA_ARCH_LIST=9.0 python setup.py build_ext --inplace && pytest -m cuda tests/test_ops_cuda.py
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

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
requires_native_cuda = pytest.mark.skipif(not ops.native_available("cuda"), reason="native CUDA kernels not built")
DEVICE = "cuda"


def test_native_cuda_kernels_are_built():
    # On a GPU machine the build must include the CUDA kernels; otherwise "auto" silently
    # falls back to the (slow) reference.
    assert ops.native_available("cuda"), ops._native.LOAD_ERROR or "extension built without CUDA"


@pytest.mark.parametrize("backend", backends_for(DEVICE))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", VOXEL_CASES, ids=str)
def test_voxel_sum_matches_index_add(backend, dtype, case):
    N, C, grid = VOXEL_CASES[case]
    gen = torch.Generator().manual_seed(N * C)
    coords = random_coords(N, grid, gen)
    feats = torch.randn(N, C, generator=gen, dtype=torch.float64).to(dtype)
    feats_cuda = feats.to(DEVICE).requires_grad_()
    out = ops.voxel_sum(feats_cuda, coords.to(DEVICE), grid, backend=backend)
    assert out.device.type == "cuda" and out.is_contiguous()
    assert_matches(out.cpu(), index_add_voxel_sum(feats, coords, grid), dtype)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
    out.backward(grad_out.to(DEVICE))
    expected = feats.to(torch.float64).requires_grad_()
    index_add_voxel_sum(expected, coords, grid).backward(grad_out.to(torch.float64))
    assert torch.equal(feats_cuda.grad.cpu().to(torch.float64), expected.grad)


@pytest.mark.parametrize("backend", backends_for(DEVICE))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", FRUSTUM_CASES, ids=str)
def test_bev_pool_matches_index_add(backend, dtype, case):
    (B, Nc, D, H, W, C), grid = FRUSTUM_CASES[case]
    gen = torch.Generator().manual_seed(B * Nc * D * C)
    depth, feats, coords = random_frustum(B, Nc, D, H, W, C, grid, dtype, gen)
    d, f = depth.to(DEVICE).requires_grad_(), feats.to(DEVICE).requires_grad_()
    out = ops.bev_pool(d, f, coords.to(DEVICE), grid, backend=backend)
    loose = backend != "native"  # the references round each depth x feature product to dtype (as test_ops)
    assert_matches(out.cpu(), index_add_bev_pool(depth, feats, coords, grid), dtype, loose)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
    out.backward(grad_out.to(DEVICE))
    d64, f64 = depth.double().requires_grad_(), feats.double().requires_grad_()
    index_add_bev_pool(d64, f64, coords, grid).backward(grad_out.double())
    assert_matches(d.grad.cpu(), d64.grad, dtype, loose)
    assert_matches(f.grad.cpu(), f64.grad, dtype, loose)


@pytest.mark.parametrize("backend", backends_for(DEVICE))
def test_adversarial_cases(backend):
    grid = (2, 3, 4, 5)
    cases = {
        "empty": torch.zeros(0, 4, dtype=torch.long),
        "all-outside": torch.tensor([[-1, 0, 0, 0], [2, 0, 0, 0], [0, 3, 0, 0], [0, 0, -4, 0], [0, 0, 0, 5]] * 7),
        "one-voxel": torch.tensor([[1, 2, 3, 4]]).repeat(5000, 1),
        "huge-coords": torch.tensor([[0, 0, 2**40, 0], [0, -(2**62), 0, 0], [2**62, 1, 1, 1], [1, 1, 1, 1]]),
    }
    for name, coords in cases.items():
        feats = torch.randn(coords.shape[0], 40, dtype=torch.float64)
        f = feats.to(DEVICE).requires_grad_()
        out = ops.voxel_sum(f, coords.to(DEVICE), grid, backend=backend)
        torch.testing.assert_close(out.cpu(), index_add_voxel_sum(feats, coords, grid), msg=name)
        out.sum().backward()
        inside = ((coords >= 0) & (coords < torch.tensor(grid))).all(1)
        assert torch.equal(f.grad.cpu(), inside[:, None].double().expand_as(feats)), name


@pytest.mark.parametrize("backend", backends_for(DEVICE))
def test_gradcheck_float64(backend):
    gen = torch.Generator().manual_seed(6)
    grid = (2, 2, 3, 3)
    coords = random_coords(40, grid, gen, device=DEVICE)
    feats = torch.randn(40, 3, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: ops.voxel_sum(x, coords, grid, backend=backend), (feats,))
    depth, feats, coords = random_frustum(2, 2, 3, 2, 2, 35, grid, torch.float64, gen, device=DEVICE)
    depth.requires_grad_(), feats.requires_grad_()
    assert torch.autograd.gradcheck(lambda d, f: ops.bev_pool(d, f, coords, grid, backend=backend), (depth, feats))


@requires_native_cuda
@pytest.mark.parametrize(
    "op_name", ["_sort_keys", "voxel_sum", "_voxel_sum_backward", "bev_pool", "_bev_pool_backward"]
)
def test_opcheck(op_name):
    torch.library.opcheck(getattr(torch.ops.bev, op_name).default, opcheck_inputs(DEVICE)[op_name])


@requires_native_cuda
def test_module_runs_under_torch_compile_fullgraph(fresh_compile_caches):
    grid = (2, 1, 8, 8)
    depth, feats, coords = random_frustum(2, 3, 5, 4, 6, 16, grid, device=DEVICE)
    assert_compiled_matches_eager(SplatModule(grid, 16).to(DEVICE), depth, feats, coords)


def _lss_like_problem(dtype=torch.float32):
    grid = (2, 1, 64, 64)
    gen = torch.Generator().manual_seed(11)
    return (*random_frustum(2, 6, 41, 8, 22, 64, grid, dtype, gen, margin=3, device=DEVICE), grid)


@requires_native_cuda
def test_cuda_matches_cpu_and_is_bitwise_deterministic():
    depth, feats, coords, grid = _lss_like_problem()
    grad_out = torch.randn(2, 64, 1, 64, 64, device=DEVICE)

    def run(device):
        # copy=True: depth/feats live on the GPU already, and must stay leaves without grad for the next run
        d = depth.to(device, copy=True).requires_grad_()
        f = feats.to(device, copy=True).requires_grad_()
        out = ops.bev_pool(d, f, coords.to(device), grid, backend="native")
        out.backward(grad_out.to(device))
        return [t.cpu() for t in (out, d.grad, f.grad)]

    first, second, cpu = run(DEVICE), run(DEVICE), run("cpu")
    for a, b, c in zip(first, second, cpu):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-4)


@requires_native_cuda
def test_no_host_device_sync_in_the_hot_path():
    depth, feats, coords, grid = _lss_like_problem()
    depth.requires_grad_(), feats.requires_grad_()
    ops.bev_pool(depth, feats, coords, grid).sum().backward()  # warm up lazy init outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = ops.bev_pool_plan(coords, grid)
        out = ops.bev_pool(depth, feats, plan=plan)
        out.backward(torch.ones_like(out))
        points = torch.randn(coords[..., 0].numel(), 8, device=DEVICE, requires_grad=True)
        flat = torch.cat([torch.zeros_like(coords[..., :1]), coords], -1).reshape(-1, 4)
        ops.voxel_sum(points, flat, grid).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@requires_native_cuda
def test_runs_on_the_current_stream():
    depth, feats, coords, grid = _lss_like_problem()
    expected = ops.bev_pool(depth, feats, coords, grid)
    grad_out = torch.randn_like(expected)
    depth.requires_grad_()
    ops.bev_pool(depth, feats, coords, grid).backward(grad_out)
    expected_grad = depth.grad
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # The inputs only become valid on the side stream after a long sleep: a kernel launched
        # on any other stream would read them too early.
        torch.cuda._sleep(50_000_000)
        late_depth = (depth.detach() * 1).requires_grad_()
        late_feats = feats * 1
        out = ops.bev_pool(late_depth, late_feats, coords, grid)
        out.backward(grad_out)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, expected)
    assert torch.equal(late_depth.grad, expected_grad)


@requires_native_cuda
@pytest.mark.slow
def test_outputs_beyond_int32_elements():
    # B*C*Z*X*Y > 2**31 (about 4.3 GB in fp16): offsets and output indices must be 64-bit.
    grid = (1, 1, 2048, 2048)
    C = 520
    if torch.cuda.mem_get_info()[0] < 16 * 2**30:
        pytest.skip("needs 16 GB of free GPU memory")
    coords = torch.tensor([[0, 0, 2047, 2047], [0, 0, 2047, 2047], [0, 0, 0, 0], [0, 0, 1024, 5]], device=DEVICE)
    feats = torch.arange(4 * C, dtype=torch.float16, device=DEVICE).view(4, C).div(64).requires_grad_()
    out = ops.voxel_sum(feats, coords, grid, backend="native")
    assert out.numel() > 2**31
    torch.testing.assert_close(out[0, :, 0, 2047, 2047], feats[0] + feats[1])
    torch.testing.assert_close(out[0, :, 0, 1024, 5], feats[3])
    assert out.float().sum().item() == pytest.approx(feats.float().sum().item(), rel=1e-3)
    grad = torch.zeros_like(out)
    grad[0, -1, 0, 2047, 2047] = 3
    out.backward(grad)
    assert feats.grad[:2, -1].tolist() == [3, 3] and feats.grad.float().sum().item() == 6


@requires_native_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_matches_the_emulation_of_its_kernels(emu, dtype):
    # Same kernels, same summation order: voxel_sum's forward (adds only) and its backward (a
    # gather) are bitwise equal; bev_pool's products may be fused (FMA) on the GPU only.
    gen = torch.Generator().manual_seed(12)
    grid = (2, 2, 5, 7)
    coords = random_coords(900, grid, gen)
    feats = torch.randn(900, 33, generator=gen, dtype=torch.float64).to(dtype)
    grad_out = torch.randn(2, 33, 2, 5, 7, generator=gen, dtype=torch.float64).to(dtype)
    emulated = emulated_voxel_sum(emu, feats, coords, grid, grad_out)
    f = feats.to(DEVICE).requires_grad_()
    out = ops.voxel_sum(f, coords.to(DEVICE), grid, backend="native")
    out.backward(grad_out.to(DEVICE))
    assert torch.equal(out.cpu(), emulated[0]) and torch.equal(f.grad.cpu(), emulated[1])

    depth, feats, coords = random_frustum(2, 3, 4, 3, 5, 33, grid, dtype, gen)
    grad_out = torch.randn(2, 33, 2, 5, 7, generator=gen, dtype=torch.float64).to(dtype)
    emulated = emulated_bev_pool(emu, depth, feats, coords, grid, grad_out)
    d, f = depth.to(DEVICE).requires_grad_(), feats.to(DEVICE).requires_grad_()
    out = ops.bev_pool(d, f, coords.to(DEVICE), grid, backend="native")
    out.backward(grad_out.to(DEVICE))
    for got, want in zip((out, d.grad, f.grad), emulated):
        assert_matches(got.cpu(), want.to(torch.float64), dtype)


@requires_native_cuda
def test_a_native_cuda_check_raises_instead_of_crashing():
    # Failed on the H200 image of 2026-11-26 (SIGSEGV in the throw; benchmarks/results/gpu_nvidia_h200.md).
    r = native_check_in_subprocess("cuda")
    assert r.returncode == 0 and "RuntimeError: feats must be (N, C)" in r.stdout, (
        r.returncode,
        r.stdout,
        r.stderr[-2000:],
    )
