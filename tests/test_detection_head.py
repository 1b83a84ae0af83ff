"""The CenterPoint-style detection head: targets, head, loss and decoding, checked against independent
computations (hand-built maps, explicit loops, the CornerNet quadratics' roots)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bev.classes import DETECTION_CLASSES, DETECTION_GROUPS
from bev.geometry import Grid
from bev.tasks.detection.decode import CIRCLE_NMS_SQUARED, decode, rotated_nms
from bev.tasks.detection.head import CenterHead
from bev.tasks.detection.loss import DetectionLoss
from bev.tasks.detection.targets import REGRESSION_FIELDS, encode_targets, gaussian_radius, heatmap_radius

GRID = Grid(xbound=(-20.0, 20.0, 0.5), ybound=(-16.0, 16.0, 0.5))  # X = 80, Y = 64: not square, to catch swaps
GROUP_OF = {name: g for g, group in enumerate(DETECTION_GROUPS) for name in group}
CLS = {name: k for k, name in enumerate(DETECTION_CLASSES)}


def _box(x, y, z=0.5, w=1.9, l=4.5, h=1.6, yaw=0.3, vx=1.0, vy=-0.5):
    return [x, y, z, w, l, h, yaw, vx, vy]


def _random_scene(rng, n=12):
    """Boxes in distinct cells far enough apart that no two same-group peaks touch."""
    boxes, labels, used = [], [], []
    while len(boxes) < n:
        x, y = rng.uniform(-19.9, 19.9), rng.uniform(-15.9, 15.9)
        if any(math.hypot(x - u, y - v) < 4.0 for u, v in used):
            continue
        used.append((x, y))
        size = rng.uniform(0.4, 6.0, 3)
        boxes.append(_box(x, y, rng.uniform(-2, 2), *size, rng.uniform(-math.pi, math.pi), *rng.normal(0, 3, 2)))
        labels.append(rng.integers(len(DETECTION_CLASSES)))
    return np.array(boxes, np.float32), np.array(labels, np.int64)


def _perfect_maps(targets, grid=GRID, peak=30.0):
    """Head outputs that are exactly right, built cell by cell from the targets (no gather)."""
    nx, ny = grid.bev_shape
    heatmap = torch.full((1, len(DETECTION_CLASSES), nx, ny), -peak)
    regression = torch.zeros(1, len(DETECTION_GROUPS), len(REGRESSION_FIELDS), nx, ny)
    for slot in np.flatnonzero(targets["det_mask"]):
        ix, iy = divmod(int(targets["det_index"][slot]), ny)
        label = int(targets["det_label"][slot])
        heatmap[0, label, ix, iy] = peak
        regression[0, GROUP_OF[DETECTION_CLASSES[label]], :, ix, iy] = torch.from_numpy(targets["det_target"][slot])
    return heatmap, regression


def _batch(targets_list):
    return {k: torch.stack([torch.from_numpy(t[k]) for t in targets_list]) for k in targets_list[0]}


# --- targets ----------------------------------------------------------------------------------------------


def _peers_radius_from_roots(h, w, o):
    """The peers' three radii written through the roots of CornerNet's quadratics (np.roots): case 1 the
    larger root of r^2 - (h+w) r + hw(1-o)/(1+o); case 2 four times the larger root of
    4r^2 - 2(h+w) r + (1-o)hw; case 3 -4o times the smaller root of 4o r^2 - 2o(h+w) r + (o-1)hw."""
    r1 = max(np.roots([1, -(h + w), h * w * (1 - o) / (1 + o)]).real)
    r2 = 4 * max(np.roots([4, -2 * (h + w), (1 - o) * h * w]).real)
    r3 = -4 * o * min(np.roots([4 * o, -2 * o * (h + w), (o - 1) * h * w]).real)
    return min(r1, r2, r3)


@pytest.mark.parametrize("l,w", [(9.2, 3.9), (22.0, 5.8), (1.4, 1.4), (0.8, 0.8), (1.0, 5.0), (30.0, 2.0)])
@pytest.mark.parametrize("overlap", [0.1, 0.5])
def test_gaussian_radius_is_the_peers_formula(l, w, overlap):
    assert gaussian_radius(l, w, overlap) == pytest.approx(_peers_radius_from_roots(l, w, overlap), rel=1e-9)


def test_heatmap_radius_pinned_values():
    # car 4.6 x 1.95 m and bus 11 x 2.9 m at 0.5 m cells: the peers' radii 2.52 and 4.55 cells -> 2 and 4;
    # a pedestrian's 0.61 -> the minimum radius 2.
    assert heatmap_radius(4.6 / 0.5, 1.95 / 0.5) == 2
    assert heatmap_radius(11 / 0.5, 2.9 / 0.5) == 4
    assert heatmap_radius(0.7 / 0.5, 0.7 / 0.5) == 2
    assert heatmap_radius(0.7 / 0.5, 0.7 / 0.5, min_radius=1) == 1


def test_heatmap_peak_is_one_at_the_centre_cell_with_the_gaussian_around_it():
    box = _box(3.26, -5.9, w=2.9, l=11.0)  # a bus: radius 4 cells
    t = encode_targets(np.array([box], np.float32), np.array([CLS["bus"]]), GRID)
    heat = t["det_heatmap"]
    ix, iy = math.floor((3.26 + 20) / 0.5), math.floor((-5.9 + 16) / 0.5)
    assert heat[CLS["bus"], ix, iy] == 1.0
    assert np.unravel_index(heat[CLS["bus"]].argmax(), heat.shape[1:]) == (ix, iy)
    others = np.delete(heat, CLS["bus"], axis=0)
    assert not others.any()
    r, sigma = 4, 9 / 6
    for d in range(-r, r + 1):  # along x and along y: exp(-d^2 / (2 sigma^2)), zero past the radius
        expected = math.exp(-d * d / (2 * sigma * sigma))
        assert heat[CLS["bus"], ix + d, iy] == pytest.approx(expected, rel=1e-6)
        assert heat[CLS["bus"], ix, iy + d] == pytest.approx(expected, rel=1e-6)
    assert heat[CLS["bus"], ix + r + 1, iy] == 0 and heat[CLS["bus"], ix, iy - r - 1] == 0
    assert heat[CLS["bus"], ix + 2, iy - 3] == pytest.approx(math.exp(-13 / (2 * sigma * sigma)), rel=1e-6)
    assert (heat[CLS["bus"]] > 0).sum() == (2 * r + 1) ** 2


def test_overlapping_peaks_take_the_maximum_and_clip_at_the_edges():
    boxes = np.array([_box(0.1, 0.1), _box(1.1, 0.1), _box(-19.9, 15.9)], np.float32)  # the last one in a corner
    t = encode_targets(boxes, np.array([0, 0, 0]), GRID)
    heat = t["det_heatmap"][0]
    assert heat.max() == 1.0 and heat[40, 32] == 1.0 and heat[42, 32] == 1.0 and heat[0, 63] == 1.0
    alone = encode_targets(boxes[:1], np.array([0]), GRID)["det_heatmap"][0]
    assert heat[41, 32] == pytest.approx(alone[41, 32])  # the max of two equal neighbours' values, not their sum
    assert (heat[:3, 61:] > 0).all() and heat.sum() < 3 * 25


def test_targets_values_layout_and_dropped_boxes():
    boxes = np.array(
        [
            _box(-0.26, 0.74, z=1.2, w=2.0, l=5.0, h=1.5, yaw=-2.0, vx=3.0, vy=4.0),
            _box(25.0, 0.0),  # outside the grid along x
            _box(0.0, -16.01),  # outside along y (floor puts it in cell -1)
            _box(5.0, 5.0),  # ignored by its label
            _box(7.0, -7.0, vx=float("nan"), vy=float("nan")),
        ],
        np.float32,
    )
    labels = np.array([CLS["truck"], 0, 0, -1, CLS["pedestrian"]])
    t = encode_targets(boxes, labels, GRID, max_objects=4)
    assert t["det_mask"].tolist() == [True, True, False, False]
    assert t["det_label"].tolist() == [CLS["truck"], CLS["pedestrian"], -1, -1]
    assert t["det_index"][0] == 39 * 64 + 33  # floor((-0.26 + 20) / 0.5) = 39, floor((0.74 + 16) / 0.5) = 33
    expected = [0.48, 0.48, 1.2, math.log(2.0), math.log(5.0), math.log(1.5), math.sin(-2.0), math.cos(-2.0), 3, 4]
    np.testing.assert_allclose(t["det_target"][0], expected, atol=1e-5)
    assert t["det_vel_mask"].tolist() == [True, False, False, False]
    assert np.isfinite(t["det_target"]).all() and not t["det_target"][1, 8:].any()
    assert t["det_heatmap"].sum(axis=(1, 2)).nonzero()[0].tolist() == [CLS["truck"], CLS["pedestrian"]]
    shapes = {k: (v.shape, v.dtype) for k, v in t.items()}
    assert shapes == {
        "det_heatmap": ((10, 80, 64), np.float32),
        "det_index": ((4,), np.int64),
        "det_label": ((4,), np.int64),
        "det_mask": ((4,), np.bool_),
        "det_target": ((4, 10), np.float32),
        "det_vel_mask": ((4,), np.bool_),
    }


def test_targets_beyond_max_objects_keep_their_peaks():
    boxes = np.array([_box(-10, 0), _box(0, 0), _box(10, 0)], np.float32)
    t = encode_targets(boxes, np.array([0, 0, 0]), GRID, max_objects=2)
    assert t["det_mask"].all() and (t["det_heatmap"][0] == 1).sum() == 3


def test_targets_without_boxes():
    t = encode_targets(np.zeros((0, 9), np.float32), np.zeros(0, np.int64), GRID)
    assert not t["det_heatmap"].any() and not t["det_mask"].any() and t["det_target"].shape == (500, 10)


@pytest.mark.parametrize(
    "boxes,labels,match",
    [
        (np.zeros((2, 7)), np.zeros(2, np.int64), r"\(M, 9\)"),
        (np.array([_box(0, 0)]), np.array([10]), "class ids"),
        (np.array([_box(0, 0)]), np.array([0.0]), "integers"),
        (np.array([_box(0, 0, w=0.0)]), np.array([0]), "w, l, h > 0"),
        (np.array([_box(float("nan"), 0)]), np.array([0]), "label -1"),
    ],
)
def test_targets_bad_input(boxes, labels, match):
    with pytest.raises(ValueError, match=match):
        encode_targets(boxes, labels, GRID)


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match="contiguous runs"):
        CenterHead(8, groups=(("truck", "car"),) + DETECTION_GROUPS[1:])


# --- decode -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_encode_then_decode_round_trip(seed):
    boxes, labels = _random_scene(np.random.default_rng(seed))
    boxes[0, 6] = -math.pi  # the edge of [-pi, pi) comes back as -pi
    boxes[1, :2] = [-20.0, -16.0]  # exactly on the grid's lower corner
    t = encode_targets(boxes, labels, GRID)
    heatmap, regression = _perfect_maps(t)
    for nms in (None, "circle", "rotated"):
        (out,) = decode(heatmap, regression, GRID, nms=nms)
        assert len(out["boxes"]) == len(boxes)
        assert (out["scores"] > 0.99).all()
        order = np.lexsort((boxes[:, 1], boxes[:, 0]))
        got = out["boxes"].numpy()
        got_order = np.lexsort((got[:, 1], got[:, 0]))
        got, got_labels = got[got_order], out["labels"].numpy()[got_order]
        want = boxes[order]
        assert got_labels.tolist() == labels[order].tolist()
        np.testing.assert_allclose(got[:, :3], want[:, :3], atol=1e-4)  # centre, metres
        np.testing.assert_allclose(got[:, 3:6], want[:, 3:6], rtol=1e-5)
        dyaw = (got[:, 6] - want[:, 6] + math.pi) % (2 * math.pi) - math.pi
        np.testing.assert_allclose(dyaw, 0, atol=1e-5)
        assert (got[:, 6] >= -math.pi).all() and (got[:, 6] < math.pi).all()
        np.testing.assert_allclose(got[:, 7:], want[:, 7:], atol=1e-5)


def _single_peaks(grid, peaks):
    """Maps with logit +5 (score 0.993) at each (class, ix, iy, score_logit) peak and zero regression."""
    nx, ny = grid.bev_shape
    heatmap = torch.full((1, len(DETECTION_CLASSES), nx, ny), -10.0)
    for label, ix, iy, logit in peaks:
        heatmap[0, label, ix, iy] = logit
    return heatmap, torch.zeros(1, len(DETECTION_GROUPS), len(REGRESSION_FIELDS), nx, ny)


def test_circle_nms_removes_a_duplicate_within_the_radius_and_keeps_other_groups():
    peaks = [
        (CLS["car"], 40, 32, 5.0),
        (CLS["car"], 43, 32, 4.0),  # 1.5 m away: within the car's 2 m, removed
        (CLS["car"], 45, 32, 3.0),  # 2.5 m from the first: kept
        (CLS["pedestrian"], 43, 32, 2.0),  # another group at the removed car's place: kept
        (CLS["traffic_cone"], 44, 32, 1.0),  # pedestrian's group, 0.5 m > sqrt(0.175) = 0.42 m away: kept
    ]
    heatmap, regression = _single_peaks(GRID, peaks)
    (none,) = decode(heatmap, regression, GRID, nms=None)
    (nms,) = decode(heatmap, regression, GRID, nms="circle")
    assert len(none["boxes"]) == 5
    assert nms["labels"].tolist() == [CLS["car"], CLS["car"], CLS["pedestrian"], CLS["traffic_cone"]]
    np.testing.assert_allclose(nms["scores"].numpy(), torch.sigmoid(torch.tensor([5.0, 3.0, 2.0, 1.0])).numpy())
    # Within the pedestrian's radius the cone (same group, lower score) goes.
    heatmap, regression = _single_peaks(GRID, [(CLS["pedestrian"], 43, 32, 2.0), (CLS["traffic_cone"], 43, 32, 1.0)])
    (nms,) = decode(heatmap, regression, GRID, nms="circle")
    assert nms["labels"].tolist() == [CLS["pedestrian"]]
    assert CIRCLE_NMS_SQUARED[GROUP_OF["car"]] == 4.0


def _car(x, y=0.0, yaw=0.0, w=2.0, l=4.0):
    return [x, y, 1.0, w, l, 1.5, yaw, 0.0, 0.0]


def test_rotated_nms_drops_by_footprint_iou_within_a_group():
    # Same width, l = 4 m, offset d along x: IoU = (l - d) / (l + d), 0.25 at d = 2.4 m and 0.15 at 2.96 m.
    boxes = torch.tensor([_car(10), _car(12.4), _car(30), _car(32.96)])
    group = torch.zeros(4, dtype=torch.long)
    assert rotated_nms(boxes, group, 0.2).tolist() == [0, 2, 3]
    assert rotated_nms(boxes, group, 0.3).tolist() == [0, 1, 2, 3]
    # Crossed at the same centre: intersection 2 x 2, union 12, IoU 1/3; another group is never dropped.
    crossed = torch.tensor([_car(0), _car(0, yaw=math.pi / 2), _car(0, yaw=math.pi / 2)])
    assert rotated_nms(crossed, torch.tensor([0, 0, 1]), 0.2).tolist() == [0, 2]
    # Side by side 1.95 m apart (width 1.9): no overlap, both kept, where circle NMS (2 m) keeps one.
    side = torch.tensor([_car(0, 0, w=1.9), _car(0, 1.95, w=1.9)])
    assert rotated_nms(side, torch.zeros(2, dtype=torch.long)).tolist() == [0, 1]
    assert rotated_nms(torch.zeros(0, 9), torch.zeros(0, dtype=torch.long)).tolist() == []


def test_decode_peaks_threshold_and_top_k():
    heatmap, regression = _single_peaks(GRID, [(0, 10, 10, 3.0), (0, 11, 10, 2.0), (1, 50, 50, -3.0)])
    (out,) = decode(heatmap, regression, GRID, nms=None)
    assert out["labels"].tolist() == [0]  # (11, 10) is no 3x3 peak; score sigmoid(-3) = 0.05 < 0.1
    rng = torch.Generator().manual_seed(0)
    heatmap = torch.randn(2, 10, 80, 64, generator=rng) + 3
    outs = decode(heatmap, torch.zeros(2, 6, 10, 80, 64), GRID, nms=None)
    assert [len(o["boxes"]) for o in outs] == [500, 500]
    assert all((o["scores"][:-1] >= o["scores"][1:]).all() for o in outs)
    with pytest.raises(ValueError, match="top_k"):
        decode(heatmap, torch.zeros(2, 6, 10, 80, 64), GRID, top_k=501)
    with pytest.raises(ValueError, match=r"\(X, Y\) = \(80, 64\)"):
        decode(heatmap.transpose(2, 3), torch.zeros(2, 6, 10, 64, 80), GRID)


# --- head -------------------------------------------------------------------------------------------------


def test_head_shapes_and_initial_heatmap_bias():
    head = CenterHead(8, shared_channels=16, head_channels=8).eval()
    out = head(torch.zeros(2, 8, 20, 12))
    assert set(out) == {"heatmap", "regression"}
    assert out["heatmap"].shape == (2, 10, 20, 12) and out["regression"].shape == (2, 6, 10, 20, 12)
    torch.testing.assert_close(out["heatmap"], torch.full_like(out["heatmap"], -2.19))
    assert not out["regression"].any()


def test_head_branches_are_independent():
    """Each output of each group depends on its own hidden channels only (separate heads in one conv)."""
    torch.manual_seed(0)
    head = CenterHead(4, shared_channels=8, head_channels=3).eval()
    x = torch.randn(1, 4, 9, 7)
    before = head(x)
    branch = 2 * 6 + 3  # group 2 (bus, trailer): heatmap, reg, height, dim <- this one
    with torch.no_grad():
        head.hidden[0].weight[branch * 3 : (branch + 1) * 3] += 1.0
    after = head(x)
    changed = (after["regression"] != before["regression"]).flatten(3).any(-1)[0]  # (G, R)
    expected = torch.zeros(6, 10, dtype=torch.bool)
    expected[2, 3:6] = True
    assert torch.equal(changed, expected)
    assert torch.equal(after["heatmap"], before["heatmap"])


# --- loss -------------------------------------------------------------------------------------------------


def _naive_loss(heatmap, regression, batch):
    """The loss written out with loops and boolean indexing, per group as CenterPoint's CenterHead."""
    total_heat, total_reg = 0.0, 0.0
    code = torch.tensor([1.0] * 8 + [0.2] * 2)
    for g, group in enumerate(DETECTION_GROUPS):
        cls = [CLS[n] for n in group]
        p, t = torch.sigmoid(heatmap[:, cls].double()), batch["det_heatmap"][:, cls].double()
        pos = t == 1
        pos_loss = -(torch.log(p[pos]) * (1 - p[pos]) ** 2).sum()
        neg_loss = -(torch.log(1 - p[~pos]) * p[~pos] ** 2 * (1 - t[~pos]) ** 4).sum()
        total_heat += (pos_loss + neg_loss) / max(1, int(pos.sum()))
        l1, n = 0.0, 0
        for b in range(heatmap.shape[0]):
            for s in range(batch["det_mask"].shape[1]):
                if batch["det_mask"][b, s] and int(batch["det_label"][b, s]) in cls:
                    ix, iy = divmod(int(batch["det_index"][b, s]), heatmap.shape[3])
                    w = code.clone()
                    if not batch["det_vel_mask"][b, s]:
                        w[8:] = 0
                    l1 += ((regression[b, g, :, ix, iy] - batch["det_target"][b, s]).abs() * w).sum()
                    n += 1
        total_reg += l1 / max(1, n)
    return total_heat, total_reg


def _two_samples():
    rng = np.random.default_rng(5)
    targets = []
    for _ in range(2):
        boxes, labels = _random_scene(rng, n=8)
        boxes[2, 7:] = np.nan
        targets.append(encode_targets(boxes, labels, GRID, max_objects=16))
    return _batch(targets)


def test_loss_matches_a_naive_computation():
    batch = _two_samples()
    torch.manual_seed(1)
    heatmap, regression = torch.randn(2, 10, 80, 64) * 2 - 2, torch.randn(2, 6, 10, 80, 64)
    heatmap[batch["det_heatmap"] == 1] = 0.7  # some positives with a finite loss
    out = DetectionLoss()({"heatmap": heatmap, "regression": regression}, batch)
    heat, reg = _naive_loss(heatmap, regression, batch)
    assert out["heatmap"].item() == pytest.approx(float(heat), rel=1e-5)
    assert out["regression"].item() == pytest.approx(float(reg), rel=1e-5)
    assert out["loss"].item() == pytest.approx(float(heat) + 0.25 * float(reg), rel=1e-5)


def test_loss_is_zero_on_perfect_predictions_and_ignores_unknown_velocity():
    batch = _two_samples()
    maps = [_perfect_maps({k: v[i].numpy() for k, v in batch.items()}) for i in range(2)]
    heatmap, regression = torch.cat([m[0] for m in maps]), torch.cat([m[1] for m in maps])
    out = DetectionLoss()({"heatmap": heatmap, "regression": regression}, batch)
    assert out["loss"].item() < 1e-6
    slot = int(np.flatnonzero(~batch["det_vel_mask"][0].numpy() & batch["det_mask"][0].numpy())[0])
    ix, iy = divmod(int(batch["det_index"][0, slot]), 64)
    regression[0, GROUP_OF[DETECTION_CLASSES[int(batch["det_label"][0, slot])]], 8:, ix, iy] = 7.0
    assert DetectionLoss()({"heatmap": heatmap, "regression": regression}, batch)["loss"].item() < 1e-6
    regression[0, :, 2, ix, iy] = 1.0  # a wrong height is counted
    assert DetectionLoss()({"heatmap": heatmap, "regression": regression}, batch)["regression"].item() > 0.01


def test_loss_decreases_on_a_tiny_overfit():
    grid = Grid(xbound=(-5.0, 5.0, 0.5), ybound=(-4.0, 4.0, 0.5))
    boxes = np.array([_box(2.2, 1.3), _box(-3.0, -2.1, w=0.6, l=0.7, h=1.7, yaw=1.0, vx=1.2, vy=0.0)], np.float32)
    batch = _batch([encode_targets(boxes, np.array([CLS["car"], CLS["pedestrian"]]), grid, max_objects=4)])
    torch.manual_seed(0)
    head = CenterHead(4, shared_channels=8, head_channels=2)
    features = torch.randn(1, 4, *grid.bev_shape)
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    criterion = DetectionLoss()
    losses = []
    for _ in range(20):
        loss = criterion(head(features), batch)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0], losses[::10]


class _HostSyncs(TorchDispatchMode):
    """Records the ops that make the host wait for the device on a GPU (.item(), bool(), nonzero, boolean
    indexing, unique) or copy Python data to it (torch.tensor of a list: lift_fresh)."""

    SYNCING = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::lift_fresh", "aten::unique")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        indices = args[1] if name.startswith("aten::index") and len(args) > 1 else ()
        bool_index = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
        if name.startswith(self.SYNCING) or bool_index:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "syncing",
    [
        lambda x: x / x.max().item(),
        lambda x: x[x > 0].sum(),
        lambda x: x.nonzero().float().sum(),
        lambda x: x * torch.tensor([2.0]),
        lambda x: x * 2 if x.sum() > 0 else x,
    ],
)
def test_the_host_sync_detector_sees_syncs(syncing):
    with _HostSyncs() as mode:
        syncing(torch.randn(5))
    assert mode.seen


def test_loss_has_no_host_sync_forward_and_backward():
    batch = _two_samples()
    criterion = DetectionLoss()
    heatmap = torch.randn(2, 10, 80, 64, requires_grad=True)
    regression = torch.randn(2, 6, 10, 80, 64, requires_grad=True)
    with _HostSyncs() as mode:
        loss = criterion({"heatmap": heatmap, "regression": regression}, batch)["loss"]
        loss.backward()
    assert mode.seen == []
    assert regression.grad.abs().sum() > 0


def test_loss_compiles_to_one_graph():
    batch = _two_samples()
    heatmap = torch.randn(2, 10, 80, 64, requires_grad=True)
    regression = torch.randn(2, 6, 10, 80, 64, requires_grad=True)
    criterion = DetectionLoss()

    def step(heatmap, regression, batch):
        return criterion({"heatmap": heatmap, "regression": regression}, batch)["loss"]

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    loss = compiled(heatmap, regression, batch)
    loss.backward()
    assert loss.item() == pytest.approx(step(heatmap, regression, batch).item(), rel=1e-6)
    assert heatmap.grad is not None and regression.grad.abs().sum() > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_loss_has_no_host_sync_on_cuda():
    batch = {k: v.cuda() for k, v in _two_samples().items()}
    head = CenterHead(8).cuda()
    features = torch.randn(2, 8, 80, 64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = DetectionLoss().cuda()(head(features), batch)["loss"]
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()


@pytest.mark.slow  # ~25 s on a loaded 2-core machine
def test_head_exports_to_onnx_and_runtime_agrees(tmp_path):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install 'bev[export]')")
    pytest.importorskip("onnxscript", reason="onnxscript is not installed (pip install 'bev[export]')")
    torch.manual_seed(0)
    head = CenterHead(4, shared_channels=8, head_channels=4).eval()
    x = torch.randn(2, 4, 12, 10)
    with torch.no_grad():
        program = torch.onnx.export(
            head, (x,), dynamo=True, opset_version=18, input_names=["features"], output_names=["heatmap", "regression"]
        )
        expected = head(x)
    path = tmp_path / "head.onnx"
    path.write_bytes(program.model_proto.SerializeToString())
    heatmap, regression = ort.InferenceSession(str(path)).run(None, {"features": x.numpy()})
    np.testing.assert_allclose(heatmap, expected["heatmap"].numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(regression, expected["regression"].numpy(), rtol=1e-4, atol=1e-5)


def test_decoding_per_group_keeps_rare_classes_beside_a_crowd():
    """CenterPoint's nuScenes decoding: top-K candidates per class group, a cap per group after NMS, then the
    best `top_k` of all. Here 300 cars outscore 5 pedestrians: a global top 100 keeps cars only."""
    nx, ny = GRID.bev_shape
    heatmap = torch.full((1, len(DETECTION_CLASSES), nx, ny), -30.0)
    regression = torch.zeros(1, len(DETECTION_GROUPS), len(REGRESSION_FIELDS), nx, ny)
    cells = [(x, y) for x in range(2, nx - 2, 3) for y in range(2, ny - 2, 3)]  # 3 cells apart: all peaks
    for k, (x, y) in enumerate(cells[:300]):
        heatmap[0, CLS["car"], x, y] = 5.0 - k * 1e-3
    for k, (x, y) in enumerate(cells[300:305]):
        heatmap[0, CLS["pedestrian"], x, y] = 1.0 - k * 1e-3
    (glob,) = decode(heatmap, regression, GRID, nms=None, top_k=100)
    assert set(glob["labels"].tolist()) == {CLS["car"]}
    (per,) = decode(heatmap, regression, GRID, nms="circle", top_k=60, pre_nms_top_k=1000, post_nms_max=50)
    labels = per["labels"].tolist()
    assert labels.count(CLS["car"]) == 50 and labels.count(CLS["pedestrian"]) == 5 and len(labels) == 55
    assert (per["scores"][:-1] >= per["scores"][1:]).all()
    (capped,) = decode(heatmap, regression, GRID, nms=None, top_k=20, pre_nms_top_k=1000, post_nms_max=50)
    assert capped["labels"].tolist() == [CLS["car"]] * 20  # the best of all
    with pytest.raises(ValueError, match="pre_nms_top_k must be a whole number >= 1"):
        decode(heatmap, regression, GRID, pre_nms_top_k=0)


def test_box_frame_velocity_decodes_to_the_ego_frame_and_is_the_loss_target():
    """velocity_frame="box": the head's (along, across the heading) velocity; maps holding it, computed here by
    hand from yaw, decode to the annotated ego-frame velocity and give a zero loss, and the ego-frame maps do not."""
    boxes, labels = _random_scene(np.random.default_rng(3))
    t = encode_targets(boxes, labels, GRID)
    heatmap, regression = _perfect_maps(t)
    box_maps = regression.clone()
    for slot in np.flatnonzero(t["det_mask"]):
        ix, iy = divmod(int(t["det_index"][slot]), GRID.ny)
        g = GROUP_OF[DETECTION_CLASSES[int(t["det_label"][slot])]]
        sin, cos, vx, vy = (float(v) for v in t["det_target"][slot, 6:10])
        box_maps[0, g, 8:, ix, iy] = torch.tensor([cos * vx + sin * vy, -sin * vx + cos * vy])
    (out,) = decode(heatmap, box_maps, GRID, nms=None, velocity_frame="box")
    got = out["boxes"].numpy()
    order, got_order = np.lexsort((boxes[:, 1], boxes[:, 0])), np.lexsort((got[:, 1], got[:, 0]))
    np.testing.assert_allclose(got[got_order, 7:], boxes[order, 7:], atol=1e-4)
    batch = _batch([t])
    loss = DetectionLoss(velocity_frame="box")
    assert loss({"heatmap": heatmap, "regression": box_maps}, batch)["regression"].item() < 1e-5
    assert loss({"heatmap": heatmap, "regression": regression}, batch)["regression"].item() > 0.1
    with pytest.raises(ValueError, match="velocity_frame"):
        DetectionLoss(velocity_frame="world")
