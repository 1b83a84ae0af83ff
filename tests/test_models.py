"""Model: shapes, splat variants agree, gradients, pretrained-weight errors, torch.compile."""

import urllib.error

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bev import ops
from bev.models import BackboneWeightsError, BevDecoder, CameraEncoder
from helpers.models import GRID, SIZE, TINY_NET, lss_net, model_inputs, rig


def test_output_shape_and_gradients_reach_both_encoders():
    torch.manual_seed(0)
    net = lss_net(GRID, SIZE, **TINY_NET)
    out = net(*model_inputs())["segmentation"]
    assert out.shape == (2, 1, *GRID.bev_shape)
    out.square().mean().backward()
    for part in (net.camera, net.decoder, net.heads):
        grads = [p.grad for p in part.parameters() if p.grad is not None]
        assert grads and any(g.abs().sum() > 0 for g in grads)


def test_forward_is_the_heads_on_the_decoder_on_the_camera_branch():
    torch.manual_seed(0)
    net = lss_net(GRID, SIZE, **TINY_NET).eval()
    x = model_inputs()
    with torch.no_grad():
        out = net(*x)
        voxels, depth = net.camera(*x)
        feats = net.decoder(voxels)["shared"]
        assert torch.equal(net.heads["segmentation"](feats), out["segmentation"]) and torch.equal(depth, out["depth"])
    assert voxels.shape == (2, TINY_NET["context_channels"] * GRID.nz, *GRID.bev_shape)
    assert depth.shape == (2, 6, GRID.depth_bins, SIZE[0] // 16, SIZE[1] // 16)
    assert feats.shape == (2, net.decoder.out_channels, *GRID.bev_shape) and net.tasks == ("segmentation",)
    with pytest.raises(ValueError, match="images are 16x48 but the model was built for 32x96"):
        net(x[0][..., :16, :48], *x[1:])


def test_the_decoder_is_lss_bev_encode_before_its_last_conv():
    dec = BevDecoder(4, widths=(8, 8, 16), blocks=1).eval()
    assert dec.out_channels == 8 and not any(k.startswith("up2.3") for k in dec.state_dict())
    x = torch.randn(2, 4, 12, 10)
    with torch.no_grad():
        manual = dec.up1(dec.layer3(dec.layer2(dec.layer1(dec.stem(x)))), dec.layer1(dec.stem(x)))
        manual = dec.up2(torch.nn.functional.interpolate(manual, size=(12, 10), mode="bilinear", align_corners=True))
        assert torch.equal(dec(x)["shared"], manual) and list(dec(x)) == ["shared"]


def test_a_head_must_read_the_decoder_it_is_built_for():
    from bev.models import BEVNet

    camera = {"context_channels": 8, **TINY_NET["camera"]}
    with pytest.raises(ValueError, match=r"model.net.heads.segmentation .*voxel3d"):
        BEVNet(GRID, SIZE, camera=camera, decoder={"kind": "voxel3d"}, heads={"segmentation": {}})
    with pytest.raises(ValueError, match="model.net.decoder.kind must be one of bev, voxel3d"):
        BEVNet(GRID, SIZE, camera=camera, decoder={"kind": "3d"})
    with pytest.raises(ValueError, match="model.net.heads has 'boxes'"):
        BEVNet(GRID, SIZE, camera=camera, heads={"boxes": {}})
    with pytest.raises(ValueError, match="model.net.heads.motion needs past frames"):
        BEVNet(GRID, SIZE, camera=camera, heads={"segmentation": {}, "motion": {}})


def test_bev_pool_and_voxel_sum_splats_agree():
    torch.manual_seed(0)
    a = lss_net(GRID, SIZE, splat="bev_pool", pool_backend="torch", **TINY_NET).eval()
    b = lss_net(GRID, SIZE, splat="voxel_sum", pool_backend="torch", **TINY_NET).eval()
    b.load_state_dict(a.state_dict())
    x = model_inputs()
    with torch.no_grad():
        torch.testing.assert_close(a(*x)["segmentation"], b(*x)["segmentation"], rtol=1e-4, atol=1e-4)


def test_camera_features_land_in_front_of_the_camera():
    """Feeding one camera's frustum only, the splat must fill cells on that camera's side."""
    net = lss_net(GRID, SIZE, **TINY_NET)
    cams = rig(1)
    coords = net.camera.voxel_coords(
        cams["intrinsics"], cams["rots"], cams["trans"], cams["post_rots"], cams["post_trans"]
    )
    front = coords[0, 0]  # camera 0 looks along +x
    inside = (front >= 0).all(-1) & (front[..., 1] < GRID.nx) & (front[..., 2] < GRID.ny)
    xs = front[..., 1][inside].float() * GRID.xbound[2] + GRID.xbound[0]
    assert inside.any() and (xs > 0).all()


@pytest.mark.parametrize("backbone", ["resnet18", "efficientnet_b0", "efficientnet_b4"])
def test_torchvision_trunks_give_stride16_depth_and_context(backbone):
    enc = CameraEncoder(depth_bins=5, context_channels=7, backbone=backbone, mid_channels=16)
    out = enc(torch.randn(1, 3, 64, 96))
    assert out.shape == (1, 12, 4, 6)


def test_the_decoder_keeps_odd_grid_sizes():
    dec = BevDecoder(4, widths=(8, 8, 8), blocks=1)
    assert dec(torch.randn(1, 4, 25, 31))["shared"].shape == (1, 8, 25, 31)
    cheap = BevDecoder(4, widths=(8, 8, 8), blocks=1, stem_kernel=3, half_res_tail=True, task_decoders=True)
    assert {k: v.shape for k, v in cheap(torch.randn(1, 4, 25, 31)).items()} == {
        "shared": (1, 8, 25, 31),
        "detection": (1, 8, 25, 31),
    }


def test_the_cheap_decoder_options_are_what_they_say():
    """stem_kernel: the first conv's kernel; half_res_tail: the last conv before the upsampling, not after."""
    dec = BevDecoder(4, widths=(8, 8, 16), blocks=1, stem_kernel=3, half_res_tail=True).eval()
    assert dec.stem[0].kernel_size == (3, 3) and dec.stem[0].padding == (1, 1)
    x = torch.randn(2, 4, 12, 10)
    with torch.no_grad():
        x1 = dec.layer1(dec.stem(x))
        up = dec.up2(dec.up1(dec.layer3(dec.layer2(x1)), x1))
        assert up.shape[-2:] == (6, 5)
        manual = torch.nn.functional.interpolate(up, size=(12, 10), mode="bilinear", align_corners=True)
        assert torch.equal(dec(x)["shared"], manual)
    with pytest.raises(ValueError, match="stem_kernel must be 3, 5 or 7"):
        BevDecoder(4, stem_kernel=4)


def test_imagenet_weights_offline_give_a_clear_message(monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    import torchvision.models._api as tv_api

    monkeypatch.setattr(tv_api, "load_state_dict_from_url", offline)  # the name torchvision's weights call
    with pytest.raises(BackboneWeightsError, match=r"weights=null.*weights_path"):
        CameraEncoder(4, 4, backbone="resnet18", weights="imagenet")


def test_local_weights_path_is_loaded_and_bad_files_are_reported(tmp_path):
    import torchvision

    ref = torchvision.models.resnet18()
    path = tmp_path / "r18.pth"
    torch.save(ref.state_dict(), path)
    enc = CameraEncoder(4, 4, backbone="resnet18", weights_path=str(path))
    torch.testing.assert_close(enc.trunk.to16[0].weight, ref.conv1.weight)
    torch.save({"foo": torch.zeros(1)}, tmp_path / "bad.pth")
    with pytest.raises(BackboneWeightsError, match="could not load resnet18 weights"):
        CameraEncoder(4, 4, backbone="resnet18", weights_path=str(tmp_path / "bad.pth"))
    with pytest.raises(BackboneWeightsError, match="does not exist"):
        CameraEncoder(4, 4, backbone="resnet18", weights_path=str(tmp_path / "missing.pth"))


def test_bad_model_options_are_rejected():
    with pytest.raises(ValueError, match="unknown backbone"):
        CameraEncoder(4, 4, backbone="vgg")
    with pytest.raises(ValueError, match="unknown splat"):
        lss_net(GRID, SIZE, splat="scatter", **TINY_NET)
    net = lss_net(GRID, SIZE, **TINY_NET)
    with pytest.raises(ValueError, match="built for 32x96"):
        x = list(model_inputs())
        x[0] = torch.randn(2, 6, 3, 48, 96)
        net(*x)


@pytest.mark.slow  # Dynamo tracing alone takes ~1 min on 2 shared cores
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_runs_a_training_step(backend):
    torch.manual_seed(0)
    net = lss_net(GRID, SIZE, **TINY_NET)
    ref = lss_net(GRID, SIZE, **TINY_NET)
    ref.load_state_dict(net.state_dict())
    compiled = torch.compile(net, backend=backend)
    x = model_inputs()
    out = compiled(*x)["segmentation"]
    out.mean().backward()
    torch.testing.assert_close(out, ref(*x)["segmentation"], rtol=1e-3, atol=1e-3)
    assert all(p.grad is not None for p in net.camera.encoder.parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_forward_backward(dtype):
    """Autocast (what 16-mixed / bf16-mixed use): geometry stays fp32, the splat accumulates in fp32."""
    torch.manual_seed(0)
    net = lss_net(GRID, SIZE, **TINY_NET).eval()  # eval: BN uses running stats, so fp32 and mixed compare
    x = model_inputs()
    with torch.no_grad():
        ref = net(*x)["segmentation"]
    with torch.autocast("cpu", dtype=dtype):
        out = net(*x)["segmentation"]
    out.float().square().mean().backward()
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref, rtol=0.1, atol=0.1)
    assert all(torch.isfinite(p.grad).all() for p in net.parameters() if p.grad is not None)


class HostTraffic(TorchDispatchMode):
    """Records the ops that move data between host and device on a GPU: tensors made from Python data
    (lift_fresh: a blocking host-to-device copy) and scalar reads (_local_scalar_dense: .item()) or
    data-dependent sizes (nonzero, masked_select, unique), which wait for the GPU."""

    HOST = frozenset(
        {
            "lift_fresh",
            "lift_fresh_copy",
            "_local_scalar_dense",
            "nonzero",
            "masked_select",
            "_unique2",
            "unique_consecutive",
            "unique_dim",
        }
    )

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.HOST:
            self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not ops.native_available("cpu"), reason="native CPU kernels not built")
@pytest.mark.parametrize("splat,loss", [("bev_pool", "bce"), ("voxel_sum", "focal")])
def test_training_step_never_waits_for_the_host(splat, loss):
    """Forward, loss and backward enqueue device work only: on a GPU the host never stops to copy or
    read a value mid-step (which also keeps the step capturable as a CUDA graph). Device-independent
    ops, so the CPU run shows what a GPU run would do; the check itself sees both kinds of op."""
    from bev.lit import BEVLitModule

    torch.manual_seed(0)
    net = lss_net(GRID, SIZE, splat=splat, pool_backend="native", **TINY_NET)
    lit = BEVLitModule(
        net=net, optimizer=None, segmentation=dict(object_classes=["vehicle"], loss=loss, class_weight=1.0)
    )
    x = model_inputs()
    target = (torch.rand(2, 1, *GRID.bev_shape) > 0.9).float()
    net(*x)  # first call: lazy set-up outside the measured step
    with HostTraffic() as traffic:
        lit.task_modules.segmentation.loss_fn(net(*x)["segmentation"], target).backward()
    assert traffic.seen == []
    with HostTraffic() as traffic:
        torch.tensor([1.0, 2.0]).sum().item()
    assert traffic.seen == ["lift_fresh", "_local_scalar_dense"]


def test_task_decoders_share_the_encoder_and_start_alike():
    """decoder.task_decoders: the detection head reads an up path of its own; copied from the shared one (what
    init_from does from a static checkpoint) both give the same features, and each trains on its own."""
    torch.manual_seed(0)
    dec = BevDecoder(8, widths=(8, 16, 16), blocks=1, task_decoders=True).eval()
    x = torch.randn(2, 8, 24, 20)
    out = dec(x)
    seg, det = out["shared"], out["detection"]
    assert seg.shape == det.shape == (2, dec.out_channels, 24, 20) and not torch.allclose(seg, det)
    dec.copy_shared_to_detection()
    out = dec(x)
    torch.testing.assert_close(out["shared"], out["detection"])
    dec.train()
    dec(x)["detection"].sum().backward()
    assert dec.det_up2[0].weight.grad is not None and dec.stem[0].weight.grad is not None
    # the shared up path gets no gradient from the boxes
    assert all(p.grad is None for p in [*dec.up1.parameters(), *dec.up2.parameters()])
    assert list(BevDecoder(8, widths=(8, 16, 16), blocks=1)(x)) == ["shared"]  # one decoder for every head


def test_uncertainty_task_weights_start_each_task_at_its_first_loss():
    """model.task_weights=uncertainty: at the first training batch each task's log-variance is its loss, so
    segmentation and detection enter the total alike (1/2 each, plus log L / 2) whatever their units; they are
    parameters the optimiser trains, and "fixed" adds the tasks as they are."""
    from bev.lit import BEVLitModule
    from helpers.train_step import detection_targets

    torch.manual_seed(0)
    net = lss_net(GRID, SIZE, detection={"head_channels": 0, "shared_channels": 8}, **TINY_NET)
    batch = {"bev": (torch.rand(2, 1, *GRID.bev_shape) > 0.9).float(), **detection_targets(GRID, 2, seed=0)}
    tasks = ["segmentation", "detection"]
    fixed = BEVLitModule(net=net, optimizer=None, segmentation=dict(object_classes=["vehicle"]), tasks=tasks)
    learned = BEVLitModule(
        net=net, optimizer=None, segmentation=dict(object_classes=["vehicle"]), tasks=tasks, task_weights="uncertainty"
    )
    out = net(*model_inputs())
    total, terms = fixed.losses(out, batch)
    torch.testing.assert_close(total, terms["seg"] + terms["det"])
    total, terms = learned.train().losses(out, batch)
    seg, det = terms["seg"].detach(), terms["det"].detach()
    torch.testing.assert_close(total.detach(), 1 + 0.5 * (seg.log() + det.log()))
    log_vars = dict(learned.task_weights.log_vars.items())
    assert set(log_vars) == {"seg", "det"} and all(p in set(learned.parameters()) for p in log_vars.values())
    with pytest.raises(ValueError, match="task_weights"):
        BEVLitModule(
            net=net, optimizer=None, segmentation=dict(object_classes=["vehicle"]), tasks=tasks, task_weights="equal"
        )
