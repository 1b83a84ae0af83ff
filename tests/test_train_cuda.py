"""The training step on a CUDA device never waits for the host.

Skipped without a GPU; `make gpu-check` (scripts/gpu_check.sh) runs these with test_ops_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

import bev.ops as ops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not ops.native_available("cuda"), reason="native CUDA kernels not built"),
]


@pytest.fixture
def embedded():
    """The embedded experiment's config (composing it needs hydra-core: gpu_check.sh carries .whl/)."""
    pytest.importorskip("hydra", reason="composing the configs needs hydra-core (gpu_check.sh: carry .whl/)")
    from helpers.train_step import compose_train

    return compose_train(["experiment=synthetic_cpu"])


@pytest.mark.parametrize("channels_last, bf16", [(False, False), (True, True)], ids=["fp32", "channels_last+bf16"])
def test_training_step_never_synchronises(embedded, channels_last, bf16):
    from helpers.train_step import TrainStep

    step = TrainStep(embedded, "cuda", channels_last=channels_last, bf16=bf16)
    step()  # lazy set-up: cuDNN handles, the optimiser's state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()


@pytest.mark.parametrize("compile", [False, "default"], ids=["eager", "compiled"])
def test_the_detection_step_never_synchronises(compile):
    """The multi-task step (segmentation + the CenterPoint head's focal and L1 losses) in bf16."""
    pytest.importorskip("hydra", reason="composing the configs needs hydra-core (gpu_check.sh: carry .whl/)")
    from helpers.train_step import TrainStep, compose_train

    step = TrainStep(
        compose_train(["experiment=synthetic_det_cpu"]), "cuda", channels_last=True, bf16=True, compile=compile
    )
    for _ in range(2):  # compilation, cuDNN handles, the optimiser's state
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()
