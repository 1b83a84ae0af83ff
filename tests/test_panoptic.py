"""FIERY's temporal metrics: VPQ (PanopticQuality), FutureIoU pooled over frames, and the two ranges."""

import math

import numpy as np
import pytest
import torch

from bev.geometry import Grid
from bev.tasks.motion.metric import (
    FIERY_RANGES,
    FutureIoU,
    PanopticQuality,
    crop_to_range,
    range_slices,
)

N = 12  # hand-made frames are N x N


def box(ident: int, x0: int, x1: int, y0: int, y1: int, base: torch.Tensor | None = None) -> torch.Tensor:
    f = torch.zeros(N, N, dtype=torch.int64) if base is None else base.clone()
    f[x0:x1, y0:y1] = ident
    return f


def seq(*frames: torch.Tensor) -> torch.Tensor:
    """One sequence: (1, T, N, N)."""
    return torch.stack(frames)[None]


A = box(1, 1, 4, 1, 4)  # 9 cells
B = box(2, 6, 9, 6, 10, A)  # A plus a 12-cell instance 2
EMPTY = torch.zeros(N, N, dtype=torch.int64)


def vpq(pred, gt, **kw) -> dict:
    m = PanopticQuality(**kw)
    m.update(pred, gt)
    return m.compute()


def counts(r: dict) -> tuple:
    return r["tp"], r["fp"], r["fn"]


def test_perfect_prediction_is_one_whatever_the_ids():
    for pred in (seq(B, B, B), seq(B * 7, B * 7, B * 7)):
        r = vpq(pred, seq(B, B, B))
        assert (r["pq"], r["sq"], r["rq"]) == (1.0, 1.0, 1.0)
        assert counts(r) == (6, 0, 0)


def test_missed_frame_is_one_false_negative():
    r = vpq(seq(A, EMPTY, A), seq(A, A, A))
    assert counts(r) == (2, 0, 1)
    assert r["pq"] == pytest.approx(2 / 2.5) and r["rq"] == pytest.approx(2 / 2.5) and r["sq"] == 1.0


def test_false_positive_in_every_frame():
    r = vpq(seq(B, B), seq(A, A))
    assert counts(r) == (2, 2, 0)
    assert r["pq"] == pytest.approx(2 / 3)


def test_id_swap_counts_one_false_negative_and_one_false_positive():
    a3, a4 = box(3, 1, 4, 1, 4), box(4, 1, 4, 1, 4)
    gt = seq(A, A, A)
    r = vpq(seq(a3, a4, a4), gt)  # switch at t=1, then 4 is the id to keep
    assert counts(r) == (2, 1, 1)
    assert r["iou_sum"] == 2.0 and r["pq"] == pytest.approx(2 / 3)
    assert counts(vpq(seq(a3, a4, a3), gt)) == (1, 2, 2)  # switching back is a second switch
    assert counts(vpq(seq(a3, EMPTY, a4), gt)) == (1, 1, 2)  # a gap does not forget the id
    assert counts(vpq(seq(a3, a4, a4), gt, temporally_consistent=False)) == (3, 0, 0)


def test_exchanged_ids_of_two_vehicles_are_two_switches():
    swapped = torch.where(B > 0, 3 - B, 0)
    assert counts(vpq(seq(B, swapped), seq(B, B))) == (2, 2, 2)


def test_iou_of_exactly_one_half_is_no_match():
    half = box(5, 1, 4, 1, 3)
    half[1:4, 4] = 5  # 6 of A's 9 cells + 3 others: IoU 6 / 12
    assert counts(vpq(seq(half), seq(A))) == (0, 1, 1)
    above = box(5, 1, 4, 1, 4)
    above[1:4, 4:6] = 5  # 9 / 15 > 0.5
    r = vpq(seq(above), seq(A))
    assert counts(r) == (1, 0, 0) and r["sq"] == pytest.approx(9 / 15)


def test_merged_and_split_predictions_match_nothing():
    touching = box(2, 1, 4, 4, 7, A)  # two 9-cell vehicles side by side
    assert counts(vpq(seq(torch.where(touching > 0, 1, 0)), seq(touching))) == (0, 1, 2)  # IoUs 9 / 18
    split = box(9, 6, 9, 8, 10, box(8, 6, 9, 6, 8))
    assert counts(vpq(seq(split), seq(box(2, 6, 9, 6, 10)))) == (0, 2, 1)  # IoUs 6 / 12


def test_undefined_ratios_are_nan():
    r = vpq(seq(EMPTY, EMPTY), seq(EMPTY, EMPTY))
    assert all(math.isnan(r[k]) for k in ("pq", "sq", "rq")) and counts(r) == (0, 0, 0)
    r = vpq(seq(B), seq(EMPTY))
    assert r["pq"] == 0.0 and r["rq"] == 0.0 and math.isnan(r["sq"])


def test_each_batch_item_is_its_own_sequence_and_updates_pool():
    gt, pred = random_sequences(np.random.default_rng(0), (4, 3))
    gt, pred = torch.from_numpy(gt), torch.from_numpy(pred)
    one = vpq(pred, gt)
    assert one["tp"] > 0 and one["fp"] > 0
    parts = PanopticQuality()
    parts.update(pred[:1], gt[:1])
    parts.update(pred[1:], gt[1:])
    merged = PanopticQuality()
    merged.update(pred[:3], gt[:3])
    other = PanopticQuality()
    other.update(pred[3:], gt[3:])
    merged.merge_state(other)  # what the processes' sum reduction does
    for r in (parts.compute(), merged.compute()):
        assert counts(r) == counts(one) and r["pq"] == pytest.approx(one["pq"])
    # a sequence boundary forgets ids: the second sequence's id is no switch
    assert counts(vpq(torch.cat([seq(A), seq(A * 4)]), torch.cat([seq(A), seq(A)]))) == (2, 0, 0)


def reference_counts(pred: np.ndarray, gt: np.ndarray, consistent: bool) -> tuple[int, int, int, float]:
    """Straight from the definition, one sequence, one frame and one pair at a time."""
    tp = fp = fn = 0
    iou_sum = 0.0
    for b in range(gt.shape[0]):
        last = {}
        for p, g in zip(pred[b], gt[b]):
            matched_p = set()
            for gi in np.unique(g[g > 0]):
                hit = None
                for pi in np.unique(p[p > 0]):
                    inter = np.sum((g == gi) & (p == pi))
                    union = np.sum((g == gi) | (p == pi))
                    if inter / union > 0.5:
                        hit = (pi, inter / union)
                if hit is None:
                    fn += 1
                    continue
                matched_p.add(hit[0])
                if consistent and last.get(gi, hit[0]) != hit[0]:
                    fn, fp = fn + 1, fp + 1
                else:
                    tp, iou_sum = tp + 1, iou_sum + hit[1]
                last[gi] = hit[0]
            fp += len(set(np.unique(p[p > 0])) - matched_p)
    return tp, fp, fn, iou_sum


def random_sequences(rng, bt: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(gt, pred) (B, T, 9, 9): ids on 3x3 blocks; pred with noisy cells and whole frames renumbered."""
    gt = rng.integers(0, 4, (*bt, 3, 3)).repeat(3, 2).repeat(3, 3)
    pred = np.where(rng.random(gt.shape) < 0.15, rng.integers(0, 5, gt.shape), gt)
    return gt, np.where(rng.random(bt)[..., None, None] < 0.3, (pred * 7) % 5, pred)  # 1, 2, 3, 4 -> 2, 4, 1, 3


@pytest.mark.parametrize("consistent", [True, False])
def test_random_sequences_match_a_direct_computation(consistent):
    rng = np.random.default_rng(1)
    for _ in range(20):
        gt, pred = random_sequences(rng, (2, 4))
        r = vpq(torch.from_numpy(pred), torch.from_numpy(gt), temporally_consistent=consistent)
        tp, fp, fn, iou_sum = reference_counts(pred, gt, consistent)
        assert counts(r) == (tp, fp, fn)
        assert r["iou_sum"] == pytest.approx(iou_sum)


def test_void_cells_leave_the_iou_and_predictions_wholly_in_void():
    gt = box(1, 1, 3, 1, 5)  # 8 cells ...
    gt[1:3, 3:5] = 255  # ... of which 4 void: a 4-cell instance
    pred = box(6, 1, 3, 1, 5, box(7, 8, 10, 8, 10))
    gt[8:10, 8:10] = 255  # instance 7 lies wholly in void
    assert counts(vpq(seq(pred), seq(gt), ignore_index=255)) == (1, 0, 0)
    assert counts(vpq(seq(pred), seq(gt))) == (0, 2, 2)  # without: 255 is just another instance id


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="integer instance ids"):
        PanopticQuality().update(torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\(B, T, X, Y\)"):
        PanopticQuality().update(torch.zeros(1, 4, 4, dtype=torch.int64), torch.zeros(1, 4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=">= 0"):
        PanopticQuality().update(-torch.ones(1, 1, 4, 4, dtype=torch.int64), torch.zeros(1, 1, 4, 4, dtype=torch.int64))


def test_future_iou_pools_every_cell_of_every_frame():
    rng = np.random.default_rng(2)
    pred, tgt, ign = (rng.random((3, 4, 8, 8)) < q for q in (0.3, 0.3, 0.1))
    m = FutureIoU()
    m.update(torch.from_numpy(pred[:1]), torch.from_numpy(tgt[:1]), torch.from_numpy(ign[:1]))
    m.update(torch.from_numpy(pred[1:]).long(), torch.from_numpy(tgt[1:]).long(), torch.from_numpy(ign[1:]))
    keep = ~ign
    want = (pred & tgt & keep).sum() / ((pred | tgt) & keep).sum()
    r = m.compute()
    assert r["iou"] == pytest.approx(want)
    assert r["fn"] == ((~pred) & tgt & keep).sum()
    plain = FutureIoU()
    plain.update(torch.from_numpy(pred), torch.from_numpy(tgt))
    assert plain.compute()["iou"] == pytest.approx((pred & tgt).sum() / (pred | tgt).sum())


def test_future_iou_empty_is_nan_and_probabilities_are_refused():
    m = FutureIoU()
    m.update(torch.zeros(1, 2, 4, 4, dtype=torch.bool), torch.zeros(1, 2, 4, 4, dtype=torch.bool))
    assert math.isnan(m.compute()["iou"])
    with pytest.raises(ValueError, match="bool or 0/1"):
        m.update(torch.rand(1, 2, 4, 4), torch.zeros(1, 2, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="ignore mask"):
        m.update(torch.zeros(1, 2, 4, 4, dtype=torch.bool), torch.full((1, 2, 4, 4), 255))


def test_fiery_ranges_on_the_lss_grid():
    assert range_slices(Grid(), FIERY_RANGES["short"]) == (slice(70, 130), slice(70, 130))
    assert range_slices(Grid(), FIERY_RANGES["long"]) == (slice(0, 200), slice(0, 200))


@pytest.mark.parametrize(
    "grid", [Grid(xbound=(-50, 50, 1.0), ybound=(-50, 50, 1.0)), Grid(xbound=(-20, 60, 0.5), ybound=(-30, 30, 0.25))]
)
def test_range_is_the_cells_whose_centres_lie_inside(grid):
    centres = torch.as_tensor(grid.cell_centers())
    inside = (centres.abs() < 15).all(-1)
    x = torch.arange(grid.nx)[:, None].expand(grid.bev_shape)
    (cropped,) = crop_to_range(grid, 30.0, x)
    assert cropped.numel() == int(inside.sum())
    assert torch.equal(cropped, x[inside].reshape(cropped.shape))


def test_range_errors():
    with pytest.raises(ValueError, match="no whole"):
        range_slices(Grid(), 0.4)
    with pytest.raises(ValueError, match="grid's"):
        crop_to_range(Grid(), 30.0, torch.zeros(1, 100, 100))
