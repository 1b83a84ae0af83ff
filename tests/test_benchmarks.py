"""The training-step benchmarks run end to end on the embedded config (one step each: no timings checked)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


@pytest.fixture(autouse=True)
def _keep_threads():
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_bench_train_profiles_each_variant(tmp_path, capsys):
    import bench_train

    out = tmp_path / "train.json"
    assert (
        bench_train.main(
            [
                "--configs",
                "embedded",
                "--variants",
                "fp32",
                "--steps",
                "1",
                "--warmup",
                "1",
                "--no-loader",
                "--profile",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rec = json.loads(out.read_text())["configs"]["embedded"]["variants"]["fp32"]
    pr = rec["profile"]
    assert pr["steps"] == 1 and pr["wall_ms"] > 0 and pr["gpu_kernel_ms"] is None  # no GPU here
    assert pr["top_self_ms"] and all(ms >= 0 for ms in pr["top_self_ms"].values())
    assert "profiled:" in capsys.readouterr().out
    report = json.loads(out.read_text())
    config = report["configs"]["embedded"]
    assert rec["gflop_per_s"] == pytest.approx(config["gflop_per_step"] / rec["step_s"], rel=0.01)
    assert rec["of_matmul_rate"] == pytest.approx(
        rec["gflop_per_s"] / report["matmul_gflop_per_s"]["float32"], rel=0.01
    )


def test_step_flops_counts_forward_and_backward(monkeypatch):
    """A depthwise strided convolution, a dense one and a linear layer, counted by hand."""
    import bench_train
    import torch
    from torch import nn

    class Lit(nn.Module):
        def __init__(self):
            super().__init__()
            self.dw = nn.Conv2d(4, 4, 5, stride=2, padding=2, groups=4)  # (2, 4, 8, 8) -> (2, 4, 4, 4)
            self.conv = nn.Conv2d(4, 6, 3, padding=1)  # -> (2, 6, 4, 4)
            self.fc = nn.Linear(6 * 16, 3)

        def forward(self, batch):
            return self.fc(self.conv(self.dw(batch["x"])).flatten(1))

    monkeypatch.setattr(bench_train, "build", lambda cfg, channels_last: Lit())
    dw, conv, fc = 2 * (2 * 4 * 4 * 4) * 25, 2 * (2 * 6 * 4 * 4) * 4 * 9, 2 * (2 * 3) * 96
    # the images need no gradient: the first layer's backward is its weight gradient only
    assert bench_train.step_flops(None, {"x": torch.randn(2, 4, 8, 8)}) == 2 * dw + 3 * conv + 3 * fc


def test_layer_flops_forward_agrees_with_torch_flop_counter():
    """The forward count, where torch's counter is right, on the embedded model: an independent count."""
    import bench_train
    from torch.utils.flop_counter import FlopCounterMode

    cfg = bench_train.compose_config(bench_train.CONFIGS["embedded"])
    batch = bench_train.real_rig_batch(cfg, 1)
    lit = bench_train.build(cfg, channels_last=False)
    with FlopCounterMode(display=False) as counter:
        lit(batch)
    forward, step = bench_train.layer_flops(lit, batch)
    assert forward == pytest.approx(counter.get_total_flops(), rel=1e-3)  # its extra: the geometry's tiny bmm
    assert 2 * forward < step < 3 * forward  # the images' layer has no input gradient


def test_bench_optimizer_alternates_the_default_and_fused_steps(tmp_path):
    import bench_optimizer

    out = tmp_path / "opt.json"
    assert bench_optimizer.main(["--configs", "embedded", "--rounds", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["configs"]["embedded"]
    assert r["optimizer"] == "torch.optim.AdamW"
    v = r["variants"]["fp32"]
    assert len(v["steps_ms"]["default"]) == len(v["steps_ms"]["fused"]) == 2
    assert 0 <= v["fused_faster_rounds"] <= 2 and v["fused_speedup_median_of_rounds"] > 0


def test_cuda_graph_variants_are_only_a_default_on_a_gpu():
    import bench_train

    cpu = bench_train.variants_to_run(bench_train.parse_args(["--device", "cpu", "--configs", "embedded"]))
    gpu = bench_train.variants_to_run(bench_train.parse_args(["--device", "cuda", "--configs", "embedded"]))
    assert "cudagraphs+channels_last+bf16" not in cpu["embedded"] and "cudagraphs+channels_last+bf16" in gpu["embedded"]
    eager = bench_train.variants_to_run(bench_train.parse_args(["--device", "cuda", "--no-compile"]))
    assert all(bench_train.VARIANTS[v][2] is None for vs in eager.values() for v in vs)


def test_bench_fast_layers_times_each_replaced_layer(tmp_path):
    import bench_fast_layers

    out = tmp_path / "layers.json"
    assert bench_fast_layers.main(["--batch-size", "1", "--rounds", "1", "--steps", "0", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["layers"]
    kinds = {r["kind"] for r in rows}
    assert "squeeze-excitation" in kinds and "depthwise 5x5 stride 2" in kinds and "depthwise 3x3 stride 1" not in kinds
    assert all(r["input"][0] == 6 and r["plain_ms"] > 0 and r["fast_ms"] > 0 for r in rows)  # 1 sample x 6 cameras


def test_plain_layers_undoes_the_fast_layers():
    import bench_fast_layers
    import torch

    from bev.models import CameraEncoder
    from bev.models.fast_layers import FP32GradDepthwiseConv2d, GlobalAvgPool

    enc = CameraEncoder(5, 7, backbone="efficientnet_b0", mid_channels=16, depthwise_fp32=True)
    keys = enc.state_dict().keys()
    assert any(isinstance(m, (FP32GradDepthwiseConv2d, GlobalAvgPool)) for m in enc.modules())
    bench_fast_layers.plain_layers(enc)
    assert not any(isinstance(m, (FP32GradDepthwiseConv2d, GlobalAvgPool)) for m in enc.modules())
    assert (
        sum(isinstance(m, torch.nn.AdaptiveAvgPool2d) for m in enc.modules()) == 16 and enc.state_dict().keys() == keys
    )


@pytest.mark.slow  # four paper-config models; bf16 steps are emulated (minutes) on CPUs without native bf16
def test_bench_fast_layers_alternates_training_steps_with_and_without(tmp_path):
    import bench_fast_layers

    out = tmp_path / "steps.json"
    assert bench_fast_layers.main(["--batch-size", "1", "--rounds", "1", "--steps", "1", "--out", str(out)]) == 0
    s = json.loads(out.read_text())["training_step"]
    assert set(s["step_s"]) == {"fp32 fast", "fp32 plain", "channels_last+bf16 fast", "channels_last+bf16 plain"}
    assert s["bf16_speedup_fast"] > 0 and s["fast_layers_speedup_fp32"] > 0


def test_bench_pool_user_level_reports_the_memory_traffic_floor(tmp_path):
    """The user-level section end to end (one round), in its own process: it tunes malloc process-wide."""
    import subprocess

    out = tmp_path / "pool.json"
    repo = Path(__file__).resolve().parents[1]
    cmd = [
        sys.executable,
        str(repo / "scripts" / "bench_pool.py"),
        "--device",
        "cpu",
        "--section",
        "user",
        "--rounds",
        "1",
        "--threads",
        "2",
        "--skip",
        "quickcumsum voxel_sum",
        "torch voxel_sum",
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    lss = json.loads(out.read_text())["user_level"]["malloc_tuned"]["lss"]
    floor = next(r for r in lss["rows"] if r["method"] == "memory traffic only (floor)")
    assert floor["fwd_bwd_ms"] > 0 and lss["ratios"]["index_add_ / memory traffic only (floor)"] > 0
    assert {"index_add_ / native voxel_sum", "index_add_ / native bev_pool"} <= set(lss["ratios"])


def test_every_script_imports():
    # Each script's imports (of the project and of the other scripts) resolve; one process for all.
    import subprocess

    scripts = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "scripts").glob("*.py"))
    code = (
        "import importlib.util, sys\n"
        "for path in sys.argv[1:]:\n"
        "    spec = importlib.util.spec_from_file_location('script_under_test', path)\n"
        "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, *scripts], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
