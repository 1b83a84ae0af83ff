"""Speed settings: precision "auto", channels_last encoders, fused optimisers; bev-train records them."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from bev.models import BevDecoder, CameraEncoder
from bev.tasks.segmentation.head import SegmentationHead
from bev.utils import precision as P
from bev.utils.speed import fused_default


# ----------------------------------------------------------------------------- precision
@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"avx2", "avx512f", "avx512_bf16"}, ("bf16-mixed", "AVX512-BF16")),
        ({"avx512_bf16", "amx_bf16", "amx_tile"}, ("bf16-mixed", "AMX-BF16")),
        ({"fp", "asimd", "bf16"}, ("bf16-mixed", "Arm BF16")),
        ({"avx", "avx2", "fma"}, ("32-true", "no native bf16")),
        (set(), ("32-true", "no native bf16")),
    ],
)
def test_auto_precision_on_cpu(flags, expected, monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(P, "_cpu_flags", lambda: flags)
    precision, reason = P.resolve_precision("auto", "cpu")
    assert precision == expected[0] and expected[1] in reason


@pytest.mark.parametrize(
    "isa, expected",
    [("AVX2", "32-true"), ("avx512_core", "32-true"), ("AVX512_CORE_BF16", "bf16-mixed"), ("", "bf16-mixed")],
)
def test_a_onednn_isa_cap_below_bf16_is_a_cpu_without_it(isa, expected, monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 on a bf16 CPU runs oneDNN as on an AVX2 CPU: auto gives what that CPU gets."""
    monkeypatch.setattr(P, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    precision, reason = P.resolve_precision("auto", "cpu")
    assert precision == expected and ("ONEDNN_MAX_CPU_ISA=" in reason) == (expected == "32-true")
    depthwise = torch.nn.Conv2d(16, 16, 3, groups=16)  # NHWC in fp32 for dense convolutions alone
    assert P.resolve_channels_last("auto", depthwise) == (expected == "bf16-mixed")


@pytest.mark.parametrize("bf16, expected", [(True, "bf16-mixed"), (False, "16-mixed")])
def test_auto_precision_on_gpu(bf16, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some GPU")
    assert P.resolve_precision("auto", "gpu")[0] == expected
    assert P.resolve_precision("auto", "auto")[0] == expected


def test_explicit_precision_is_kept(monkeypatch):
    monkeypatch.setattr(P, "_cpu_flags", lambda: {"avx512_bf16"})
    assert P.resolve_precision("32-true", "cpu") == ("32-true", "as configured")
    assert P.resolve_precision("bf16-mixed", "cpu")[0] == "bf16-mixed"


def test_cpu_flags_are_read_from_proc_cpuinfo(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu avx2 avx512_bf16\n"
    )
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(info if p == "/proc/cpuinfo" else p, *a, **k))
    assert P._cpu_flags() == {"fpu", "avx2", "avx512_bf16"}
    assert P.cpu_bf16_support() == "AVX512-BF16"


# ----------------------------------------------------------------------------- channels_last
@pytest.mark.parametrize(
    "flags, cuda, expected",
    [
        ({"avx512_bf16"}, False, True),
        ({"amx_bf16"}, False, True),
        ({"avx2"}, False, False),
        (set(), True, True),
    ],
)
def test_auto_channels_last_follows_the_hardware(flags, cuda, expected, monkeypatch):
    """auto: NHWC on GPUs and native-bf16 CPUs; on CPUs that train in fp32 only for dense convolutions (the small
    trunks, the BEV decoder), not for depthwise ones (EfficientNet's)."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(P, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert P.resolve_channels_last("auto") is expected
    assert P.resolve_channels_last(False) is False and P.resolve_channels_last(True) is True
    dense = [
        BevDecoder(8, widths=(16, 16, 32), blocks=1, channels_last="auto"),
        CameraEncoder(5, 7, backbone="small", widths=(16, 32, 48, 64, 96), mid_channels=16, channels_last="auto"),
    ]
    for enc in dense:
        assert enc.channels_last is True
        assert next(enc.parameters()).is_contiguous(memory_format=torch.channels_last)
    depthwise = torch.nn.Sequential(torch.nn.Conv2d(16, 16, 3, groups=16), torch.nn.Conv2d(16, 32, 1))
    assert P.resolve_channels_last("auto", depthwise) is expected
    with pytest.raises(ValueError, match="true, false or auto"):
        P.resolve_channels_last("yes")


@pytest.mark.filterwarnings("error")  # no hazard warning for the models that are fine
def test_auto_channels_last_keeps_nchw_for_narrow_strided_1x1_convolutions(monkeypatch):
    # oneDNN's NHWC weight gradient of a 1x1 stride-2 convolution with < 16 input channels crashes
    # or is wrong on x86 CPUs (uxlfoundation/oneDNN#6035): such encoders keep NCHW under "auto".
    monkeypatch.setattr(P, "_cpu_flags", lambda: {"avx512_bf16"})
    assert BevDecoder(8, widths=(16, 16, 32), blocks=1, channels_last="auto").channels_last is True
    assert CameraEncoder(
        5, 7, backbone="small", widths=(16, 32, 48, 64, 96), mid_channels=16, channels_last="auto"
    ).channels_last
    with pytest.warns(UserWarning, match="keeps NCHW.*oneDNN#6035") as record:
        narrow = CameraEncoder(5, 7, backbone="small", widths=(8, 8, 16, 16, 16), mid_channels=16, channels_last="auto")
    assert narrow.channels_last is False and not narrow.trunk.stem[0].weight.is_contiguous(
        memory_format=torch.channels_last
    )
    assert "trunk." in str(record[0].message)  # names the layer
    assert P.nhwc_hazards(BevDecoder(8, widths=(8, 8, 16), blocks=1)) == [
        "layer2.0.downsample.0",
        "layer3.0.downsample.0",
    ]
    with pytest.warns(
        UserWarning, match="channels_last=true as configured"
    ):  # an explicit choice is kept, with the warning
        assert BevDecoder(8, widths=(8, 8, 16), blocks=1, channels_last=True).channels_last is True


def test_channels_last_encoders_compute_the_same_function():
    torch.manual_seed(0)
    images, bev = torch.randn(2, 3, 64, 96), torch.randn(1, 8, 24, 24)
    outs = {}
    for cl in (False, True):
        torch.manual_seed(1)
        cam = CameraEncoder(5, 7, backbone="small", widths=(8, 8, 16, 16, 16), mid_channels=16, channels_last=cl).eval()
        torch.manual_seed(2)
        enc = BevDecoder(8, widths=(8, 8, 16), blocks=1, channels_last=cl).eval()
        head = SegmentationHead(enc.out_channels, 2).eval()
        outs[cl] = (cam(images), head(enc(bev)["shared"]))
        if cl:
            assert cam.head.weight.is_contiguous(memory_format=torch.channels_last)
    for a, b in zip(outs[False], outs[True]):
        assert b.is_contiguous()  # callers see the default layout
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # Same parameter names and shapes: checkpoints load either way.
    sd = {k: v.shape for k, v in CameraEncoder(5, 7, backbone="small", channels_last=True).state_dict().items()}
    assert sd == {k: v.shape for k, v in CameraEncoder(5, 7, backbone="small").state_dict().items()}


# ----------------------------------------------------------------------------- optimiser
@pytest.mark.parametrize(
    "factory, device, expected",
    [
        (partial(torch.optim.Adam, lr=1e-3), "cuda", {"fused": True}),
        (partial(torch.optim.AdamW, lr=1e-3, weight_decay=1e-2), "cuda", {"fused": True}),
        (partial(torch.optim.Adam, lr=1e-3), "cpu", {}),  # CPU runs stay as measured (fused: 1.00-1.04x there)
        (partial(torch.optim.Adam, lr=1e-3, fused=False), "cuda", {}),  # the config's choice wins
        (partial(torch.optim.Adam, lr=1e-3, foreach=True), "cuda", {}),
        (partial(torch.optim.LBFGS, lr=1.0), "cuda", {}),  # no fused kernel
        (partial(torch.optim.Adagrad, lr=0.1), "cuda", {}),  # its fused kernel is CPU-only
        (lambda params: torch.optim.SGD(params, lr=0.1), "cuda", {}),  # not a class: its keywords are unknown
    ],
)
def test_optimizers_on_cuda_are_fused_unless_configured(factory, device, expected):
    assert fused_default(factory, device) == expected
    assert fused_default(factory, device, "bf16-mixed") == expected
    assert fused_default(factory, device, "16-mixed") == {}  # fp16's scaled gradients could not be clipped


def test_configure_optimizers_builds_the_configured_optimizer_on_cpu():
    from bev.lit import BEVLitModule
    from helpers.models import stand_in_net

    net = stand_in_net(3, 1, kernel=3)
    opt = BEVLitModule(
        net,
        optimizer=partial(torch.optim.Adam, lr=2e-3),
        segmentation=dict(object_classes=["vehicle"]),
    ).configure_optimizers()
    assert isinstance(opt, torch.optim.Adam) and opt.param_groups[0]["lr"] == 2e-3
    assert not opt.param_groups[0]["fused"] and len(opt.param_groups[0]["params"]) == 2


@pytest.mark.e2e
def test_bev_train_records_precision_and_the_time_budget(synthetic_root, tmp_path, monkeypatch, capsys):
    import json

    from helpers.cli import TINY, train_cli

    args = [
        *TINY,
        "trainer.max_epochs=3",
        "callbacks.time_budget.budget=0.001",
        "callbacks.bev_png.every_n_steps=0",
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={tmp_path}",
    ]
    assert train_cli(args, monkeypatch) == 0
    rec = json.loads((tmp_path / "metrics.json").read_text())
    assert rec["precision"] in ("32-true", "bf16-mixed")  # "auto", resolved for this CPU
    assert f"precision: {rec['precision']}" in capsys.readouterr().out
    tb = rec["time_budget"]
    assert tb["budget_s"] == 0.001 and tb["planned_steps"] == 3 and tb["stopped_on_budget"]
    assert rec["global_step"] == 1 and "spent at step 1 of 3" in tb["message"]


@pytest.mark.e2e
def test_bev_train_past_its_deadline_trains_no_step(synthetic_root, tmp_path, monkeypatch):
    # The trainer configs allow stopping inside the first epoch (min_epochs 0): nothing is trained.
    import json

    from helpers.cli import TINY, train_cli

    args = [
        *TINY,
        "trainer.max_epochs=3",
        "callbacks.time_budget.deadline=1700000000",  # 2023
        "callbacks.bev_png.every_n_steps=0",
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={tmp_path}",
    ]
    assert train_cli(args, monkeypatch) == 0
    rec = json.loads((tmp_path / "metrics.json").read_text())
    assert rec["global_step"] == 0 and "passed before training started" in rec["time_budget"]["message"]


@pytest.mark.parametrize(
    "flags, cuda, expected",
    [({"avx2"}, False, "fp32_cpu"), ({"avx2", "avx512_bf16"}, False, "other"), ({"avx2"}, True, "other")],
)
def test_on_fp32_cpu_follows_the_machine(flags, cuda, expected, monkeypatch):
    """${bev.on_fp32_cpu:a,b}: a where training runs in fp32 on the CPU (no GPU, no native bf16), else b."""
    from omegaconf import OmegaConf

    from bev.utils.config import on_fp32_cpu

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(P, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert on_fp32_cpu("fp32_cpu", "other") == expected
    cfg = OmegaConf.create({"k": "${bev.on_fp32_cpu:3,7}"})
    assert cfg.k == (3 if expected == "fp32_cpu" else 7)


@pytest.mark.parametrize("flags, cheap", [({"avx2"}, True), ({"avx2", "avx512_bf16"}, False), ({"amx_bf16"}, False)])
def test_the_embedded_decoder_each_kind_of_cpu_gets(flags, cheap, monkeypatch):
    """make train's model on a CPU that trains in fp32: the 3x3 stem and half-resolution tail; elsewhere LSS's."""
    from hydra import compose, initialize_config_dir

    from bev.train import CONFIG_DIR

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(P, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["experiment=synthetic_cpu"])
    decoder = cfg.model.net.decoder
    assert (decoder.stem_kernel, decoder.half_res_tail) == ((3, True) if cheap else (7, False))
    assert P.resolve_precision(cfg.trainer.precision, "cpu")[0] == ("32-true" if cheap else "bf16-mixed")
    from hydra.utils import instantiate

    net = instantiate(cfg.model).net  # its dense trunks in NHWC on every kind of CPU
    assert net.camera.encoder.channels_last and net.decoder.channels_last
