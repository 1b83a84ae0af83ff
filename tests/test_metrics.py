"""IoU metric: global TP/FP/FN accumulation, visibility filter, distance bands."""

import math

import pytest
import torch

from bev.geometry import Grid
from bev.tasks.segmentation.metric import BANDS, BevIoU, band_masks, format_table, iou

GRID = Grid(xbound=(-50, 50, 10.0), ybound=(-50, 50, 10.0))  # 10 x 10 cells of 10 m


def logits_from(mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), 4.0, -4.0)


def test_global_iou_is_not_a_mean_of_sample_ious():
    m = BevIoU(GRID)
    tgt = torch.zeros(2, 1, 10, 10)
    pred = torch.zeros(2, 1, 10, 10)
    tgt[0, 0, 0, :4] = 1  # sample 0: 4 target cells, 2 hit -> 0.5
    pred[0, 0, 0, :2] = 1
    tgt[1, 0, 5, 5] = 1  # sample 1: 1 target, hit, plus 1 false positive -> 0.5
    pred[1, 0, 5, 5:7] = 1
    m.update(logits_from(pred[:1]), tgt[:1])
    m.update(logits_from(pred[1:]), tgt[1:])  # accumulation across batches
    out = m.compute()
    # global: TP = 3, FP = 1, FN = 2 -> 3/6 (the mean of per-sample IoUs would also be 0.5, so
    # make it differ): add a sample with a big perfect hit.
    tgt2 = torch.zeros(1, 1, 10, 10)
    tgt2[0, 0, 2:6, 2:6] = 1
    m.update(logits_from(tgt2), tgt2)
    out = m.compute()
    assert out["iou"] == pytest.approx((3 + 16) / (3 + 16 + 1 + 2))
    assert out["iou"] != pytest.approx((0.5 + 0.5 + 1.0) / 3)


def test_threshold_is_on_the_probability():
    m = BevIoU(GRID, threshold=0.5)
    tgt = torch.zeros(1, 1, 10, 10)
    tgt[0, 0, 0, 0] = 1
    logits = torch.full((1, 1, 10, 10), -1.0)
    logits[0, 0, 0, 0] = 0.01  # sigmoid just above 0.5
    logits[0, 0, 0, 1] = -0.01  # just below: not predicted
    m.update(logits, tgt)
    assert m.compute()["iou"] == 1.0


def test_visibility_filter_ignores_level_one_cells_only():
    m = BevIoU(GRID)
    tgt = torch.zeros(1, 1, 10, 10)
    vis = torch.zeros(1, 10, 10, dtype=torch.uint8)
    tgt[0, 0, 1, 1:4] = 1
    vis[0, 1, 1:4] = torch.tensor([1, 2, 4], dtype=torch.uint8)  # one barely visible vehicle cell
    pred = torch.zeros(1, 1, 10, 10)
    pred[0, 0, 1, 2:4] = 1  # misses the visibility-1 cell
    m.update(logits_from(pred), tgt, vis)
    out = m.compute()
    assert out["iou"] == pytest.approx(2 / 3)
    assert out["iou_vis"] == 1.0
    # A false positive on a visibility-1 cell is ignored by the filter as well.
    m.reset()
    pred[0, 0, 1, 1:4] = 1
    tgt[0, 0, 1, 1] = 0  # the level-1 vehicle is not in the target but the cell is marked
    m.update(logits_from(pred), tgt, vis)
    out = m.compute()
    assert out["iou"] == pytest.approx(2 / 3) and out["iou_vis"] == 1.0


def test_distance_bands_use_cell_centres():
    masks = band_masks(GRID)
    centers = torch.as_tensor(GRID.cell_centers())
    dist = centers.norm(dim=-1)
    for r, (lo, hi) in enumerate(BANDS, start=1):
        assert torch.equal(masks[r], (dist >= lo) & (dist < hi))
    assert masks[0].all()
    # Cell (5, 5) has its centre at (5, 5) m: 7.07 m -> band 0-20 only.
    m = BevIoU(GRID)
    tgt = torch.zeros(1, 1, 10, 10)
    tgt[0, 0, 5, 5] = 1  # near, hit
    tgt[0, 0, 0, 5] = 1  # centre (-45, 5): 45.3 m -> 35-50 band, missed
    pred = torch.zeros(1, 1, 10, 10)
    pred[0, 0, 5, 5] = 1
    m.update(logits_from(pred), tgt)
    out = m.compute()
    assert out["iou_0_20m"] == 1.0
    assert out["iou_35_50m"] == 0.0
    assert math.isnan(out["iou_20_35m"])  # neither targets nor predictions there
    assert out["iou"] == 0.5
    table = format_table(out)
    assert "vehicle" in table and "35-50m" in table and "0.5000" in table


def test_iou_helper_and_shape_check():
    assert iou(1, 1, 0) == 0.5
    assert math.isnan(iou(0, 0, 0))
    with pytest.raises(ValueError, match="must both be"):
        BevIoU(GRID).update(torch.zeros(1, 1, 5, 5), torch.zeros(1, 1, 5, 5))


def test_classes_are_counted_separately():
    m = BevIoU(GRID, class_names=("vehicle", "pedestrian"))
    tgt = torch.zeros(1, 2, 10, 10)
    pred = torch.zeros(1, 2, 10, 10)
    tgt[0, 0, 5, 5:9] = 1  # vehicle: 4 targets, 4 hits -> 1.0
    pred[0, 0, 5, 5:9] = 1
    tgt[0, 1, 2, 2:4] = 1  # pedestrian: 2 targets, 1 hit, 2 false positives -> 1/4
    pred[0, 1, 2, 3:6] = 1
    m.update(logits_from(pred), tgt)
    out = m.compute()
    assert out["iou_vehicle"] == out["iou"] == 1.0  # pooled, it would be 5/8
    assert out["iou_pedestrian"] == pytest.approx(1 / 4)
    # cell (2, 2) (centre (-25, -25) m, 35.4 m) is a miss; (2, 3..5) lie 25-30 m out: 1 TP, 2 FP
    assert out["iou_pedestrian_vis_35_50m"] == 0.0 and out["iou_pedestrian_20_35m"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="vehicle"):
        m.update(torch.zeros(1, 1, 10, 10), torch.zeros(1, 1, 10, 10))


def test_map_iou_uses_the_best_threshold_over_the_split():
    from bev.tasks.segmentation.metric import MAP_THRESHOLDS, MapIoU

    m = MapIoU(["drivable_area", "divider"])
    assert MAP_THRESHOLDS == (0.35, 0.40, 0.45, 0.50, 0.55, 0.60, 0.65)
    prob = torch.zeros(2, 2, 4, 4)
    tgt = torch.zeros(2, 2, 4, 4)
    # drivable_area: targets 4 cells at p = 0.62 (sample 0) + 2 cells at p = 0.42 (sample 1);
    # one background cell at 0.38. At t <= 0.35: 6 TP, 1 FP -> 6/7; t in [0.40, 0.40]: 6/6 = 1;
    # t in 0.45..0.60: 4 TP, 2 FN -> 4/6; t = 0.65: 0.
    tgt[0, 0, 0, :4] = 1
    prob[0, 0, 0, :4] = 0.62
    tgt[1, 0, 1, :2] = 1
    prob[1, 0, 1, :2] = 0.42
    prob[1, 0, 3, 3] = 0.38
    # divider: no target anywhere, one cell at p = 0.5 -> IoU 0 up to t = 0.5, NaN above.
    prob[0, 1, 2, 2] = 0.5
    logits = torch.logit(prob.clamp(1e-6, 1 - 1e-6))
    m.update(logits[:1], tgt[:1])
    m.update(logits[1:], tgt[1:])  # accumulated over batches, not per sample
    out = m.compute()
    assert out["iou_drivable_area@0.35"] == pytest.approx(6 / 7)
    assert out["iou_drivable_area@0.40"] == 1.0 and out["thr_drivable_area"] == 0.40 and out["iou_drivable_area"] == 1.0
    assert out["iou_drivable_area@0.50"] == pytest.approx(4 / 6) and out["iou_drivable_area@0.65"] == 0.0
    assert out["iou_divider"] == 0.0 and out["iou_divider@0.50"] == 0.0 and math.isnan(out["iou_divider@0.55"])
    assert out["miou_map"] == pytest.approx(0.5)
    table = format_table({**out, "iou": 0.3}, ["vehicle"], ["drivable_area", "divider"])
    assert "drivable_area" in table and "0.40" in table and "mIoU" in table and "0.5000" in table
