"""BEV augmentation (BEVDet's BDA) and class-balanced sampling (CBGS): an augmented item's boxes, targets and
lift geometry agree with the unaugmented item mapped by the same matrix, each checked by an independent
computation; CBGS gives each class its share of an epoch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bev.classes import DETECTION_CLASSES, DETECTION_GROUPS
from bev.data.bev_aug import BevAugRanges, bev_matrix, transform_boxes
from bev.data.cbgs import ClassBalancedSampler, cbgs_epoch, class_samples
from bev.data.nuscenes import NuScenesBEVDataset
from bev.geometry import CAMERA_GEOMETRY, box_corners, frustum_to_ego, make_frustum
from bev.tasks.detection.decode import decode
from bev.tasks.detection.targets import REGRESSION_FIELDS

STRONG = {"rot_lim": [-60, 60], "scale_lim": [0.9, 1.1], "flip_x": 0.5, "flip_y": 0.5}
GROUP_OF = {c: g for g, names in enumerate(DETECTION_GROUPS) for c in names}


def _ds(root, bev_aug, **kw):
    return NuScenesBEVDataset(
        root, split="mini_train", augment=True, detection=True, det_range="grid", bev_aug=bev_aug, verbose=False, **kw
    )


@pytest.fixture(scope="module")
def pair(synthetic_root):
    """The same training items with and without BEV augmentation (the same image augmentations: one seed)."""
    aug, plain = _ds(synthetic_root, STRONG, map_layers="bevfusion"), _ds(synthetic_root, None, map_layers="bevfusion")
    items = []
    for seed in range(6):
        i = seed % len(aug)
        torch.manual_seed(seed)
        a = aug[i]
        torch.manual_seed(seed)
        items.append((i, a, plain[i]))
    return aug, items


def _perfect_maps(item, grid):
    """Head outputs that are exactly the item's targets (cell by cell)."""
    nx, ny = grid.bev_shape
    heatmap = torch.full((1, len(DETECTION_CLASSES), nx, ny), -30.0)
    regression = torch.zeros(1, len(DETECTION_GROUPS), len(REGRESSION_FIELDS), nx, ny)
    for slot in torch.nonzero(item["det_mask"]).flatten().tolist():
        ix, iy = divmod(int(item["det_index"][slot]), ny)
        label = int(item["det_label"][slot])
        heatmap[0, label, ix, iy] = 30.0
        regression[0, GROUP_OF[DETECTION_CLASSES[label]], :, ix, iy] = item["det_target"][slot]
    return heatmap, regression


def test_boxes_decoded_from_an_augmented_item_map_back_to_the_annotations(pair):
    ds, items = pair
    checked = 0
    for i, item, _ in items:
        A = item["bev_aug"].double().numpy()
        (out,) = decode(*_perfect_maps(item, ds.grid), ds.grid, nms=None)
        back = transform_boxes(out["boxes"].numpy(), np.linalg.inv(A))
        det = ds.detection_boxes(i)
        truth = det["boxes"][det["points"] > 0]
        assert len(back) > 0 and not np.allclose(A, np.eye(3))
        for box, label in zip(back, out["labels"].numpy()):
            k = np.argmin(np.linalg.norm(truth[:, :2] - box[:2], axis=1))
            want = truth[k]
            np.testing.assert_allclose(box[:6], want[:6], atol=2e-3, rtol=1e-4)  # centre, size
            assert abs(math.remainder(box[6] - want[6], 2 * math.pi)) < 1e-3  # yaw
            if np.isfinite(want[7:9]).all():
                np.testing.assert_allclose(box[7:9], want[7:9], atol=2e-3)
            assert DETECTION_CLASSES[label] == DETECTION_CLASSES[det["labels"][det["points"] > 0][k]]
            checked += 1
    assert checked >= 10


def test_the_lifted_frustum_moves_with_the_matrix(pair):
    ds, items = pair
    frustum = make_frustum(ds.final_dim, 16, ds.grid)
    for _, aug, plain in items:
        A = aug["bev_aug"].double()
        geo = [aug[k][None].double() for k in CAMERA_GEOMETRY]
        ref = [plain[k][None].double() for k in CAMERA_GEOMETRY]
        torch.testing.assert_close(geo[3], ref[3])  # the same image augmentation
        got = frustum_to_ego(frustum.double(), *geo)
        want = frustum_to_ego(frustum.double(), *ref) @ A.T
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_targets_are_those_of_the_augmented_frame(pair):
    """Object cells: a cell is filled when its centre, mapped back by A^-1, lies in an annotated footprint
    (the "center" rule, tested in each box's own frame); map cells: the unaugmented cell under A^-1."""
    ds, items = pair
    g, k = ds.grid, ds.num_object_classes
    cx = g.xbound[0] + (np.arange(g.nx) + 0.5) * g.xbound[2]
    cy = g.ybound[0] + (np.arange(g.ny) + 0.5) * g.ybound[2]
    centres = np.stack(np.meshgrid(cx, cy, indexing="ij"), -1)
    for i, aug, plain in items:
        A = aug["bev_aug"].double().numpy()
        back = centres @ np.linalg.inv(A[:2, :2]).T
        boxes, inside = ds.boxes(i), np.zeros((g.nx, g.ny), bool)
        for c, (w, l, _), R in zip(boxes["center"], boxes["size"], boxes["rotation"]):
            local = (back - c[:2]) @ R[:2, :2]  # box frame: x along the length
            inside |= (np.abs(local[..., 0]) <= l / 2) & (np.abs(local[..., 1]) <= w / 2)
        got = aug["bev"][0].numpy() > 0.5
        assert (got != inside).sum() <= 2 and got.sum() > 0  # cells whose centre sits on an edge may differ
        ix = np.floor((back[..., 0] - g.xbound[0]) / g.xbound[2]).astype(int)
        iy = np.floor((back[..., 1] - g.ybound[0]) / g.ybound[2]).astype(int)
        ok = (ix >= 0) & (ix < g.nx) & (iy >= 0) & (iy < g.ny)
        want = np.zeros_like(aug["bev"][k:].numpy())
        want[:, ok] = plain["bev"][k:].numpy()[:, ix[ok], iy[ok]]
        assert np.array_equal(aug["bev"][k:].numpy(), want)


def test_boxes_transform_as_the_matrix_says():
    box = np.array([[10.0, 5.0, 1.0, 2.0, 4.0, 1.5, 0.3, 3.0, -1.0]])
    A = bev_matrix(math.pi / 2, 2.0, flip_x=-1.0)  # rotate 90 deg, scale 2, then x -> -x
    (out,) = transform_boxes(box, A)
    np.testing.assert_allclose(out[:3], [10.0, 20.0, 2.0])  # (10, 5) -> (-10, 20) -> (10, 20)
    np.testing.assert_allclose(out[3:6], [4.0, 8.0, 3.0])
    np.testing.assert_allclose(out[7:9], [-2.0, 6.0])  # (3, -1) -> (1, 3) rotated -> (2, 6) scaled -> flipped
    corners = box_corners(out[None])[0, :4, :2]
    np.testing.assert_allclose(np.sort(corners, 0), np.sort(box_corners(box)[0, :4, :2] @ A[:2, :2].T, 0), atol=1e-9)


@pytest.mark.parametrize(
    "value, needle",
    [
        ("bevdt", "one of ['bevdet']"),
        ({"rot": [0, 1]}, "rot_lim"),
        ({"scale_lim": [0, 1]}, "0.5 <= lo <= hi <= 2"),
        # Out of the sane ranges: every occupancy voxel ignored, boxes of infinite size, turns past a full circle.
        ({"scale_lim": [1e30, 1e30]}, "data.bev_aug.scale_lim must be [lo, hi] with 0.5 <= lo <= hi <= 2"),
        ({"scale_lim": [1e-30, 1e-30]}, "data.bev_aug.scale_lim"),
        ({"scale_lim": [0.9, float("nan")]}, "data.bev_aug.scale_lim"),
        ({"rot_lim": [-720, 720]}, "data.bev_aug.rot_lim must be [lo, hi] with -180 <= lo <= hi <= 180"),
        ({"rot_lim": 5}, "data.bev_aug.rot_lim must be [lo, hi], two numbers"),
        ({"scale_lim": ["a", 1]}, "data.bev_aug.scale_lim must be [lo, hi], two numbers"),
        ({"flip_x": 2}, "data.bev_aug.flip_x must be a probability in [0, 1]"),
    ],
)
def test_bad_settings_are_named(value, needle):
    with pytest.raises(ValueError, match="data.bev_aug") as e:
        BevAugRanges.from_any(value)
    assert needle in str(e.value)


def test_a_temporal_window_moves_as_one(synthetic_root):
    """Every input frame's geometry, the instance maps, the flow vectors and the ego motion of a window follow
    the one matrix; centerness and offset are those of the moved instances."""
    from bev.data.temporal import centre_targets
    from bev.tasks.motion import IGNORE

    kw = dict(past_frames=1, future_frames=1, detection=True, det_range="grid", verbose=False)
    aug = NuScenesBEVDataset(synthetic_root, split="mini_train", augment=True, bev_aug=STRONG, **kw)
    plain = NuScenesBEVDataset(synthetic_root, split="mini_train", augment=True, **kw)
    torch.manual_seed(0)
    a = aug[0]
    torch.manual_seed(0)
    p = plain[0]
    A = a["bev_aug"].double()
    torch.testing.assert_close(a["rots"].double(), A @ p["rots"].double(), atol=1e-5, rtol=1e-5)
    A4 = torch.eye(4, dtype=torch.float64)
    A4[:3, :3] = A
    want = A4 @ p["future_egomotion"].double() @ torch.linalg.inv(A4)
    torch.testing.assert_close(a["future_egomotion"].double(), want, atol=1e-5, rtol=1e-5)
    g = aug.grid
    centres = torch.stack(
        torch.meshgrid(
            *(
                torch.tensor(g.xbound[0] + (np.arange(n) + 0.5) * s)
                for n, s in ((g.nx, g.xbound[2]), (g.ny, g.ybound[2]))
            ),
            indexing="ij",
        ),
        -1,
    )
    src = centres @ torch.linalg.inv(A[:2, :2]).T
    ix = torch.floor((src[..., 0] - g.xbound[0]) / g.xbound[2]).long()
    iy = torch.floor((src[..., 1] - g.ybound[0]) / g.ybound[2]).long()
    ok = (ix >= 0) & (ix < g.nx) & (iy >= 0) & (iy < g.ny)
    moved = torch.zeros_like(p["instance"])
    moved[:, ok] = p["instance"][:, ix[ok], iy[ok]]
    assert torch.equal(a["instance"], moved) and a["instance"].max() > 0
    centerness, offset = centre_targets(a["instance"].numpy())
    assert np.array_equal(a["centerness"].numpy(), centerness) and np.array_equal(a["offset"].numpy(), offset)
    steps = torch.tensor([g.xbound[2], g.ybound[2]], dtype=torch.float64)
    t, x, y = torch.nonzero((a["flow"] != IGNORE).all(1)).T
    assert len(t) > 0
    before = p["flow"][t, :, ix[x, y], iy[x, y]].double() * steps
    torch.testing.assert_close(a["flow"][t, :, x, y].double() * steps, before @ A[:2, :2].T, atol=1e-4, rtol=1e-4)


def test_cbgs_gives_each_class_its_share():
    rng = np.random.default_rng(0)
    labels = [np.array([0])] * 80 + [np.array([0, 1])] * 15 + [np.array([2])] * 5 + [np.array([], np.int64)] * 10
    per_class = class_samples(labels, 4)
    assert [len(s) for s in per_class] == [95, 15, 5, 0]
    epoch = cbgs_epoch(per_class, torch.Generator().manual_seed(int(rng.integers(100))))
    assert len(epoch) == 3 * round(115 / 3)  # D = 95 + 15 + 5 over the 3 classes that occur
    share = [np.mean([c in labels[i] for i in epoch]) for c in range(3)]
    assert share[2] == pytest.approx(1 / 3, abs=0.01)  # only samples of class 2 hold it
    assert share[1] >= 1 / 3 - 0.01 and share[0] >= 1 / 3  # class 1 also rides along with class 0's draws


def test_cbgs_sampler_draws_the_same_epochs_in_every_process(synthetic_root):
    ds = NuScenesBEVDataset(synthetic_root, split="mini_train", detection=True, det_range="grid", verbose=False)
    a, b = ClassBalancedSampler(ds, seed=3), ClassBalancedSampler(ds, seed=3)
    first, second = list(a), list(a)
    assert first == list(b) and second == list(b) and len(first) == len(a)
    assert set(first) <= set(range(len(ds)))


def test_cbgs_over_windows_draws_windows(synthetic_root):
    ds = NuScenesBEVDataset(synthetic_root, split="mini_train", detection=True, past_frames=1, verbose=False)
    drawn = list(ClassBalancedSampler(ds))
    assert drawn and set(drawn) <= set(range(len(ds)))  # window numbers, not sample rows
