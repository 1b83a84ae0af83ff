"""The CUDA kernels of bev.ops built for the CPU under a SIMT emulation (tests/cuda_emulation), and
calls of its ops with the plans bev.ops would build. Used by test_ops_cuda_emulated.py and, to compare
a GPU with the emulation of its own kernels, by test_ops_cuda.py (through the `emu` fixture)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from bev.ops._plan import flat_keys, make_plan

REPO = Path(__file__).resolve().parents[2]
EMULATION = REPO / "tests" / "cuda_emulation"
CSRC = REPO / "bev" / "ops" / "csrc"
SOURCES = [EMULATION / "emu_ops.cpp"]
HEADERS = [
    EMULATION / "simt.h",
    CSRC / "common.h",
    CSRC / "cuda" / "pool_kernels.cuh",
    CSRC / "cuda" / "pool_launchers.h",
]


def _build_dir(config, name: str) -> Path:
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    if cache is not None:
        return cache.mkdir(name)
    path = Path(tempfile.gettempdir()) / name
    path.mkdir(exist_ok=True)
    return path


class Emulation:
    """torch.ops.bev_simt with the launch geometry as dicts."""

    def __init__(self):
        self.ops = torch.ops.bev_simt

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def forward_launch(self, B, S, C, dtype):
        return _launch(self.ops.forward_launch(B, S, C, dtype))

    def rows_launch(self, rows):
        return _launch(self.ops.rows_launch(rows))

    def kernel_sizes(self):
        return dict(zip(("warp", "tile_voxels", "tile_channels", "rows_per_block"), self.ops.kernel_sizes()))


def _launch(values):
    gx, gy, bx, by, tiles, shared, fits = values
    return {
        "grid": (gx, gy, 1),
        "block": (bx, by, 1),
        "tiles_per_batch": tiles,
        "shared_bytes": shared,
        "fits_one_launch": bool(fits),
    }


def load_emulation(config):
    """The emulated ops, built from the source tree as it stands (cached by content hash)."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) to build the CUDA emulation")
    from torch.utils.cpp_extension import load

    digest = hashlib.sha256(torch.__version__.encode())
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    name = f"bev_simt_{digest.hexdigest()[:16]}"
    if not hasattr(torch.ops.bev_simt, "voxel_sum"):  # one library per process: its ops are global
        load(
            name=name,
            sources=[str(p) for p in SOURCES],
            extra_include_paths=[str(EMULATION), str(CSRC)],
            extra_cflags=["-O0"],  # the build costs more than the emulated tests gain from optimising
            build_directory=str(_build_dir(config, name)),
            is_python_module=False,
            verbose=False,
        )
    return Emulation()


def voxel_plan(coords, grid, n):
    return make_plan(flat_keys(coords[:, 0], coords[:, 1:], grid), grid, (n,), use_native=False)


def frustum_plan(coords, grid):
    B = coords.shape[0]
    batch = torch.arange(B).view(B, 1, 1, 1, 1)
    return make_plan(flat_keys(batch, coords, grid), grid, tuple(coords.shape[:5]), use_native=False)


def emulated_voxel_sum(emu, feats, coords, grid, grad_out):
    plan = voxel_plan(coords, grid, feats.shape[0])
    out = emu.voxel_sum(feats, plan.keys, plan.order, plan.offsets, list(grid))
    grad = emu.voxel_sum_backward(grad_out, plan.keys, plan.order, plan.offsets)
    return out, grad


def emulated_bev_pool(emu, depth, feats, coords, grid, grad_out):
    plan = frustum_plan(coords, grid)
    out = emu.bev_pool(depth, feats, plan.keys, plan.order, plan.offsets, list(grid))
    grad_depth, grad_feats = emu.bev_pool_backward(grad_out, depth, feats, plan.keys, plan.offsets)
    return out, grad_depth, grad_feats
