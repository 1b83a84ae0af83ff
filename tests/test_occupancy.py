"""Occ3D-format occupancy: grid facts, reading / writing its files, its mIoU, and synthetic-world labels."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bev.classes import DETECTION_CLASSES
from bev.tasks.occupancy import grid as G
from bev.tasks.occupancy.io import (
    OccupancyFileError,
    labels_path,
    read_labels,
    read_prediction,
    write_labels,
    write_prediction,
)
from bev.tasks.occupancy.metric import DEFAULT_BANDS, OccupancyMIoU, mean_iou, per_class_iou

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
        assert z.files == ["arr_0", "pred"] and z["arr_0"].dtype == np.uint8  # the challenge's key, SparseOcc's
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
    np.savez(t / "pickled.npz", semantics=np.array([{}], dtype=object), mask_lidar=m8, mask_camera=c8)  # never loaded
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


def test_the_ground_truth_as_prediction_scores_one():
    rng = np.random.default_rng(0)
    gt = rng.integers(0, 18, SHAPE).astype(np.uint8)
    mask = rng.random(SHAPE) < 0.3
    m = OccupancyMIoU()
    m.update(gt, gt, mask_camera=mask)
    s = m.compute()
    assert s.miou == 1.0 and s.miou_x100 == 100.0 and np.all(s.iou == 1.0)


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


# ----------------------------------------------------------------------------- synthetic world labels


@pytest.fixture(scope="module")
def synthetic_sample():
    """One sample of the test set's first scene, rendered at the test render scale, and its labels."""
    from bev.data.rig import MINI_LOCATIONS
    from bev.synthetic import raycast
    from bev.synthetic.occupancy import occupancy_sample
    from bev.synthetic.world import SAMPLE_DT, SHOWCASE_FRAME, build_world
    from helpers.synthetic import RENDER_SCALE, SAMPLES, SEED

    world = build_world(SEED, 0, SAMPLES, MINI_LOCATIONS["scene-0061"])
    t = min(SHOWCASE_FRAME, SAMPLES - 1) * SAMPLE_DT  # every detection class stands near the ego then
    renders, _ = raycast.render_sample(world, t, RENDER_SCALE)
    return world, t, renders, RENDER_SCALE, occupancy_sample(world, t, renders, RENDER_SCALE)


def test_synthetic_labels_agree_with_the_rendered_images(synthetic_sample):
    """Where a camera ray ends, the voxel is occupied, and by the class of the object the pixel shows."""
    from bev.synthetic import raycast
    from bev.synthetic.occupancy import object_class

    world, _, renders, scale, occ = synthetic_sample
    ends = occupied = agree = objects = 0
    for name, r in renders.items():
        cam = raycast.make_camera(name, scale)
        z, ids = r.depth.reshape(-1), r.ids.reshape(-1)
        m = np.flatnonzero(np.isfinite(z))
        idx, inside = G.points_to_voxels(cam.translation + z[m, None] * cam.rays.reshape(-1, 3)[m])
        where = tuple(idx[inside].T)
        assert occ.mask_camera[where].all()  # a ray that ends in a voxel observes it
        sem = occ.semantics[where]
        ends, occupied = ends + len(sem), occupied + int(np.count_nonzero(sem != G.FREE))
        shown = ids[m][inside]
        obj = shown > 0
        expected = np.array([object_class(world.objects[i - 1].category) for i in shown[obj]], np.uint8)
        agree += int(np.count_nonzero(sem[obj] == expected))
        objects += int(obj.sum())
    assert occupied >= 0.999 * ends and objects > 1000 and agree >= 0.99 * objects, (ends, occupied, objects, agree)


def test_synthetic_semantics_layout(synthetic_sample):
    from bev.synthetic.occupancy import GROUND_K, GROUND_RES

    world, t, _, _, occ = synthetic_sample
    sem = occ.semantics
    assert sem.dtype == np.uint8 and sem.shape == SHAPE and GROUND_K == 2  # z = 0 lies in [-0.2, 0.2)
    assert (sem[:, :, :GROUND_K] == G.FREE).all()  # below the ground: nothing observed, free as in Occ3D
    assert not (sem[:, :, GROUND_K] == G.FREE).any()  # the ground layer is all surface
    assert sem[100, 100, GROUND_K] == G.CLASS_ID["driveable_surface"]  # the ego drives on the road
    names = {G.OCC3D_CLASSES[c] for c in np.unique(sem[occ.mask_camera])}
    assert {"driveable_surface", "sidewalk", "terrain", "manmade", "free"} | set(DETECTION_CLASSES) <= names
    # The ground layer against the map's own polygons at the column centres, taken to the map frame here.
    import shapely

    ego_t, yaw = world.ego_pose(t)
    xy = G.voxel_centres()[:, :, 0, :2].reshape(-1, 2)
    gxy = ego_t[:2] + xy @ np.array([[np.cos(yaw), np.sin(yaw)], [-np.sin(yaw), np.cos(yaw)]])
    layers = world.road.layers
    drivable, walkway = layers["drivable_area"][0]["geom"], shapely.union_all([r["geom"] for r in layers["walkway"]])
    drive = shapely.contains_xy(drivable, gxy[:, 0], gxy[:, 1])
    walk = shapely.contains_xy(walkway, gxy[:, 0], gxy[:, 1])
    want = np.where(
        drive, G.CLASS_ID["driveable_surface"], np.where(walk, G.CLASS_ID["sidewalk"], G.CLASS_ID["terrain"])
    )
    ground = sem[:, :, GROUND_K].reshape(-1)
    bare = ground != G.CLASS_ID["manmade"]  # buildings stand on the ground; objects too
    bare &= ~np.isin(ground, list(G.DETECTION_TO_OCC3D.values()))
    assert drive.sum() > 1000 and walk.sum() > 1000 and (~drive & ~walk).sum() > 1000
    wrong = np.flatnonzero(bare & (ground != want))  # texels of GROUND_RES: only columns at a border may differ
    border = shapely.union_all([drivable.boundary, walkway.boundary])
    assert (
        len(wrong) < 0.02 * bare.sum() and shapely.distance(border, shapely.points(gxy[wrong])).max() < 1.5 * GROUND_RES
    )
    surfaces = {G.CLASS_ID[n] for n in ("driveable_surface", "sidewalk", "terrain")}
    assert set(np.unique(sem[:, :, GROUND_K + 2 :]).tolist()).isdisjoint(surfaces)  # surfaces only on the ground


def test_box_voxels_match_an_independent_overlap_test():
    """Voxels a yaw-only box overlaps, against shapely's rectangle intersection areas and the z intervals."""
    import shapely
    from shapely.affinity import rotate, translate
    from shapely.geometry import box

    from bev.synthetic.occupancy import Boxes, box_voxels

    rng = np.random.default_rng(5)
    n = 40
    xy = rng.uniform(-41, 41, (n, 2))
    half = rng.uniform(0.03, 3.0, (n, 2))
    z0 = rng.uniform(-1.5, 5.0, n)
    b = Boxes(xy, rng.uniform(-np.pi, np.pi, n), half, np.stack([z0, z0 + rng.uniform(0.05, 4, n)], 1), np.ones(n))
    vox, part = box_voxels(b)
    got = set(zip(part.tolist(), vox.tolist()))
    want = set()
    cx = G.OCC_RANGE[0] + (np.arange(200) + 0.5) * 0.4
    for p in range(n):
        rect = translate(
            rotate(box(-half[p, 0], -half[p, 1], half[p, 0], half[p, 1]), b.yaw[p], use_radians=True), *xy[p]
        )
        x0, y0, x1, y1 = rect.bounds
        ii = np.flatnonzero((cx + 0.2 > x0) & (cx - 0.2 < x1))
        jj = np.flatnonzero((cx + 0.2 > y0) & (cx - 0.2 < y1))
        kk = [k for k in range(16) if -1 + 0.4 * k < b.z[p, 1] and -1 + 0.4 * (k + 1) > b.z[p, 0]]
        for i in ii:
            for j in jj:
                cell = box(cx[i] - 0.2, cx[j] - 0.2, cx[i] + 0.2, cx[j] + 0.2)
                if shapely.intersection(rect, cell).area > 1e-9:
                    want |= {(p, (i * 200 + j) * 16 + k) for k in kk}
    assert len(want) > 1000 and got == want


def test_synthetic_masks_follow_the_sensors(synthetic_sample):
    from bev.synthetic.lidar import sensor
    from bev.synthetic.occupancy import LIDAR_ELEVATION

    _, _, _, _, occ = synthetic_sample
    for mask in (occ.mask_camera, occ.mask_lidar):
        assert mask.dtype == bool and not mask[:, :, :2].any()  # rays end on the ground: nothing below it
        assert 0.1 < mask.mean() < 0.6
    c = G.voxel_centres()
    solid = occ.semantics == G.CLASS_ID["manmade"]
    inner = solid.copy()  # building voxels whose six neighbours are building too: no ray reaches them
    for a in range(3):
        for shift in (1, -1):
            inner &= np.roll(solid, shift, axis=a)
    inner[[0, -1]], inner[:, [0, -1]], inner[:, :, [0, -1]] = False, False, False  # np.roll wraps around
    assert inner.sum() > 100
    assert not occ.mask_camera[inner].any() and not occ.mask_lidar[inner].any()
    # The lidar sees nothing above its top beam (+10.67 degrees, from its mount).
    d = c - sensor().translation
    elevation = np.degrees(np.arctan2(d[..., 2], np.hypot(d[..., 0], d[..., 1])))
    far = np.linalg.norm(d, axis=-1) > 8  # nearer, a voxel a beam ends in may have its centre a few degrees off
    assert not occ.mask_lidar[far & (elevation > LIDAR_ELEVATION[0] + 3)].any()
    assert occ.mask_lidar[far & (elevation < LIDAR_ELEVATION[0] - 3) & (elevation > 0)].any()
    # Free air around the car at the lidar's height: seen exactly when nothing occupied lies on the segment
    # from the lidar to it (a march through the voxel labels, an independent occlusion test).
    r = np.hypot(c[..., 0], c[..., 1])
    ring = np.argwhere((r > 4) & (r < 12) & (np.abs(c[..., 2] - 1.8) < 0.5) & (occ.semantics == G.FREE))
    steps = np.linspace(0.0, 1.0, 200)[:, None, None]
    origin = sensor().translation
    path = origin + steps * (c[tuple(ring.T)] - origin)  # (steps, voxels, 3)
    idx, inside = G.points_to_voxels(path.reshape(-1, 3))
    blocked = np.zeros(len(idx), bool)
    blocked[inside] = occ.semantics[tuple(idx[inside].T)] != G.FREE
    clear = ~blocked.reshape(len(steps), -1).any(0)
    seen = occ.mask_lidar[tuple(ring.T)]
    assert clear.sum() > 500 and (~clear).sum() > 50
    # Voxel labels are fatter than the boxes (a part takes every voxel it touches), so the march may find a
    # segment blocked that the lidar's rays pass; never the other way.
    assert (clear & ~seen).mean() < 0.005 and (seen & ~clear).mean() < 0.1, (
        (clear & ~seen).sum(),
        (seen & ~clear).sum(),
    )
    # Cameras see the free space straight ahead of the car at their height.
    ahead = occ.semantics[110:125, 98:102, 6] == G.FREE
    assert occ.mask_camera[110:125, 98:102, 6][ahead].all()


def test_write_sample_occupancy_writes_occ3d_labels(synthetic_sample, tmp_path):
    from bev.synthetic.occupancy import write_sample_occupancy

    world, t, renders, scale, occ = synthetic_sample
    path = write_sample_occupancy(tmp_path, "scene-0061", "tok0", world, t, renders, scale)
    assert path == tmp_path / "gts" / "scene-0061" / "tok0" / "labels.npz"
    got = read_labels(path)
    assert all(np.array_equal(a, b) for a, b in zip(got, (occ.semantics, occ.mask_lidar, occ.mask_camera)))


def test_synthetic_category_table_matches_the_devkit():
    from nuscenes.eval.detection.utils import category_to_detection_name

    from bev.synthetic.occupancy import CATEGORY_DETECTION, object_class
    from bev.synthetic.world import SIZES

    assert set(CATEGORY_DETECTION) == set(SIZES)
    assert all(category_to_detection_name(c) == d for c, d in CATEGORY_DETECTION.items())
    assert object_class("") == G.CLASS_ID["manmade"] and object_class("animal") == G.CLASS_ID["others"]
    assert object_class("vehicle.bus.bendy") == G.CLASS_ID["bus"]
