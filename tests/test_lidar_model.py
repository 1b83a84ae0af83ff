"""The fuser (BEVFusion's ConvFuser) and BEVNet's camera-only, LiDAR-only and fused configurations: forward,
backward, the decoder reading the fused map, clear errors, and the Hydra groups model/lidar and model/fuser."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bev.models import BEVNet
from bev.models.fuser import ConvFuser, build_fuser
from helpers.models import GRID, SIZE, model_inputs

CAMERA = {"backbone": "small", "widths": (8, 8, 16, 16, 16), "mid_channels": 16, "context_channels": 8}
DECODER = {"widths": (8, 16, 16), "blocks": 1}
LIDAR = {"pfn_channels": (8,), "widths": (8, 8, 8), "blocks": (1, 1, 1), "up_channels": (4, 4, 4)}


def cloud(B: int = 2, n: int = 600, seed: int = 0) -> torch.Tensor:
    """(n, 6) rows (batch, x, y, z, intensity, time lag) over GRID's 48 m square, every batch index present."""
    g = torch.Generator().manual_seed(seed)
    b = torch.arange(n) % B
    xyz = torch.rand(n, 3, generator=g) * torch.tensor([46.0, 46.0, 4.0]) - torch.tensor([23.0, 23.0, 2.0])
    return torch.cat([b[:, None].float(), xyz, torch.rand(n, 1, generator=g) * 50, (b[:, None] % 3) * 0.05], 1)


def net(camera=CAMERA, lidar=LIDAR, fuser=None, **kw) -> BEVNet:
    torch.manual_seed(0)
    return BEVNet(GRID, SIZE, camera=camera, decoder=DECODER, lidar=lidar, fuser=fuser, **kw)


def test_conv_fuser_is_concat_conv_bn_relu_with_gradients_to_both_maps():
    torch.manual_seed(0)
    fuser = ConvFuser([3, 5], 7).eval()
    with torch.no_grad():
        fuser.norm.running_mean.uniform_(-1, 1)
        fuser.norm.running_var.uniform_(0.5, 2)
    cam, lidar = torch.randn(2, 3, 6, 4, requires_grad=True), torch.randn(2, 5, 6, 4, requires_grad=True)
    out = fuser([cam, lidar])
    n = fuser.norm
    want = F.relu(
        (F.conv2d(torch.cat([cam, lidar], 1), fuser.conv.weight, padding=1) - n.running_mean[:, None, None])
        / torch.sqrt(n.running_var[:, None, None] + n.eps)
        * n.weight[:, None, None]
        + n.bias[:, None, None]
    )
    assert out.shape == (2, 7, 6, 4)
    torch.testing.assert_close(out, want)
    out.square().sum().backward()
    assert cam.grad.abs().sum() > 0 and lidar.grad.abs().sum() > 0 and fuser.conv.weight.grad.abs().sum() > 0
    assert build_fuser([3, 5]).out_channels == 3 and build_fuser([3, 5], out_channels=9).out_channels == 9
    with pytest.raises(ValueError, match=r"takes BEV maps of \[3, 5\] channels, got \[3, 4\]"):
        fuser([cam, lidar[:, :4]])
    with pytest.raises(ValueError, match="fuser.kind must be conv"):
        build_fuser([3, 5], kind="attention")


def _grads(module: torch.nn.Module) -> bool:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return bool(grads) and any(g.abs().sum() > 0 for g in grads)


def test_fused_forward_backward_and_the_decoder_reads_the_fused_map():
    model = net(fuser={"kind": "conv"})
    x, pts = model_inputs(), cloud()
    out = model(*x, points=pts)
    assert out["segmentation"].shape == (2, 1, *GRID.bev_shape) and "depth" in out
    assert model.fuser.in_channels == (8, model.lidar.out_channels) and model.decoder.stem[0].in_channels == 8
    out["segmentation"].square().mean().backward()
    for part in (model.camera, model.lidar, model.fuser, model.decoder, model.heads):
        assert _grads(part), type(part).__name__
    model.eval()
    with torch.no_grad():
        fused = model.fuser([model.camera(*x)[0], model.lidar(pts, 2)])
        want = model.heads["segmentation"](model.decoder(fused)["shared"])
        torch.testing.assert_close(model(*x, points=pts)["segmentation"], want)
        moved = pts.clone()
        moved[:, 1] += 3.0  # the LiDAR map is read: other points, other output
        assert not torch.allclose(model(*x, points=moved)["segmentation"], want)


def test_lidar_only_forward_backward():
    model = net(camera=None)
    assert model.camera is None and model.fuser is None and model.image_size == SIZE
    pts = cloud(3)
    out = model(points=pts, batch_size=3)
    assert out["segmentation"].shape == (3, 1, *GRID.bev_shape) and "depth" not in out
    assert model(points=pts)["segmentation"].shape[0] == 3  # the last batch index + 1
    assert model(points=pts[pts[:, 0] == 0], batch_size=3)["segmentation"].shape[0] == 3  # empty clouds
    out["segmentation"].square().mean().backward()
    for part in (model.lidar, model.decoder, model.heads):
        assert _grads(part)
    assert not any(k.startswith(("camera.", "fuser.")) for k in model.state_dict())


def test_camera_only_is_unchanged_and_ignores_points():
    """Without lidar, the network is the one it was: same parameters drawn, the default camera branch for camera
    None, no LiDAR or fuser weights; points are ignored."""
    torch.manual_seed(0)
    plain = BEVNet(GRID, SIZE, camera=CAMERA, decoder=DECODER)
    torch.manual_seed(0)
    again = BEVNet(GRID, SIZE, camera=CAMERA, decoder=DECODER, lidar=None, fuser=None)
    a, b = plain.state_dict(), again.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(k.startswith(("lidar.", "fuser.")) for k in a)
    assert BEVNet(GRID, SIZE).camera is not None  # camera None without lidar: the default camera branch
    plain.eval()
    with torch.no_grad():
        x = model_inputs()
        assert torch.equal(plain(*x)["segmentation"], plain(*x, points=cloud())["segmentation"])


def test_fused_temporal_reads_every_frame_through_the_fuser():
    model = net(fuser={}, temporal={"past_frames": 1, "fusion": "concat"})
    assert model.fuser.in_channels[0] == 2 * model.camera.out_channels
    x = [torch.stack([t, t], 1) for t in model_inputs()]
    ego = torch.eye(4).expand(2, 2, 4, 4)
    out = model(*x, ego, points=cloud())
    assert out["segmentation"].shape == (2, 1, *GRID.bev_shape)


def test_parts_that_do_not_fit_are_one_clear_error():
    with pytest.raises(ValueError, match=r"needs a fuser: add \+model/fuser@model.net.fuser=conv"):
        net()
    with pytest.raises(ValueError, match="set model.net.lidar too, or fuser null"):
        net(lidar=None, fuser={})
    with pytest.raises(ValueError, match="needs a camera branch to fuse with"):
        net(camera=None, fuser={})
    with pytest.raises(ValueError, match="a LiDAR-only network has none"):
        net(camera=None, temporal={"past_frames": 1})
    model = net(fuser={})
    with pytest.raises(ValueError, match=r"has a LiDAR branch \(model.net.lidar\): pass points="):
        model(*model_inputs())
    with pytest.raises(ValueError, match="has a camera branch: pass images"):
        model(points=cloud())


def test_the_lidar_and_fuser_config_groups_build_the_three_networks(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    import bev.data.config  # noqa: F401  (registers the data schemas the data configs extend)
    from bev.utils.config import CONFIG_DIR

    base = ["model=lss_small", "grid.xbound=[-24,24,2.0]", "grid.ybound=[-24,24,2.0]", "data.final_dim=[32,96]"]
    lidar = ["+model/lidar@model.net.lidar=pillars_small"]
    cases = {
        "camera": base,
        "lidar": base + lidar + ["model.net.camera=null"],
        "fused": base + lidar + ["+model/fuser@model.net.fuser=conv"],
    }
    pts = cloud()
    for name, overrides in cases.items():
        with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
            cfg = compose("train", overrides=overrides)
        model = instantiate(cfg.model.net, grid={k: list(v) for k, v in cfg.grid.items()})
        assert (model.camera is None) == (name == "lidar") and (model.lidar is None) == (name == "camera")
        assert (model.fuser is not None) == (name == "fused")
        cams = (
            {}
            if name == "lidar"
            else dict(zip(("images", "intrinsics", "rots", "trans", "post_rots", "post_trans"), model_inputs()))
        )
        out = model(**cams, points=pts)
        assert out["segmentation"].shape[-2:] == (24, 24)
    assert list(cfg.model.net.lidar.pfn_channels) == [32] and cfg.model.net.lidar.reduce == "max"
    assert model.lidar.out_channels == 48 and model.fuser.out_channels == model.camera.out_channels


def test_init_from_a_camera_and_a_lidar_checkpoint_takes_each_part_from_its_own(tmp_path):
    """model.init_from as a list (BEVFusion's start: a camera and a LiDAR checkpoint): every source's matching
    tensors load, a later source's over an earlier one's where both hold a tensor."""
    import types

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    import bev.data  # noqa: F401 (the data config schemas)
    from bev.train import CONFIG_DIR

    sizes = [
        "model.net.lidar.pfn_channels=[8]",
        "model.net.lidar.widths=[8,8,8]",
        "model.net.lidar.up_channels=[4,4,4]",
    ]
    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["experiment=synthetic_fusion_cpu", "grid.xbound=[-24,24,2.0]", *sizes])
    lit = instantiate(cfg.model)
    state = lit.state_dict()

    def saved(name: str, fill: float, parts: tuple[str, ...]) -> str:
        tensors = {
            k: torch.full_like(v, fill)
            for k, v in state.items()
            if k.split(".")[:2][-1] in parts and v.is_floating_point()
        }
        torch.save({"state_dict": tensors}, tmp_path / name)
        return str(tmp_path / name)

    lit.init_from = [saved("camera.ckpt", 1.0, ("camera", "decoder")), saved("lidar.ckpt", 2.0, ("lidar", "decoder"))]
    lit._trainer = types.SimpleNamespace(ckpt_path=None)
    report = lit._apply_init_from()
    after = lit.state_dict()
    for part, fill in (("camera", 1.0), ("lidar", 2.0), ("decoder", 2.0)):
        keys = [k for k in after if k.startswith(f"net.{part}.") and after[k].is_floating_point()]
        assert keys and all(bool((after[k] == fill).all()) for k in keys), part
    scratch = report.splitlines()[-1]
    assert "from scratch after all of them: fuser" in scratch and "camera" not in scratch and "lidar" not in scratch
