"""The temporal model (bev.models.temporal), its losses (bev.tasks.motion.loss, bev.losses) and its LightningModule
(bev.lit with the motion task)."""

from __future__ import annotations

import contextlib
import io
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bev.geometry import Grid
from bev.inference import ring_rig
from bev.lit import BEVLitModule
from bev.losses import NonFiniteLossError, UncertaintyWeights
from bev.models import BEVNet
from bev.models.temporal import warp_to_present
from bev.tasks.motion import IGNORE
from bev.tasks.motion.loss import regression_loss, segmentation_loss
from bev.tasks.motion.task import present_copied

GRID = {
    "xbound": [-24.0, 24.0, 2.0],
    "ybound": [-24.0, 24.0, 2.0],
    "zbound": [-10.0, 10.0, 20.0],
    "dbound": [4.0, 44.0, 8.0],
}
SIZES = {
    "grid": GRID,
    "image_size": (32, 96),
    "camera": {"context_channels": 8, "backbone": "small", "widths": [8, 8, 16, 16, 16], "mid_channels": 16},
    "decoder": {"widths": [8, 16, 16]},
}
B, P, F, N = 2, 2, 3, 3
X = Y = 24


def motion(yaw: float, tx: float, ty: float) -> np.ndarray:
    """4x4 ego motion (frame t -> t+1) of a yaw and an x, y translation."""
    c, s = math.cos(yaw), math.sin(yaw)
    m = np.eye(4)
    m[:2, :2] = [[c, -s], [s, c]]
    m[:2, 3] = [tx, ty]
    return m


def egomotion(steps: list[np.ndarray], frames: int = P + 1 + F) -> torch.Tensor:
    """(B, frames, 4, 4): the given steps first, identity after."""
    ms = [*steps, *[np.eye(4)] * (frames - len(steps))]
    return torch.tensor(np.stack(ms), dtype=torch.float32).expand(B, -1, -1, -1).clone()


def sequence_batch(seed: int = 0, ego: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A random window: P+1 frames of N ring cameras, labels for F+1 frames (some cells 255)."""
    g = torch.Generator().manual_seed(seed)
    rig = ring_rig(N, SIZES["image_size"], B * (P + 1))
    batch = {k: v.view(B, P + 1, *v.shape[1:]) for k, v in rig.items() if k != "images"}
    batch["images"] = torch.randn(B, P + 1, N, 3, *SIZES["image_size"], generator=g)
    batch["future_egomotion"] = egomotion([motion(0.1, 2.0, 0.5), motion(-0.05, 1.5, 0.0)]) if ego is None else ego
    seg = (torch.rand(B, F + 1, X, Y, generator=g) > 0.8).long()
    vec = torch.randn(B, F + 1, 2, X, Y, generator=g)
    batch.update(
        segmentation=seg,
        instance=seg,
        centerness=torch.rand(B, F + 1, 1, X, Y, generator=g),
        offset=torch.where(seg.bool()[:, :, None], vec, torch.full_like(vec, IGNORE)),
        flow=torch.where(seg.bool()[:, :, None], -vec, torch.full_like(vec, IGNORE)),
        bev=(torch.rand(B, 2, X, Y, generator=g) > 0.7).float(),
    )
    return batch


def static_net(num_classes: int = 2) -> BEVNet:
    return BEVNet(**SIZES, heads={"segmentation": {"num_classes": num_classes}})


def tiny_net(fusion: str = "residual", detection=None, **motion) -> BEVNet:
    """A temporal BEVNet: P past frames fused, segmentation of 2 classes and motion heads for F future frames."""
    torch.manual_seed(0)
    heads = {"segmentation": {"num_classes": 2}, "detection": detection, "motion": {"future_frames": F, **motion}}
    return BEVNet(**SIZES, heads=heads, temporal={"past_frames": P, "fusion": fusion})


def tiny_module(**kw) -> BEVLitModule:
    """The temporal tiny_net trained for segmentation and motion."""
    net = tiny_net(**kw.pop("net", {}))
    classes = dict(object_classes=["vehicle"], map_classes=["drivable_area"])
    return BEVLitModule(net, torch.optim.Adam, tasks=["segmentation", "motion"], segmentation=classes, **kw)


def cams(batch):
    return [batch[k] for k in ("images", "intrinsics", "rots", "trans", "post_rots", "post_trans")]


@pytest.mark.parametrize("probabilistic", [False, True])
def test_heads_shapes_and_gradients(probabilistic):
    net = tiny_net(probabilistic=probabilistic, head_channels=8)
    batch = sequence_batch()
    out = net(*cams(batch), batch["future_egomotion"], future_labels=batch if probabilistic else None)
    out = {"bev": out["segmentation"], **out["motion"]}
    want = {
        "bev": (B, 2, X, Y),
        "segmentation": (B, F + 1, 1, X, Y),
        "centerness": (B, F + 1, 1, X, Y),
        "offset": (B, F + 1, 2, X, Y),
        "flow": (B, F + 1, 2, X, Y),
    }
    assert {k: tuple(out[k].shape) for k in want} == want
    sum(v.float().square().mean() for v in out.values()).backward()
    missing = [n for n, p in net.named_parameters() if p.grad is None]
    assert not missing, missing
    heads = ("heads.motion.future.branches.instance", "heads.motion.future.branches.motion", "heads.segmentation")
    for head in (*heads, "camera.encoder.head"):
        grads = [p.grad.abs().sum() for n, p in net.named_parameters() if n.startswith(head)]
        assert grads and all(g > 0 for g in grads), head


def test_warp_of_a_linear_field_matches_the_composed_ego_motion():
    """A field linear in the past frame's metres, warped into the present frame, equals that field at each
    present cell centre carried back by the inverse of the composed 4x4 motions (bilinear is exact on it)."""
    grid = Grid(xbound=[-24.0, 24.0, 2.0], ybound=[-16.0, 20.0, 1.0])  # unequal steps, off-centre in y
    nx, ny = grid.bev_shape
    steps = [motion(0.3, 3.1, -1.7), motion(-0.2, 2.4, 0.9)]
    centers = grid.cell_centers()  # (X, Y, 2) metres
    a, b, c = 0.7, -0.4, 3.0
    field = a * centers[..., 0] + b * centers[..., 1] + c
    feats = torch.zeros(B, P, 1, nx, ny)
    feats[:, 0, 0] = torch.tensor(field, dtype=torch.float32)
    out = warp_to_present(feats, egomotion(steps), grid)[0, 0, 0].numpy()
    to_past = np.linalg.inv(steps[1] @ steps[0])
    homog = np.concatenate([centers, np.zeros((nx, ny, 1)), np.ones((nx, ny, 1))], axis=-1)
    past = homog @ to_past.T
    # Within the hull of the past grid's cell centres, where bilinear sampling needs no zero padding.
    inside = (np.abs(past[..., 0]) < 23 - 1e-6) & (past[..., 1] > -15.5 + 1e-6) & (past[..., 1] < 19.5 - 1e-6)
    assert inside.sum() > 300
    expected = a * past[..., 0] + b * past[..., 1] + c
    np.testing.assert_allclose(out[inside], expected[inside], atol=1e-4)


def test_warp_under_bf16_autocast_keeps_the_geometry_in_fp32():
    """Autocast (bf16-mixed training) must not compose the ego motions in bf16: 40 m of travel is off by
    up to 0.25 m there (and CUDA's linalg.inv refuses bf16), so the warp equals the fp32 one."""
    grid = Grid(**GRID)
    feats = torch.randn(B, P, 2, X, Y)
    ego = egomotion([motion(0.21, 17.3, -3.9), motion(-0.13, 23.1, 2.7)])
    plain = warp_to_present(feats, ego, grid)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = warp_to_present(feats, ego, grid)
    torch.testing.assert_close(mixed, plain, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "step", [motion(0.0, -4.0, 2.0), motion(math.pi / 2, 0.0, 0.0), motion(math.pi / 2, 6.0, -2.0)]
)
def test_warp_moves_a_cell_to_where_the_motion_takes_its_centre(step):
    """A one-hot feature of the frame just before the present lands (value 1) on the cell that contains
    its centre moved by the ego motion (whole-cell translations and quarter turns keep it on a centre)."""
    grid = Grid(**GRID)
    i, j = 7, 15
    feats = torch.zeros(B, P, 1, X, Y)
    feats[:, 1, 0, i, j] = 1.0
    out = warp_to_present(feats, egomotion([np.eye(4), step]), grid)[1, 1, 0]
    centre = grid.cell_centers()[i, j]
    moved = (step @ np.array([*centre, 0.0, 1.0]))[:2]
    k, m = grid.xy_to_index(moved)
    assert out[k, m].item() == pytest.approx(1.0, abs=1e-5)
    assert out.sum().item() == pytest.approx(1.0, abs=1e-5)


def test_past_no_grad_keeps_the_outputs_and_drops_the_past_gradients():
    net = tiny_net().eval()
    batch = sequence_batch()
    images = batch["images"].requires_grad_(True)
    ego = batch["future_egomotion"]
    with torch.no_grad():
        plain = net(*cams(batch), ego)
    out = net(*cams(batch), ego, past_no_grad=True)
    for k in ("segmentation", "depth"):
        torch.testing.assert_close(out[k], plain[k], rtol=1e-4, atol=1e-4)
    for k in plain["motion"]:
        torch.testing.assert_close(out["motion"][k], plain["motion"][k], rtol=1e-4, atol=1e-4)
    # The fusion's last conv starts at zero: give the past a path to the output to see its gradient.
    torch.nn.init.normal_(net.temporal.mix[-1].weight)
    for no_grad in (False, True):
        images.grad = None
        net(*cams(batch), ego, past_no_grad=no_grad)["segmentation"].sum().backward()
        past = images.grad[:, :-1].abs().sum()
        assert images.grad[:, -1].abs().sum() > 0
        assert (past == 0) if no_grad else (past > 0)


def test_frames_that_do_not_match_the_model_get_a_clear_error():
    net = tiny_net()
    batch = sequence_batch()
    with pytest.raises(ValueError, match="past_frames"):
        net(*(c[:, 1:] for c in cams(batch)), batch["future_egomotion"])
    module = tiny_module()
    static = {
        k: v[:, -1]
        for k, v in batch.items()
        if k in ("images", "intrinsics", "rots", "trans", "post_rots", "post_trans")
    }
    with pytest.raises(ValueError, match="data.past_frames"):
        module(static)
    small = batch["images"][..., :16, :48]
    with pytest.raises(ValueError, match="images are 16x48 but the model was built for 32x96"):
        net(small, *cams(batch)[1:], batch["future_egomotion"])


def test_losses_ignore_255_and_discount_the_future():
    g = torch.Generator().manual_seed(1)
    pred = torch.randn(2, 3, 2, 5, 5, generator=g)
    target = torch.randn(2, 3, 2, 5, 5, generator=g)
    ignored = torch.rand(2, 3, 5, 5, generator=g) > 0.5
    target[ignored.unsqueeze(2).expand_as(target)] = IGNORE
    loss = regression_loss(pred, target, norm=1, future_discount=0.9)
    # Independent: a loop over labelled cells.
    total, count = 0.0, 0
    for b, t, x, y in zip(*np.nonzero(~ignored.numpy())):
        total += 0.9**t * float((pred[b, t, :, x, y] - target[b, t, :, x, y]).abs().sum())
        count += 1
    assert loss.item() == pytest.approx(total / count, rel=1e-5)
    wild = pred.clone()
    wild[ignored.unsqueeze(2).expand_as(pred)] = 1e6  # predictions on ignored cells never count
    assert regression_loss(wild, target, norm=1, future_discount=0.9).item() == pytest.approx(loss.item(), rel=1e-6)
    all_ignored = torch.full_like(target, IGNORE)
    assert regression_loss(pred, all_ignored).item() == 0.0


def test_segmentation_loss_ignores_255_and_top_k_keeps_the_hardest_cells():
    logits = torch.tensor([[[[[3.0, -3.0], [0.0, 5.0]]]]])  # (1, 1, 1, 2, 2)
    target = torch.tensor([[[[1, 255], [0, 0]]]])
    per_cell = torch.nn.functional.binary_cross_entropy_with_logits(
        logits[0, 0, 0], torch.tensor([[1.0, 0.0], [0.0, 0.0]]), pos_weight=torch.tensor(2.0), reduction="none"
    )
    expected = (per_cell[0, 0] + per_cell[1, 0] + per_cell[1, 1]) / 3
    assert segmentation_loss(logits, target, pos_weight=2.0).item() == pytest.approx(expected.item(), rel=1e-6)
    assert segmentation_loss(logits, target, pos_weight=2.0, top_k=0.25).item() == pytest.approx(
        per_cell[1, 1].item(), rel=1e-6
    )


def test_uncertainty_weighting_is_kendalls_formula():
    w = UncertaintyWeights(("a", "b"))
    with torch.no_grad():
        w.log_vars["a"].fill_(0.5)
        w.log_vars["b"].fill_(-1.0)
    total = w({"a": torch.tensor(2.0), "b": torch.tensor(3.0)})
    expected = 2.0 / (2 * math.exp(0.5)) + 0.25 + 3.0 / (2 * math.exp(-1.0)) - 0.5
    assert total.item() == pytest.approx(expected, rel=1e-6)


def test_uncertainty_init_loss_starts_every_term_alike_once():
    w = UncertaintyWeights(("a", "b"), init="loss")
    terms = {"a": torch.tensor(4.0), "b": torch.tensor(0.1)}
    total = w(terms)  # training mode: the first batch sets s = log L
    assert w.log_vars["a"].item() == pytest.approx(math.log(4.0)) and w.log_vars["b"].item() == pytest.approx(
        math.log(0.1)
    )
    assert total.item() == pytest.approx(0.5 + 0.5 * math.log(4.0) + 0.5 + 0.5 * math.log(0.1), rel=1e-5)
    w({"a": torch.tensor(1.0), "b": torch.tensor(1.0)})  # only once (the flag is saved with the checkpoint)
    assert w.log_vars["a"].item() == pytest.approx(math.log(4.0)) and "pending" in w.state_dict()
    untouched = UncertaintyWeights(("a",), init="loss").eval()
    untouched({"a": torch.tensor(4.0)})  # validation before training does not set it
    assert untouched.log_vars["a"].item() == 0.0


def test_a_nan_loss_stops_training_naming_the_step():
    module = tiny_module()
    batch = sequence_batch()
    batch["centerness"][0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteLossError, match=r"at step 0 .*centerness"):
        module.training_step(batch, 0)


STATIC_CONFIG = {"model": {"_target_": "bev.lit.BEVLitModule", "net": {"_target_": "bev.models.BEVNet"}}}
TEMPORAL_CONFIG = {"model": {"_target_": "bev.lit.BEVLitModule", "net": {"_target_": "bev.models.BEVNet"}}}


def save_checkpoint(module, path, run_config=None):
    """A checkpoint as bev-train writes it: the state_dict, and the run's config (on_save_checkpoint)."""
    ckpt = {"state_dict": module.state_dict()}
    module.run_config = run_config
    module.on_save_checkpoint(ckpt)
    torch.save(ckpt, path)
    return str(path)


def static_module(seed: int = 1) -> BEVLitModule:
    torch.manual_seed(seed)
    static = BEVLitModule(
        static_net(), torch.optim.Adam, segmentation=dict(object_classes=["vehicle"], map_classes=["drivable_area"])
    )
    for m in static.modules():  # non-default BN statistics, so that loading them is seen too
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
    return static


def init_from(path: str, **kw) -> tuple[BEVLitModule, str]:
    """A tiny temporal module after model.init_from=path was applied, and what it said."""
    module = tiny_module(init_from=path, **kw)
    module._trainer = SimpleNamespace(ckpt_path=None, is_global_zero=True)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.on_fit_start()
    return module, out.getvalue()


def test_init_from_loads_the_static_weights_and_starts_as_the_static_model(tmp_path):
    static = static_module()
    module, said = init_from(save_checkpoint(static, tmp_path / "static.ckpt", STATIC_CONFIG))
    assert (
        "camera (" in said
        and "decoder (" in said
        and "new (trained from scratch): temporal (" in said
        and "heads.motion (" in said
    )
    own = module.state_dict()
    for k, v in static.state_dict().items():
        if k.startswith("net."):
            torch.testing.assert_close(own[k], v, rtol=0, atol=0)
    batch = sequence_batch()
    module.eval(), static.eval()
    with torch.no_grad():
        present = static.net(*(c[:, -1] for c in cams(batch)))["segmentation"]
        out = module(batch)
    # All frames are lifted as one batch here (other convolution blocking than the static model's batch).
    torch.testing.assert_close(out["segmentation"], present, rtol=1e-4, atol=1e-4)
    assert "every frame starts as the static head's vehicle logits" in said
    for t in range(F + 1):  # the future starts as the present vehicle prediction, copied
        torch.testing.assert_close(out["motion"]["segmentation"][:, t, 0], present[:, 0], rtol=1e-4, atol=1e-4)
    # The present frame lifted alone (past_no_grad) goes through the very same operations as in the static
    # model, and the untrained fusion adds exact zeros: the same logits, bit for bit.
    module.past_no_grad = True
    with torch.no_grad():
        assert torch.equal(module(batch)["segmentation"], present)


def test_concat_fusion_from_a_static_model_starts_as_that_model(tmp_path):
    """BEVDet4D's fusion: the BEV decoder reads the aligned frames side by side; from a static checkpoint its
    stem takes the static weights on the present frame's channels and zero on the past's."""
    static = static_module()
    module, said = init_from(save_checkpoint(static, tmp_path / "static.ckpt", STATIC_CONFIG), net={"fusion": "concat"})
    stem = module.net.decoder.stem[0]
    assert module.net.temporal.mix is None and stem.in_channels == 8 * (P + 1)
    assert "stem: the static one on the present frame's channels" in said
    batch = sequence_batch()
    module.eval(), static.eval()
    module.past_no_grad = True
    with torch.no_grad():
        present = static.net(*(c[:, -1] for c in cams(batch)))["segmentation"]
        torch.testing.assert_close(module(batch)["segmentation"], present, rtol=1e-5, atol=1e-5)
        stem.weight[:, :8].normal_()  # the past frames' channels read: the output changes with them
        assert not torch.allclose(module(batch)["segmentation"], present, atol=1e-3)
    with pytest.raises(ValueError, match="fusion must be one of"):
        tiny_net(fusion="sum")


def test_init_from_a_temporal_checkpoint_keeps_its_future_heads(tmp_path):
    torch.manual_seed(2)
    trained = tiny_module()
    for p in trained.net.heads["motion"].parameters():
        torch.nn.init.normal_(p)
    module, said = init_from(save_checkpoint(trained, tmp_path / "temporal.ckpt", TEMPORAL_CONFIG))
    assert "the temporal checkpoint's where they fit" in said and "new (trained from scratch): none" in said
    for k, v in trained.state_dict().items():
        torch.testing.assert_close(module.state_dict()[k], v, rtol=0, atol=0)


def test_init_from_a_checkpoint_without_a_stored_config_is_read_by_its_tensors(tmp_path):
    static = static_module()
    module, said = init_from(save_checkpoint(static, tmp_path / "bare.ckpt"))
    assert "decoder (" in said and "every frame starts as the static head's vehicle logits" in said
    legacy = {"state_dict": {"net.camera_encoder.head.weight": torch.zeros(1), "net.future.x": torch.zeros(1)}}
    from bev.utils.legacy import upgrade_network

    assert upgrade_network(legacy) and list(legacy["state_dict"]) == [
        "net.camera.encoder.head.weight",
        "net.heads.motion.future.x",
    ]


def test_init_from_a_static_head_of_other_classes_leaves_the_future(tmp_path):
    torch.manual_seed(1)
    other = BEVLitModule(static_net(num_classes=3), torch.optim.Adam, segmentation=dict(object_classes=["a", "b", "c"]))
    _, said = init_from(save_checkpoint(other, tmp_path / "other.ckpt", STATIC_CONFIG))
    assert "the static head did not fit" in said and "heads.segmentation.conv.weight" in said


@pytest.mark.parametrize(
    "target, kind",
    [
        ("bev.models.LiftSplatShoot", "static"),
        ("bev.models.lss.LiftSplatShoot", "static"),
        ("bev.models.temporal.TemporalLiftSplat", "temporal"),
        ("bev.models.occupancy.OccupancyNet", "occupancy"),
        ("bev.models.BEVNet", None),
        ("os.system", None),  # a name only: nothing is imported
        (None, None),
    ],
)
def test_the_earlier_layouts_are_told_by_the_stored_config(target, kind):
    from bev.utils.legacy import legacy_kind

    assert legacy_kind({} if target is None else {"_target_": target}) == kind


def test_init_from_is_not_applied_on_resume_and_its_absence_is_said(capsys):
    module = tiny_module(init_from="/nonexistent/static.ckpt")
    module._trainer = SimpleNamespace(ckpt_path="last.ckpt", is_global_zero=True)
    module.on_fit_start()
    assert "not applied: resuming from last.ckpt" in capsys.readouterr().out
    module = tiny_module()
    module._trainer = SimpleNamespace(ckpt_path=None, is_global_zero=True)
    module.on_fit_start()
    assert "starts from scratch" in capsys.readouterr().out


def test_init_from_refuses_a_checkpoint_that_fits_nothing(tmp_path):
    torch.save({"state_dict": {"net.other.weight": torch.zeros(3)}, "bev_config": STATIC_CONFIG}, tmp_path / "x.ckpt")
    with pytest.raises(ValueError, match=r"model.init_from: none of .*x.ckpt's network tensors fit this model"):
        init_from(str(tmp_path / "x.ckpt"))


def test_a_training_step_and_its_checkpoint_reads_with_weights_only(tmp_path):
    """A config-built module (DictConfig arguments, as bev-train passes them) trains and saves a checkpoint
    that torch.load(weights_only=True) reads, hyper-parameters included."""
    import lightning as L
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from bev.utils.checkpoint import read_checkpoint

    cfg = OmegaConf.create(
        {
            "_target_": "bev.lit.BEVLitModule",
            "tasks": ["segmentation", "motion"],
            "net": {
                "_target_": "bev.models.BEVNet",
                "_convert_": "all",
                **SIZES,
                "heads": {"segmentation": {"num_classes": 2}, "motion": {"future_frames": F}},
                "temporal": {"past_frames": P},
            },
            "optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3},
            "segmentation": {
                "object_classes": ["vehicle"],
                "map_classes": ["drivable_area"],
                "pos_weight": {"vehicle": 4.0, "drivable_area": 2.0},
            },
            "motion": {"loss": {"seg_top_k": 0.25}},
            "past_no_grad": True,
        }
    )
    module = instantiate(cfg)
    batch = sequence_batch()
    loader = torch.utils.data.DataLoader([{k: v[0] for k, v in batch.items()}] * 2, batch_size=2)
    trainer = L.Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    before = module.net.heads["motion"].future.branches.motion[-1].weight.detach().clone()
    trainer.fit(module, loader)
    assert not torch.equal(before, module.net.heads["motion"].future.branches.motion[-1].weight)
    trainer.save_checkpoint(tmp_path / "t.ckpt")
    ckpt = read_checkpoint(tmp_path / "t.ckpt")
    assert ckpt["hyper_parameters"]["motion"] == {"loss": {"seg_top_k": 0.25}}
    assert ckpt["hyper_parameters"]["past_no_grad"] is True


def test_bev_train_runs_the_temporal_experiment(synthetic_root, tmp_path, monkeypatch, capsys):
    """experiment=synthetic_temporal_cpu through bev-train on the synthetic fixture (3 key frames per scene:
    windows of 2 input frames and 1 future frame), one fast_dev_run batch of training and validation."""
    from helpers.cli import TINY, train_cli

    args = [
        "experiment=synthetic_temporal_cpu",
        *TINY[1:],
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={tmp_path}",
        "data.past_frames=1",
        "data.future_frames=1",
        "data.input_memo_mb=0",
        "+trainer.fast_dev_run=1",
    ]
    assert train_cli(args, monkeypatch) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "starts from scratch" in out
    metrics = json.loads((tmp_path / "metrics.json").read_text())["metrics"]
    for key in (
        "val/iou",
        "val/future_iou_long",
        "val/future_iou_short",
        "val/vpq_long",
        "val/vpq_short",
        "train/flow_loss_step",
    ):
        assert key in metrics, sorted(metrics)


@pytest.mark.parametrize(
    "static, temporal", [("synthetic_cpu", "synthetic_temporal_cpu"), ("fiery_nuscenes_static", "fiery_nuscenes")]
)
def test_every_weight_of_the_first_stage_fits_the_second(static, temporal):
    """The two-stage experiments: the static run's network tensors all load into the temporal model."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from bev.utils.config import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfgs = [
            compose("train", overrides=[f"experiment={e}", "model.net.camera.weights=null"]) for e in (static, temporal)
        ]
    first, second = (instantiate(c.model).state_dict() for c in cfgs)
    net = {k: v.shape for k, v in first.items() if k.startswith("net.")}
    assert net and all(k in second and second[k].shape == s for k, s in net.items())
    assert {"net.temporal.mix.1.weight", "net.heads.motion.future.branches.motion.0.weight"} <= set(second)
    data = cfgs[1].data
    assert (data.past_frames, data.future_frames) == (2, 4)
    if temporal == "fiery_nuscenes":  # FIERY's baseline: 224x480, depth 2-50 m in 1 m bins, 200x200 at 0.5 m
        assert list(data.final_dim) == [224, 480] and list(cfgs[1].grid.dbound) == [2.0, 50.0, 1.0]
        assert list(cfgs[1].grid.xbound) == [-50.0, 50.0, 0.5] and list(cfgs[1].grid.ybound) == [-50.0, 50.0, 0.5]


def scene_windows(starts: list[int], frames: int = 8, seed: int = 3) -> dict:
    """Windows of one scene: window k holds frames k .. k + P (the same images for the same frame)."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(frames, N, 3, *SIZES["image_size"], generator=g)
    batch = sequence_batch()
    batch = {k: v[: len(starts)] for k, v in batch.items()}
    batch["images"] = torch.stack([images[s : s + P + 1] for s in starts])
    batch["sample_tokens"] = [[f"frame{s + t}" for t in range(P + 1 + F)] for s in starts]
    return batch


def frozen_bn(module):
    """Training mode with every BatchNorm on its running statistics: outputs independent of batch composition."""
    module.train()
    for m in module.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eval()
    return module


def test_past_cache_serves_frames_earlier_steps_computed():
    cached = frozen_bn(tiny_module(past_no_grad=True, past_cache_mb=64))
    torch.nn.init.normal_(cached.net.temporal.mix[-1].weight, std=0.1)  # the past reaches the outputs
    plain = frozen_bn(tiny_module(past_no_grad=True))
    plain.load_state_dict(cached.state_dict())
    first, second = scene_windows([0, 1]), scene_windows([2, 3])  # frames 0..3, then 2..5
    with torch.no_grad():
        for batch, hits in ((first, 0.0), (second, 0.75)):  # second: frames 2, 3 (twice) cached, 4 not
            out, want = cached(batch), plain(batch)
            assert cached.past_cache_hits == hits
            for k in ("segmentation", "motion"):
                torch.testing.assert_close(out[k], want[k], rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # cached features are those of the weights that computed them
        for p in cached.net.camera.encoder.parameters():
            p.add_(0.05)
        again = cached(second)
    assert cached.past_cache_hits == 1.0
    fresh = frozen_bn(tiny_module(past_no_grad=True))
    fresh.load_state_dict(cached.state_dict())
    with torch.no_grad():
        assert not torch.allclose(again["segmentation"], fresh(second)["segmentation"], atol=1e-4)


def test_past_cache_keys_age_and_size():
    from bev.models.past_cache import PastFeatureCache, frame_keys

    batch = scene_windows([0, 1])
    keys = frame_keys(batch, P)
    assert keys[0][1] == keys[1][0]  # frame 1: past of window 0 and of window 1
    batch["post_rots"] = batch["post_rots"].clone()
    batch["post_rots"][1, 0, 0, 0, 0] += 0.1  # another augmentation of the same frame: another key
    assert frame_keys(batch, P)[1][0] != keys[0][1]
    cache = PastFeatureCache(limit_mb=0.75, max_age=5)  # room for three 256 KiB tensors
    t = [torch.zeros(2**16) for _ in range(4)]  # 256 KiB each
    for i in range(3):
        cache.put(i, t[i], step=i)
    assert cache.get(0, step=3) is t[0]  # now the most recently used
    cache.put(3, t[3], step=3)  # evicts 1, the least recently used
    assert cache.get(1, step=3) is None and cache.get(2, step=3) is t[2] and cache.get(0, step=3) is t[0]
    assert cache.get(0, step=6) is None  # 6 steps old
    with pytest.raises(ValueError, match="past_no_grad"):
        tiny_module(past_cache_mb=8)


def test_the_probabilistic_future_adds_a_kl_term_that_trains_both_distributions():
    module = tiny_module(net={"probabilistic": True}).train()
    batch = sequence_batch()
    loss, terms = module.losses(module(batch), batch)
    assert "kl" in terms and terms["kl"].item() >= 0
    loss.backward()
    for dist in (module.net.heads["motion"].present_dist, module.net.heads["motion"].future_dist):
        assert dist.net[-1].weight.grad.abs().sum() > 0
    with torch.no_grad():
        assert "future_mu" not in module.eval()(batch)["motion"]  # inference: the present distribution's mean


def test_present_copied_repeats_the_present_heads_with_zero_flow():
    g = torch.Generator().manual_seed(0)
    out = {
        k: torch.randn(2, 5, c, 6, 7, generator=g)
        for k, c in (("segmentation", 1), ("centerness", 1), ("offset", 2), ("flow", 2))
    }
    copied = present_copied(out)
    for k in ("segmentation", "centerness", "offset"):
        assert copied[k].shape == out[k].shape
        assert torch.equal(copied[k], out[k][:, :1].expand_as(out[k]))
    assert copied["flow"].shape == out["flow"].shape and not copied["flow"].any()


def test_init_from_starts_a_detection_model_from_a_static_one(tmp_path, capsys):
    """model.init_from is the static module's too: a multi-task model with a detection head starts from a
    segmentation checkpoint, its shared encoders loaded, its detection head new."""
    static = static_module()
    path = save_checkpoint(static, tmp_path / "static.ckpt", STATIC_CONFIG)
    torch.manual_seed(2)
    heads = {"segmentation": {"num_classes": 2}, "detection": {"shared_channels": 8, "head_channels": 0}}
    net = BEVNet(**SIZES, heads=heads)
    det = BEVLitModule(
        net,
        torch.optim.Adam,
        segmentation=dict(object_classes=["vehicle"], map_classes=["drivable_area"]),
        tasks=["segmentation", "detection"],
        init_from=path,
    )
    det._trainer = SimpleNamespace(ckpt_path=None, is_global_zero=True)
    det.on_fit_start()
    said = capsys.readouterr().out
    theirs, own = static.state_dict(), det.state_dict()
    shared = [k for k in theirs if k.startswith("net.")]
    assert shared and all(torch.equal(own[k], theirs[k]) for k in shared)
    assert "model.init_from: loaded" in said and "new (trained from scratch): heads.detection (" in said, said


def test_a_detection_decoder_of_its_own_starts_as_the_loaded_shared_one_once(tmp_path, capsys):
    static = static_module()
    path = save_checkpoint(static, tmp_path / "static.ckpt", STATIC_CONFIG)
    heads = {"segmentation": {"num_classes": 2}, "detection": {"shared_channels": 8, "head_channels": 0}}
    net = BEVNet(**{**SIZES, "decoder": {**SIZES["decoder"], "task_decoders": True}}, heads=heads)
    det = BEVLitModule(
        net,
        torch.optim.Adam,
        segmentation=dict(object_classes=["vehicle"], map_classes=["drivable_area"]),
        tasks=["segmentation", "detection"],
        init_from=path,
    )
    det._trainer = SimpleNamespace(ckpt_path=None, is_global_zero=True)
    det.on_fit_start()
    said = capsys.readouterr().out
    assert said.count("detection decoder: a copy of the loaded segmentation decoder") == 1, said
    for mine, theirs in (("det_up1", "up1"), ("det_up2", "up2")):
        a, b = getattr(det.net.decoder, mine).state_dict(), getattr(det.net.decoder, theirs).state_dict()
        assert all(torch.equal(x, y) for x, y in zip(a.values(), b.values()))
