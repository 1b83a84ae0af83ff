"""Occ3D-format occupancy: grid facts, reading / writing its files, its mIoU, and synthetic-world labels."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bev.classes import DETECTION_CLASSES
from bev.occupancy import grid as G
from bev.occupancy.io import (
    OccupancyFileError,
    labels_path,
    read_labels,
    read_prediction,
    write_labels,
    write_prediction,
)
from bev.occupancy.metric import DEFAULT_BANDS, OccupancyMIoU, mean_iou, per_class_iou

SHAPE = G.OCC_SHAPE

# ----------------------------------------------------------------------------- grid


def test_grid_facts_match_occ3d():
    assert G.OCC_RANGE == (-40.0, -40.0, -1.0, 40.0, 40.0, 5.4) and G.VOXEL_SIZE == 0.4
    assert SHAPE == (200, 200, 16) and G.occ3d_grid().voxel_shape == (16, 200, 200)
    assert G.NUM_CLASSES == 18 and G.OCC3D_CLASSES[0] == "others" and G.OCC3D_CLASSES[G.FREE] == "free"
    assert [G.OCC3D_CLASSES[i] for i in (1, 4, 10, 11, 13, 15, 16)] == [
        "barrier",
        "car",
        "truck",
        "driveable_surface",
        "sidewalk",
        "manmade",
        "vegetation",
    ]
    assert set(G.DETECTION_TO_OCC3D) == set(DETECTION_CLASSES)
    assert {G.DETECTION_TO_OCC3D[n] for n in DETECTION_CLASSES} == set(range(1, 11))


def test_voxel_index_is_x_y_z_with_floor():
    centres = G.voxel_centres()
    assert centres.shape == (*SHAPE, 3)
    np.testing.assert_allclose(centres[0, 0, 0], [-39.8, -39.8, -0.8])
    np.testing.assert_allclose(centres[199, 0, 0, 0], 39.8)  # axis 0 is ego x (forward)
    np.testing.assert_allclose(centres[0, 199, 0, 1], 39.8)  # axis 1 is ego y (left)
    np.testing.assert_allclose(centres[0, 0, 15, 2], 5.2)  # axis 2 is z (up)
    idx, inside = G.points_to_voxels(np.array([[0.0, 0.0, 0.0], [-40.01, 0, 0], [10.1, -0.1, 5.39]]))
    assert idx.tolist() == [[100, 100, 2], [-1, 100, 2], [125, 99, 15]] and inside.tolist() == [True, False, True]
    vol = np.zeros(SHAPE)
    assert G.to_zxy(vol).shape == (16, 200, 200) and G.from_zxy(G.to_zxy(vol)).shape == SHAPE
    assert tuple(G.to_zxy(torch.zeros(2, *SHAPE)).shape) == (2, 16, 200, 200)


# ----------------------------------------------------------------------------- files


def _labels(seed: int = 0):
    rng = np.random.default_rng(seed)
    sem = rng.integers(0, 18, SHAPE).astype(np.uint8)
    return sem, rng.random(SHAPE) < 0.5, rng.random(SHAPE) < 0.3


def test_labels_round_trip_at_the_occ3d_path(tmp_path):
    sem, ml, mc = _labels()
    path = write_labels(labels_path(tmp_path, "scene-0061", "abc123"), sem, ml, mc)
    assert path == tmp_path / "gts" / "scene-0061" / "abc123" / "labels.npz"
    with np.load(path) as z:  # what Occ3D's own loader reads: uint8 arrays under its three keys
        assert sorted(z.files) == ["mask_camera", "mask_lidar", "semantics"]
        assert all(z[k].dtype == np.uint8 and z[k].shape == SHAPE for k in z.files)
    got = read_labels(path)
    assert np.array_equal(got.semantics, sem) and np.array_equal(got.mask_lidar, ml)
    assert np.array_equal(got.mask_camera, mc) and got.mask_camera.dtype == bool
    assert not list(path.parent.glob(".*.tmp"))  # written atomically: no temporary left behind


def test_prediction_uses_the_challenge_format(tmp_path):
    pred = np.random.default_rng(1).integers(0, 18, SHAPE)  # int64, e.g. an argmax
    path = write_prediction(tmp_path, "tok", pred)
    assert path.name == "tok.npz"
    with np.load(path) as z:
        assert z.files == ["arr_0"] and z["arr_0"].dtype == np.uint8  # np.savez_compressed(path, pred)
    assert np.array_equal(read_prediction(path), pred)
    with pytest.raises(OccupancyFileError, match="class id 18"):
        write_prediction(tmp_path, "bad", np.full(SHAPE, 18))


def _save(path, **arrays):
    np.savez(path, **arrays)
    return path


def _bad_files(tmp_path):
    """(file, words its error must hold) for every kind of bad labels file."""
    sem, ml, mc = _labels()
    m8, c8 = ml.astype(np.uint8), mc.astype(np.uint8)
    t = tmp_path
    (t / "text.npz").write_text("not a zip")
    good = _save(t / "good.npz", semantics=sem, mask_lidar=m8, mask_camera=c8)
    (t / "cut.npz").write_bytes(good.read_bytes()[:5000])
    data = bytearray(write_labels(t / "zipped.npz", sem, ml, mc).read_bytes())
    data[len(data) // 3 : len(data) // 3 + 64] = bytes(64)  # a member's compressed bytes damaged
    (t / "flipped.npz").write_bytes(bytes(data))
    np.save(t / "one.npy", sem)
    (t / "one.npy").rename(t / "npy.npz")
    np.savez(t / "pickled.npz", semantics=np.array([{}], dtype=object))  # needs pickle: never loaded
    return [
        (_save(t / "nokey.npz", semantics=sem, mask_lidar=m8), "missing array(s) ['mask_camera']"),
        (_save(t / "shape.npz", semantics=sem[:100], mask_lidar=m8, mask_camera=c8), "shape (100, 200, 16)"),
        (_save(t / "dtype.npz", semantics=sem.astype(np.int32), mask_lidar=m8, mask_camera=c8), "dtype int32"),
        (_save(t / "range.npz", semantics=sem + 100, mask_lidar=m8, mask_camera=c8), "class id"),
        (_save(t / "mask.npz", semantics=sem, mask_lidar=m8 * 3, mask_camera=c8), "mask_lidar must hold only 0 and 1"),
        (_save(t / "mdtype.npz", semantics=sem, mask_lidar=m8, mask_camera=c8.astype(float)), "mask_camera has dtype"),
        (t / "text.npz", "is not an .npz file"),
        (t / "cut.npz", "damaged .npz archive"),
        (t / "flipped.npz", "damaged .npz archive"),
        (t / "npy.npz", "single .npy"),
        (t / "pickled.npz", "without pickle"),
        (t, "cannot be read"),  # a directory
    ]


def test_every_bad_labels_file_gets_one_clear_error(tmp_path):
    for path, words in _bad_files(tmp_path):
        with pytest.raises(OccupancyFileError) as e:
            read_labels(path)
        msg = str(e.value)
        assert str(path) in msg and words in msg and "labels.npz" in msg, msg  # the file, the problem, the fix
        assert e.value.__cause__ is None and e.value.__suppress_context__ or e.value.__context__ is None
    with pytest.raises(FileNotFoundError, match="no Occ3D file at .*absent.npz"):
        read_labels(tmp_path / "absent.npz")


def test_write_labels_refuses_bad_arrays(tmp_path):
    sem, ml, mc = _labels()
    with pytest.raises(OccupancyFileError, match="class id 20"):
        write_labels(tmp_path / "x.npz", np.full(SHAPE, 20, np.uint8), ml, mc)
    with pytest.raises(OccupancyFileError, match="mask_camera has shape"):
        write_labels(tmp_path / "x.npz", sem, ml, mc[..., :8])
    assert not (tmp_path / "x.npz").exists()


# ----------------------------------------------------------------------------- metric


def _reference_miou(pred, gt, mask):
    """Occ3D's README formula written out: per class TP / (TP + FP + FN) over the masked voxels with truth in
    0..17, then the mean over classes 0..16 of the defined ones (0 / 0 is undefined)."""
    sel = mask & (gt < 18)
    p, g = pred[sel], gt[sel]
    ious = []
    for c in range(18):
        tp = np.sum((g == c) & (p == c))
        fp = np.sum((g != c) & (p == c))
        fn = np.sum((g == c) & (p != c))
        ious.append(tp / (tp + fp + fn) if tp + fp + fn else math.nan)
    scored = [x for x in ious[:17] if not math.isnan(x)]
    return np.array(ious), sum(scored) / len(scored)


def test_metric_matches_a_hand_computed_confusion():
    gt = np.full(SHAPE, 17, np.uint8)
    pred = np.full(SHAPE, 17, np.uint8)
    mask = np.zeros(SHAPE, bool)
    cells = [(4, 4), (4, 4), (4, 17), (17, 17), (11, 11), (11, 4), (7, 11), (255, 3)]  # (truth, prediction)
    for n, (g, p) in enumerate(cells):
        gt[n, 0, 0], pred[n, 0, 0], mask[n, 0, 0] = g % 256, p, True
    gt[50, 50, 5], pred[50, 50, 5] = 3, 3  # outside the mask: not scored
    m = OccupancyMIoU()
    m.update(pred, gt, mask_camera=mask)
    conf = m.confusion.sum(0)
    assert conf[4, 4] == 2 and conf[4, 17] == 1 and conf[17, 17] == 1 and conf[11, 11] == 1
    assert conf[11, 4] == 1 and conf[7, 11] == 1 and int(conf.sum()) == 7  # 255 in the truth is skipped
    s = m.compute()
    # car: 2 / (3 + 3 - 2); pedestrian 0 / 1; driveable 1 / (2 + 2 - 1); free 1 / (1 + 2 - 1), not averaged.
    np.testing.assert_allclose(s.iou[[4, 7, 11, 17]], [0.5, 0.0, 1 / 3, 0.5])
    assert np.isnan(s.iou[3])  # bus only outside the mask: undefined, left out of the mean
    assert s.miou == pytest.approx((0.5 + 0 + 1 / 3) / 3) and s.miou_x100 == 27.78 and s.voxels == 7


@pytest.mark.parametrize("mask", ["camera", "lidar", "none"])
def test_metric_matches_an_independent_formula_on_random_batches(mask):
    rng = np.random.default_rng(3)
    m = OccupancyMIoU(mask=mask)
    preds, gts, masks = [], [], []
    for _ in range(3):  # accumulated over batches
        gt = rng.choice(18, SHAPE, p=np.r_[np.full(17, 0.02), 0.66]).astype(np.uint8)
        pred = np.where(rng.random(SHAPE) < 0.6, gt, rng.integers(0, 18, SHAPE)).astype(np.uint8)
        gt[rng.random(SHAPE) < 0.01] = 255  # unknown truth
        mc, ml = rng.random(SHAPE) < 0.4, rng.random(SHAPE) < 0.7
        m.update(torch.from_numpy(pred), gt, mask_camera=mc, mask_lidar=ml)  # tensors and arrays alike
        (
            preds.append(pred),
            gts.append(gt),
            masks.append({"camera": mc, "lidar": ml, "none": np.ones(SHAPE, bool)}[mask]),
        )
    iou, miou = _reference_miou(np.stack(preds), np.stack(gts), np.stack(masks))
    s = m.compute()
    np.testing.assert_allclose(s.iou, iou, rtol=1e-12)
    assert s.miou == pytest.approx(miou, rel=1e-12) and m.samples == 3


def test_metric_bands_merge_and_batch_axis():
    rng = np.random.default_rng(4)
    gt = rng.integers(0, 18, (2, *SHAPE)).astype(np.uint8)
    pred = np.where(rng.random(gt.shape) < 0.5, gt, 4).astype(np.uint8)
    mask = rng.random(gt.shape) < 0.5
    whole = OccupancyMIoU(bands=DEFAULT_BANDS)
    whole.update(pred, gt, mask_camera=mask)  # a batch of two
    a, b = OccupancyMIoU(bands=DEFAULT_BANDS), OccupancyMIoU(bands=DEFAULT_BANDS)
    a.update(pred[0], gt[0], mask_camera=mask[0])
    b.update(pred[1], gt[1], mask_camera=mask[1])
    assert torch.equal(a.merge(b).confusion, whole.confusion) and a.samples == 2
    bands = whole.compute_bands()
    assert list(bands) == ["0-20m", "20-40m", "40m+"]
    assert int(whole.confusion[-1].sum()) == 0  # the default bands cover the whole grid
    near = np.hypot(*np.meshgrid(*(G.voxel_centres()[:, 0, 0, 0],) * 2, indexing="ij")) < 20
    sel = mask & near[None, :, :, None]
    _, miou_near = _reference_miou(pred[sel], gt[sel], np.ones(int(sel.sum()), bool))
    assert bands["0-20m"].miou == pytest.approx(miou_near, rel=1e-12)
    assert sum(s.voxels for s in bands.values()) == whole.compute().voxels == int(mask.sum())


def test_metric_refuses_what_it_cannot_score():
    m = OccupancyMIoU()
    z = np.zeros(SHAPE, np.uint8)
    with pytest.raises(ValueError, match="needs mask_camera"):
        m.update(z, z)
    with pytest.raises(ValueError, match="must both be"):
        m.update(z[:10], z[:10], mask_camera=z[:10])
    with pytest.raises(ValueError, match="predicted class ids must be in 0..17"):
        m.update(z + 18, z, mask_camera=z)
    with pytest.raises(ValueError, match="argmax"):
        m.update(z.astype(np.float32), z, mask_camera=z)
    with pytest.raises(ValueError, match="mask must be one of"):
        OccupancyMIoU(mask="cams")
    assert math.isnan(m.compute().miou) and math.isnan(mean_iou(per_class_iou(torch.zeros(18, 18))))


def test_metric_counts_sum_across_processes(tmp_path):
    import torch.distributed as dist

    m = OccupancyMIoU()
    gt = np.full(SHAPE, 4, np.uint8)
    m.update(gt, gt, mask_camera=np.ones(SHAPE, bool))
    before = m.confusion.clone()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        m.all_reduce()  # one process: the sum is itself
    finally:
        dist.destroy_process_group()
    assert torch.equal(m.confusion, before) and m.samples == 1 and m.compute().iou[4] == 1.0
