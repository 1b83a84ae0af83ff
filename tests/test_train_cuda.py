"""The training step on a CUDA device never waits for the host.

Skipped without a GPU; `make gpu-check` (scripts/gpu_check.sh) runs these with test_ops_cuda.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import bev.ops as ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not ops.native_available("cuda"), reason="native CUDA kernels not built"),
]


@pytest.fixture
def bench(monkeypatch):
    """bench_train on the GPU, its embedded config and a batch of 2 with the real rig."""
    pytest.importorskip("hydra", reason="composing the configs needs hydra-core (gpu_check.sh: carry .whl/)")
    import bench_train

    monkeypatch.setattr(bench_train, "DEVICE", "cuda")
    cfg = bench_train.compose_config(bench_train.CONFIGS["embedded"])
    batch = {k: v.cuda() for k, v in bench_train.real_rig_batch(cfg, 2).items()}
    return bench_train, cfg, batch


@pytest.mark.parametrize("name", ["fp32", "channels_last+bf16"])
def test_training_step_never_synchronises(bench, name):
    bench_train, cfg, batch = bench
    v = bench_train.Variant(cfg, name, batch)
    v.wait = False  # no clock inside the step waits for the GPU
    v.step()  # lazy set-up: cuDNN handles, the optimiser's state
    torch.cuda.set_sync_debug_mode("error")
    try:
        v.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
