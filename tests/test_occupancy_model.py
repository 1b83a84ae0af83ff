"""Occupancy networks (BEVDet-Occ's voxel3d, FlashOcc's channel_to_height) and losses (weighted cross-entropy,
Lovasz-softmax, camera-visible voxels only)."""

import math

import pytest
import torch
import torch.nn.functional as F

from bev.tasks.occupancy.grid import FREE, NUM_CLASSES, OCC_SHAPE
from bev.tasks.occupancy.loss import IGNORE, OCC3D_NUSC_FREQUENCIES, OccupancyLoss, class_weights, lovasz_softmax

SMALL_CAMERA = {"backbone": "small", "widths": [8, 8, 16, 16, 16], "blocks": 1, "mid_channels": 16}


def _grid(step=2.0, zstep=3.2):
    return {"xbound": [-40, 40, step], "ybound": [-40, 40, step], "zbound": [-1, 5.4, zstep], "dbound": [4, 44, 8.0]}


def _net(kind, channels=8, **decoder):
    """A BEVNet with an occupancy head of `kind` on the decoder it reads (voxel3d: the 3D one, with `decoder`'s
    widths and blocks)."""
    from bev.models import BEVNet

    camera = {"context_channels": 8, **SMALL_CAMERA}
    if kind == "voxel3d":
        decoder = {"kind": "voxel3d", "channels": channels, **decoder}
    else:
        decoder = {"kind": "bev", "widths": [8, 8, 8], "blocks": 1}
    heads = {"occupancy": {"kind": kind, "channels": channels}}
    return BEVNet(_grid(), (32, 96), camera=camera, decoder=decoder, heads=heads)


def _inputs(net, B=1):
    from bev.inference import example_inputs

    return example_inputs(net, 6, B)


@pytest.mark.parametrize(
    "kind, occ",
    [("voxel3d", {"widths": [8, 8], "blocks": [1, 1], "channels": 8}), ("channel_to_height", {"channels": 8})],
)
def test_both_kinds_give_occ3d_logits_and_gradients(kind, occ):
    net = _net(kind, **occ)
    out = net(*_inputs(net, B=1))["occupancy"]
    assert tuple(out.shape) == (1, NUM_CLASSES, *OCC_SHAPE)
    out.float().mean().backward()
    assert all(p.grad is not None for p in net.parameters() if p.requires_grad)  # nothing unused (DDP)
    assert net.decoder.volumetric == (kind == "voxel3d")
    assert not any(isinstance(m, torch.nn.Conv3d) for m in net.modules()) or kind == "voxel3d"


def test_channel_to_height_reads_channels_as_height_then_class():
    from bev.tasks.occupancy.head import ChannelToHeightHead

    head = ChannelToHeightHead(4, 4, heights=3, classes=2)
    x = torch.randn(1, 4, *OCC_SHAPE[:2])
    out = head(x)
    flat = head.predicter(head.proj(x))  # (1, 6, X, Y): channel z * 2 + k
    assert tuple(out.shape) == (1, 2, *OCC_SHAPE[:2], 3)
    for z in range(3):
        for k in range(2):
            torch.testing.assert_close(out[0, k, :, :, z], flat[0, z * 2 + k])


def test_the_lift_grid_must_span_occ3d():
    from bev.tasks.occupancy.head import build

    with pytest.raises(ValueError, match=r"xbound \[-50"):
        build(8, _grid_of(xbound=[-50, 50, 2.0]), "voxel3d")
    with pytest.raises(ValueError, match="zbound"):
        build(8, _grid_of(zbound=[-1, 5.4, 0.2]), "voxel3d")  # finer than Occ3D's 0.4 m
    build(8, _grid_of(zbound=[-1, 5.4, 0.2]), "channel_to_height")  # its heights come from the channels
    with pytest.raises(ValueError, match="kind must be one of"):
        build(8, _grid_of(), "voxels")
    from bev.tasks import build_head

    with pytest.raises(
        ValueError, match=r"unknown model.net.heads.occupancy key\(s\) \['width'\]; known: channels, kind"
    ):
        build_head("occupancy", 8, _grid_of(), {"kind": "channel_to_height", "width": [8]})
    with pytest.raises(ValueError, match=r"unknown model.net.heads.detection key\(s\) \['heads'\]; known: groups, "):
        build_head("detection", 8, _grid_of(), {"heads": 2})


def _grid_of(zstep=3.2, **bounds):
    from bev.geometry import Grid

    return Grid.from_any({**_grid(zstep=zstep), **bounds})


# ----------------------------------------------------------------------------- losses


def _one_hot_probs(pred, K):
    return F.one_hot(pred, K).double()


def test_lovasz_of_hard_predictions_is_one_minus_iou():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (500,), generator=g)
    pred = torch.where(torch.rand(500, generator=g) < 0.7, labels, torch.randint(0, 4, (500,), generator=g))
    want = []
    for c in labels.unique().tolist():  # the Jaccard loss written out
        inter = ((labels == c) & (pred == c)).sum().item()
        union = ((labels == c) | (pred == c)).sum().item()
        want.append(1 - inter / union)
    got = lovasz_softmax(_one_hot_probs(pred, 4), labels)
    assert math.isclose(got.item(), sum(want) / len(want), rel_tol=1e-9)
    assert lovasz_softmax(_one_hot_probs(labels, 4), labels).item() == 0.0


def test_lovasz_gradient_lowers_the_loss():
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 3, (200,), generator=g)
    logits = torch.randn(200, 3, generator=g, requires_grad=True)
    before = lovasz_softmax(logits.softmax(1), labels)
    before.backward()
    after = lovasz_softmax((logits - 1.0 * logits.grad).softmax(1), labels)
    assert after < before


def _labels(B=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    sem = torch.randint(0, NUM_CLASSES, (B, *OCC_SHAPE), generator=g).to(torch.uint8)
    mask = torch.rand(B, *OCC_SHAPE, generator=g) < 0.3
    logits = torch.randn(B, NUM_CLASSES, *OCC_SHAPE, generator=g)
    return logits, sem, mask


def test_cross_entropy_on_visible_voxels_with_class_weights():
    logits, sem, mask = _labels()
    w = class_weights({"car": 3.0, "free": 0.5})
    loss = OccupancyLoss(class_weight={"car": 3.0, "free": 0.5})(logits, sem, mask)["occ"]
    # Written out: sum over visible voxels of w_y * -log p_y, over the sum of their w_y.
    lp = logits.log_softmax(1).movedim(1, -1)[mask]
    y = sem[mask].long()
    want = -(w[y] * lp.gather(1, y[:, None])[:, 0]).sum() / w[y].sum()
    torch.testing.assert_close(loss, want)
    every = OccupancyLoss(visible_only=False)(logits, sem, mask)["occ"]
    torch.testing.assert_close(every, F.cross_entropy(logits, sem.long()), rtol=1e-4, atol=0)
    sem_ign = sem.clone()
    sem_ign[..., :8] = IGNORE  # voxels from outside an augmented grid are skipped
    torch.testing.assert_close(
        OccupancyLoss(visible_only=False)(logits, sem_ign, mask)["occ"],
        F.cross_entropy(logits[..., 8:], sem[..., 8:].long()),
        rtol=1e-4,  # float32 sums over 300k voxels in another order
        atol=0,
    )


def test_loss_options_and_lovasz_term():
    logits, sem, mask = _labels()
    loss = OccupancyLoss(lovasz_weight=0.5)
    terms = loss(logits, sem, mask)
    keep = mask
    want = lovasz_softmax(logits.softmax(1).movedim(1, -1)[keep], sem[keep].long())
    torch.testing.assert_close(terms["lovasz"], want)
    torch.testing.assert_close(loss.total(terms), terms["occ"] + 0.5 * want)
    lf = class_weights("log_frequency")
    assert lf.shape == (NUM_CLASSES,) and lf[2] > lf[4] > lf[FREE]  # rarer classes weigh more
    for bad in ("inverse", [1.0] * 17, {"cars": 1.0}, [-1.0] * 18):
        with pytest.raises(ValueError, match="class_weight"):
            class_weights(bad)
    with pytest.raises(ValueError, match="occ_mask_camera"):
        OccupancyLoss()(logits, sem, None)


def test_inverse_sqrt_frequency_weights():
    """sqrt(f_free / f_c) of Occ3D-nuScenes's voxel counts: free space 1; a class's voxels together weigh
    sqrt(f_c / f_free) of free space's, far more than under log_frequency's 1.8x span."""
    w = class_weights("inverse_sqrt_frequency")
    freq = torch.tensor(OCC3D_NUSC_FREQUENCIES, dtype=torch.float64)
    assert w.dtype == torch.float32 and w.shape == (NUM_CLASSES,) and w[FREE] == 1.0
    assert w[4] == pytest.approx(10.56, abs=0.01) and w[2] == pytest.approx(111.44, abs=0.01)  # car, bicycle
    share = w.double() * freq / freq[FREE]
    torch.testing.assert_close(share, (freq / freq[FREE]).sqrt())
    lf = class_weights("log_frequency")
    assert w.max() / w.min() > 100 > 2 > lf.max() / lf.min()
    # As a loss weight: a voxel of the rare class costs w_c times a free one in the weighted mean.
    logits, sem = torch.zeros(1, NUM_CLASSES, 2, 1, 1), torch.tensor([[[[2]], [[FREE]]]], dtype=torch.uint8)
    logits[0, FREE] = 5.0  # both voxels predicted free: only the bicycle voxel is wrong
    loss = OccupancyLoss(class_weight="inverse_sqrt_frequency", visible_only=False)(logits, sem)["occ"]
    nll = -logits[0, :, :, 0, 0].log_softmax(0)
    want = (w[2] * nll[2, 0] + w[FREE] * nll[FREE, 1]) / (w[2] + w[FREE])
    torch.testing.assert_close(loss, want)


def test_voxel3d_runs_its_3d_part_in_fp32_under_autocast():
    """bf16-mixed on a CPU drove the 3D encoder to NaN within 5 steps of synthetic_occ_cpu: it runs in fp32."""
    net = _net("voxel3d", widths=[8], blocks=[1], channels=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        voxels = torch.randn(1, 8 * net.grid.nz, net.grid.nx, net.grid.ny).to(torch.bfloat16)
        feats = net.decoder(voxels)["shared"]
        assert feats.dtype == torch.float32 and net.heads["occupancy"](feats).dtype == torch.float32
