"""The training step on a CUDA device: it never waits for the host, and captured as one CUDA graph
(scripts/bench_train.py's graph variants) it trains as the eager step does.

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


def without_dropout(variant):
    """Dropout draws differ between eager steps and graph replays; these tests compare the two."""
    for m in variant.lit.modules():
        if hasattr(m, "p") and isinstance(m.p, float):
            m.p = 0.0
    return variant


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


def batch_loss(variant, batch) -> float:
    """The variant's loss on the batch now (train mode, no update)."""
    with torch.no_grad(), variant.autocast():
        return float(variant.lit.loss(variant.lit(batch), batch["bev"]))


def test_graphed_step_trains_as_the_eager_step(bench):
    bench_train, cfg, batch = bench
    eager = without_dropout(bench_train.Variant(cfg, "fp32", batch))
    graphed = without_dropout(bench_train.Variant(cfg, "graph", batch))
    start = batch_loss(eager, batch)
    assert batch_loss(graphed, batch) == pytest.approx(start, rel=1e-4)  # same initial weights
    steps = graphed.graph.warmup + 3  # warm-up steps, the capture (replayed once), two replays
    for _ in range(steps):
        eager.step()
        graphed.step()
    assert graphed.graph.captured and graphed.graph.replays == 2 and len(graphed.graph_losses) == 2
    after = batch_loss(eager, batch)
    assert after < start  # it trains
    assert batch_loss(graphed, batch) == pytest.approx(after, rel=1e-3)
    # The replays' recorded losses (before each update) fall too.
    assert float(graphed.graph_losses[1]) < float(graphed.graph_losses[0]) < start


@pytest.mark.parametrize("precision,rel", [("32-true", 2e-3), ("bf16-mixed", 3e-2)])
def test_bev_train_with_a_captured_step_trains_as_eager(precision, rel, synthetic_root, tmp_path, monkeypatch):
    """bev-train model.cuda_graph=true on the GPU (tiny model, 9 steps: 3 warm-up, the capture, 5 replays)
    against the same run eager: the same training losses, step by step."""
    pytest.importorskip("hydra", reason="bev-train needs hydra-core (gpu_check.sh: carry .whl/)")
    from test_cuda_graph import GRAPH_RUN, run_losses

    args = [*GRAPH_RUN, "trainer=gpu", f"trainer.precision={precision}", "callbacks.time_budget.budget=null"]
    eager, _ = run_losses(args, synthetic_root, tmp_path / "eager", monkeypatch)
    graphed, grec = run_losses([*args, "model.cuda_graph=true"], synthetic_root, tmp_path / "graph", monkeypatch)
    assert len(graphed) == len(eager) == grec["global_step"] == 9
    assert graphed == pytest.approx(eager, rel=rel)
