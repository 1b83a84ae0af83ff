"""The native ray caster (bev.synthetic.native, bev.ops._C's bev::_raycast_zbuffer) gives what the numpy caster
(bev.synthetic.raycast, the reference) gives: for the cameras, the LiDAR's panorama and the occupancy masks, on
random boxes and on the synthetic world; its AVX2 and scalar loops and any number of threads agree; without the
operator the numpy caster runs; bad input is refused with a message that names it. And the LiDAR's cheaper
second pass off the boxes' faces moves the points two full passes move."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bev.data.rig import MINI_LOCATIONS
from bev.geometry import CAMERA_NAMES
from bev.ops import _native
from bev.synthetic import lidar, native, occupancy, raycast, sensors
from bev.synthetic import world as world_model
from bev.synthetic.world import CABIN, SOLID, WINDOWS

needs_op = pytest.mark.skipif(native.op() is None, reason="bev.ops._C was built without the ray caster")

DEPTH_RTOL = 1e-5  # relative depth difference allowed between the casters (they agree bit for bit today)
TIE_SHARE = 1e-3  # at most this share of the rays may show another part than numpy's, and only at exact ties


def _random_parts(rng: np.random.Generator, objects: int, reach: float = 40.0, ego: bool = True) -> raycast.Parts:
    """Random yawed objects of 1-4 boxes around the ego, some scenery (label 0), a few boxes exactly doubled (a
    depth tie on every ray that meets them), with `ego` a few across the cameras' near plane or holding the LiDAR."""
    label, obj, R, centre, half, kind = [], [], [], [], [], []
    for i in range(objects):
        yaw = rng.uniform(-math.pi, math.pi)
        c, s = math.cos(yaw), math.sin(yaw)
        rot = np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])
        at = np.array([*rng.uniform(-reach, reach, 2), 0.0])
        if ego and i % 11 == 0:
            at[:2] = rng.uniform(-2.5, 2.5, 2)  # at the ego: the cameras' near plane, the LiDAR inside or near it
        n = int(rng.integers(1, 5))
        for _ in range(n):
            h = rng.uniform(0.05, 3.0, 3)
            offset = np.array([*rng.uniform(-2, 2, 2), h[2] + rng.uniform(0, 1)])
            for _ in range(2 if rng.random() < 0.1 else 1):  # doubled: the same box twice, a tie
                label.append(i + 1 if i % 3 else 0)
                obj.append(i)
                R.append(rot)
                centre.append(at + rot @ offset)
                half.append(h)
                kind.append(rng.choice([SOLID, CABIN, WINDOWS]))
    R, centre, half = np.array(R), np.array(centre), np.array(half)
    signs = np.array([[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)], np.float64)
    corners = centre[:, None] + np.einsum("pcj,pij->pci", signs * half[:, None], R)
    cols = rng.uniform(0, 1, (len(obj), 12, 3)).astype(np.float32)
    return raycast.Parts(
        np.array(label, np.int32), np.array(obj, np.int64), R, centre, half, cols, np.array(kind, np.int64), corners
    )


@pytest.fixture(scope="module")
def world():
    return world_model.build_world(3, 1, 6, MINI_LOCATIONS["scene-0061"])


def _both(fn, *args, **kwargs):
    """fn's results under the numpy caster, then the native one."""
    with native.backend("numpy"):
        ref = fn(*args, **kwargs)
    with native.backend("native"):
        out = fn(*args, **kwargs)
    return ref, out


def _agree(ref: raycast.CameraRender, out: raycast.CameraRender) -> int:
    """Assert two renders agree (module tolerances); return the rays that show another part (ties)."""
    a, b = ref.depth, out.depth
    assert np.array_equal(np.isinf(a), np.isinf(b))
    fin = np.isfinite(a)
    assert np.all(np.abs(a[fin] - b[fin]) <= DEPTH_RTOL * np.abs(a[fin]))
    other = ref.ids != out.ids
    assert np.all(a[other] == b[other]), "ids differ where the depths differ: not a tie"
    assert other.mean() <= TIE_SHARE
    assert ref.coverage == out.coverage
    same = ~other
    assert np.array_equal(ref.image[same], out.image[same])  # glass, paint, ground and sky: the same floats
    return int(other.sum())


@needs_op
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cameras_agree_on_random_boxes(seed):
    """Each camera's depth, ids, image and coverage on random boxes; the z-buffer keys are numpy's bit for bit."""
    rng = np.random.default_rng(seed)
    parts = _random_parts(rng, 60)
    world = world_model.build_world(seed, 0, 2, MINI_LOCATIONS["scene-0061"])
    ties, seen = 0, set()
    for name in CAMERA_NAMES:
        cam = raycast.make_camera(name, (2, 4)[seed % 2])
        ref, out = _both(raycast.render_camera, world, 0.0, cam, parts=parts)
        ties += _agree(ref, out)
        visible, rects = raycast._visible(cam, parts)
        key, _, _ = native.zbuffer(cam.planes, raycast._part_table(cam, visible), rects, cam.ground_key)
        ref_key = raycast.zbuffer_numpy(cam, visible, rects, raycast._pixel_pairs(rects, cam.shape[1]))
        assert np.array_equal(key, ref_key)
        seen |= set(np.unique(np.minimum(key & 0xFFFFFFFF, 1)).tolist())
    assert seen == {0, 1}  # rays that parts win and rays that the ground or the sky win both tested
    assert ties == 0  # ties are broken by part index in both casters: none differ today


@needs_op
def test_rectangles_agree(world):
    """The parts' pixel rectangles (_part_rects): native float64 sums against numpy's matrix products, within a pixel
    (the rectangles' padding covers that), equal today; random boxes (some across the near plane) and the world's."""
    entries = same = 0
    for seed in range(3):
        for parts in (_random_parts(np.random.default_rng(20 + seed), 60), raycast.sample_parts(world, seed * 0.5)):
            for name in CAMERA_NAMES:
                cam = raycast.make_camera(name, 2 + 2 * (seed % 2))
                ref = raycast._part_rects_numpy(cam, parts)
                with native.backend("native"):
                    out = raycast._part_rects(cam, parts)
                assert np.abs(out - ref).max() <= 1
                entries, same = entries + ref.size, same + (out == ref).sum()
                assert ((ref[:, 1] > ref[:, 0]) & (ref[:, 3] > ref[:, 2])).any()
    assert same >= 0.999 * entries


@needs_op
def test_doubled_boxes_tie_and_keep_the_first(world):
    """A box drawn twice: every ray that meets it ties, and both casters show the first copy (lower part index)."""
    rng = np.random.default_rng(5)
    one = _random_parts(rng, 1)
    k = np.array([0, 0])
    parts = raycast.Parts(*(x[k] for x in one))
    parts.centre[:] = [6.0, 0.0, 1.0]
    parts.corners[:] = parts.centre[:, None] + (parts.corners[0] - one.centre[0])
    cam = raycast.make_camera("CAM_FRONT", 4)
    visible, rects = raycast._visible(cam, parts)
    with native.backend("native"):
        key = raycast.zbuffer(cam, visible, rects)
    part = key & 0xFFFFFFFF
    assert (part == 1).sum() > 100 and not (part == 2).any()
    assert np.array_equal(key, raycast.zbuffer_numpy(cam, visible, rects, raycast._pixel_pairs(rects, cam.shape[1])))


@needs_op
def test_world_sample_agrees(world):
    """render_sample of the synthetic world: every camera and the visibility counts."""
    t = 2 * world_model.SAMPLE_DT
    parts = raycast.sample_parts(world, t)
    (ref, ref_counts), (out, counts) = _both(raycast.render_sample, world, t, 4, parts)
    assert sum(_agree(ref[n], out[n]) for n in CAMERA_NAMES) == 0
    assert counts == ref_counts and len(counts) > 0


@needs_op
@pytest.mark.parametrize("seed", [0, 1])
def test_lidar_panorama_agrees(seed, world):
    """lidar.cast: ranges and parts of every beam, random boxes around the mount and the world's."""
    parts = _random_parts(np.random.default_rng(10 + seed), 80, reach=60.0, ego=bool(seed))
    for p in (parts, raycast.sample_parts(world, seed * world_model.SAMPLE_DT)):
        ref, out = _both(lidar.cast, lidar.sensor(), p)
        assert np.array_equal(np.isinf(ref.depth), np.isinf(out.depth))
        fin = np.isfinite(ref.depth)
        assert np.all(np.abs(ref.depth[fin] - out.depth[fin]) <= DEPTH_RTOL * ref.depth[fin])
        other = ref.part != out.part
        assert np.all(ref.depth[other] == out.depth[other]) and other.mean() <= TIE_SHARE
        assert (out.part >= 0).sum() > 500  # parts, and the ground (the world's: random boxes may hide it all)
        assert p is parts or (fin & (out.part < 0)).sum() > 10_000


@needs_op
def test_occupancy_masks_agree(world):
    """occupancy_sample (semantics, the camera and LiDAR masks) cast natively = with numpy."""
    t = 3 * world_model.SAMPLE_DT
    ref, out = _both(occupancy.occupancy_sample, world, t, None, 4)
    for a, b in zip(ref, out):
        assert np.array_equal(a, b)
    assert ref.mask_camera.any() and ref.mask_lidar.any()


@needs_op
def test_scalar_loop_and_threads_agree(monkeypatch):
    """The AVX2 loop = the scalar one (BEV_RAYCAST_SCALAR=1), one thread = two: keys, faces and coverage."""
    parts = _random_parts(np.random.default_rng(7), 60)
    cam = raycast.make_camera("CAM_FRONT_LEFT", 2)
    visible, rects = raycast._visible(cam, parts)
    group, objs = raycast._coverage_groups(visible)
    args = (cam.planes, raycast._part_table(cam, visible), rects, cam.ground_key, group, len(objs), True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ref = native.zbuffer(*args)
        torch.set_num_threads(2)
        runs = [native.zbuffer(*args)]
        monkeypatch.setenv("BEV_RAYCAST_SCALAR", "1")
        runs.append(native.zbuffer(*args))
    finally:
        torch.set_num_threads(threads)
    for run in runs:
        assert all(np.array_equal(a, b) for a, b in zip(ref, run))
    assert ref[2].sum() > 0


@needs_op
@pytest.mark.parametrize("scalar", ["0", "1"])
def test_slab_nan_products_and_partial_blocks(monkeypatch, scalar):
    """Rays parallel to a slab whose bound is 0 (0 * inf: NaN products, the AVX2 loop's exact blends) and runs of
    every length mod 8 (its masked last block): keys and faces = numpy's _slab_chunk, AVX2 and scalar loops."""
    monkeypatch.setenv("BEV_RAYCAST_SCALAR", scalar)
    rng = np.random.default_rng(4)
    W = 64
    rays = np.stack([rng.uniform(0.5, 1, W), rng.uniform(-0.4, 0.4, W), rng.uniform(-0.3, 0.3, W)])[:, None]
    rays = rays.astype(np.float32)
    rays[2, 0, ::3] = 0.0  # parallel to the z slabs
    rays[1, 0, 1::5] = -0.0  # and to the y slabs (a -0 direction)
    rays[:2, 0, ::7] = [[0.0], [0.3]]  # and to the x slabs, ahead of the last part's y slab
    # yaw (cos, sin), slab bounds near x y z, far x y z: z bounds of 0 (NaN products), a y bound of 0, overlaps; the
    # last part's far x bound 0 (0 * inf = NaN as fmax's second operand: maxps would keep it, fmax drops it).
    table = [[1, 0, 2, -1, 0, 4, 1, 1], [1, 0, 1.5, 0, -1, 3, 0.5, 0], [0.6, 0.8, 1, -2, -0.5, 5, 2, 0.5]]
    table = np.array(table + [[1, 0, -1, 1, -1, 0, 2, 1]], np.float32)
    rects = np.array([[0, 1, 0, 61], [0, 1, 3, 64], [0, 1, 7, 58], [0, 1, 0, 64]], np.int64)  # tails 5, 5, 3, 0
    sky = np.full(W, np.int64(np.float32(np.inf).view(np.int32)) << 32)
    key, face, _ = native.zbuffer(np.ascontiguousarray(rays), table, rects, sky, faces=True)
    ref_key, ref_face, nan = sky.copy(), np.zeros(W, np.int8), 0
    with np.errstate(divide="ignore", invalid="ignore"):
        for p, (_, _, c0, c1) in enumerate(rects.tolist()):
            d = rays[:, 0, c0:c1]
            k, _, f = raycast._slab_chunk(d, table[p : p + 1].T, np.array([c1 - c0]), p)
            nan += int(np.isnan(table[p, 2:5, None] / d).sum())
            better = k < ref_key[c0:c1]
            ref_key[c0:c1] = np.where(better, k, ref_key[c0:c1])
            ref_face[c0:c1] = np.where(better, f, ref_face[c0:c1])
    assert np.array_equal(key, ref_key) and np.array_equal(face, ref_face)
    assert nan > 10 and ((key & 0xFFFFFFFF) > 0).sum() > 20  # NaN products met, parts won


def test_falls_back_to_numpy_without_the_operator(monkeypatch, world):
    """No extension, or one built without the op: the numpy caster runs and renders the same; asking for the
    native caster then is an error that says why."""
    t = world_model.SAMPLE_DT
    cam = raycast.make_camera("CAM_BACK", 4)
    with native.backend("numpy"):
        ref = raycast.render_camera(world, t, cam)
    called = []
    missing = [(_native, "_C", None), (native, "OP_NAME", "_raycast_missing"), (native, "SHADE_OP", "_missing")]
    missing += [(native, "RECTS_OP", "_missing"), (native, "GROUND_OP", "_missing")]
    for patch in missing:
        with monkeypatch.context() as m:
            m.setattr(*patch)
            assert not native.active()
            called.clear()
            m.setattr(raycast, "zbuffer_numpy", lambda *a, f=raycast.zbuffer_numpy: called.append(1) or f(*a))
            out = raycast.render_camera(world, t, cam)
            assert all(np.array_equal(a, b) for a, b in zip(ref[:3], out[:3])) and ref.coverage == out.coverage
            assert lidar.cast(lidar.sensor(), raycast.sample_parts(world, t)).depth.shape == (32, lidar.AZIMUTHS)
            assert called  # the LiDAR went through the numpy z-buffer
            with native.backend("native"), pytest.raises(RuntimeError, match="native ray caster"):
                native.active()


@needs_op
def test_bad_input_is_refused():
    """Wrong dtypes, shapes, rectangles or groups: a TypeError / ValueError naming the argument (the wrapper), a
    RuntimeError naming it from the operator itself."""
    cam = raycast.make_camera("CAM_FRONT", 4)
    H, W = cam.shape
    table = np.zeros((2, 8), np.float32)
    rects = np.array([[0, 2, 0, 3], [1, 4, 5, 9]], np.int64)
    ok = (cam.planes, table, rects, cam.ground_key)
    native.zbuffer(*ok)
    bad = [
        ((cam.planes.astype(np.float64), table, rects, cam.ground_key), TypeError, "rays must be float32"),
        ((cam.planes[:2], table, rects, cam.ground_key), ValueError, r"rays must have shape \(3, \*, \*\)"),
        ((cam.planes, table[:, :7], rects, cam.ground_key), ValueError, r"parts must have shape \(\*, 8\)"),
        ((cam.planes, table, rects.astype(np.int32), cam.ground_key), TypeError, "rects must be int64"),
        ((cam.planes, table, rects[:1], cam.ground_key), ValueError, r"rects must have shape \(2, 4\)"),
        ((cam.planes, table, rects + [[0, 0, 0, W]], cam.ground_key), ValueError, r"rects\[0\].*not within"),
        (
            (cam.planes, table, np.ascontiguousarray(rects[:, [1, 0, 2, 3]]), cam.ground_key),
            ValueError,
            r"rects\[0\].*not within",
        ),
        ((cam.planes, table, rects, cam.ground_key[:-1]), ValueError, "ground_key must have shape"),
        ((cam.planes, table, rects, cam.ground_key, np.array([0, 2]), 2), ValueError, "group values"),
        ((cam.planes, table, rects, cam.ground_key, np.array([0, 1], np.int32), 2), TypeError, "group must be int64"),
        ((cam.planes.transpose(0, 2, 1), table, rects, np.zeros(H * W, np.int64)), ValueError, "C-contiguous"),
        (([0.0], table, rects, cam.ground_key), TypeError, "rays must be a numpy array"),
    ]
    for args, error, message in bad:
        with pytest.raises(error, match=message):
            native.zbuffer(*args)
    # _raycast_shade's wrapper and operator
    key = np.zeros(H * W, np.int64)
    key[5] = 3  # part 2
    image, depth, ids = np.zeros((H, W, 3), np.float32), np.zeros((H, W), np.float32), np.zeros((H, W), np.int32)
    per_part = (np.zeros((2, 3), np.float32), np.ones((2, 3)), np.zeros(2, np.int8), np.zeros((2, 12, 3), np.float32))
    labels = np.zeros(2, np.int32)
    face = np.zeros(H * W, np.int8)
    with pytest.raises(ValueError, match="key names a part beyond"):
        native.shade(key, face, cam.planes, table, *per_part, labels, image, depth, ids)
    with pytest.raises(TypeError, match="image must be float32"):
        native.shade(key * 0, face, cam.planes, table, *per_part, labels, image.astype(np.float64), depth, ids)
    with pytest.raises(ValueError, match=r"colours must have shape \(2, 12, 3\)"):
        native.shade(key * 0, face, cam.planes, table, *per_part[:3], per_part[3][:, :6], labels, image, depth, ids)
    with pytest.raises(RuntimeError, match="names part 2 of 2"):
        native.op(native.SHADE_OP)(
            *map(torch.from_numpy, (key, face, cam.planes, table, *per_part, labels, image, depth, ids))
        )
    # _raycast_rects
    maps = (cam.rotation, cam.translation, cam.intrinsic, np.eye(3), np.zeros(3))
    with pytest.raises(ValueError, match=r"corners must have shape \(\*, 8, 3\)"):
        native.rects(np.zeros((4, 6, 3)), *maps, H, W, 0.1)
    with pytest.raises(TypeError, match="intrinsic must be float64"):
        native.rects(np.zeros((4, 8, 3)), *maps[:2], cam.intrinsic.astype(np.float32), *maps[3:], H, W, 0.1)
    with pytest.raises(RuntimeError, match="the image must have pixels"):
        native.rects(np.zeros((4, 8, 3)), *maps, 0, W, 0.1)
    # _raycast_ground
    n = 4
    args = [np.zeros(n, np.float32), np.zeros(n, np.float32), np.arange(n), np.zeros(2, np.float32)]
    args += [np.zeros((2, 3), np.float32), np.zeros((16, 3), np.uint8), np.zeros(3, np.float32), image]
    scalars = (0.0, 0.0, 1.0, 0.0, 10.0, 1 / 255, 0, 0, 4, 4)
    native.ground(*args, *scalars)
    with pytest.raises(TypeError, match="texels must be uint8"):
        native.ground(*args[:5], args[5].astype(np.int16), *args[6:], *scalars)
    with pytest.raises(ValueError, match=r"fog must have shape \(2, 3\)"):
        native.ground(*args[:4], args[4][:1], *args[5:], *scalars)
    with pytest.raises(RuntimeError, match=r"pixels\[3\] = 90000 is not in the image"):
        native.ground(*args[:2], np.array([0, 1, 2, H * W]), *args[3:], *scalars)
    with pytest.raises(RuntimeError, match="side must be a power of two"):
        native.ground(*args[:5], np.zeros((9, 3), np.uint8), *args[6:], *scalars[:-1], 3)
    t = torch.from_numpy
    op = native.op()
    with pytest.raises(RuntimeError, match="rays must be contiguous float32"):
        op(t(cam.planes).double(), t(table), t(rects), t(cam.ground_key), t(np.full(2, -1)), 0, False)
    with pytest.raises(RuntimeError, match=r"rect 1 \[1, 4, 5, 900\) is not within"):
        op(
            t(cam.planes),
            t(table),
            t(rects + [[0, 0, 0, 0], [0, 0, 0, 891]]),
            t(cam.ground_key),
            t(np.full(2, -1)),
            0,
            False,
        )
    with pytest.raises(RuntimeError, match="group"):
        op(t(cam.planes), t(table), t(rects), t(cam.ground_key), t(np.full(2, 3)), 2, False)


def _off_faces_reference(points: np.ndarray, boxes: lidar.Boxes) -> np.ndarray:
    """lidar._off_faces as it was: two full passes over the boxes."""
    points = points.copy()
    for _ in range(2):
        for b, near, local in lidar._near_boxes(points, boxes, lidar.BOX_GAP):
            off = np.abs(local) - boxes.half[b]
            band = np.all(off <= lidar.BOX_GAP, 1) & np.any(np.abs(off) < lidar.BOX_GAP, 1)
            if not band.any():
                continue
            a, d = local[band], off[band]
            close = np.abs(d) < lidar.BOX_GAP
            pushed = np.sign(a) * (boxes.half[b] + np.where(d >= 0, 2, -2) * lidar.BOX_GAP)
            a[close] = pushed[close]
            points[near[band]] = lidar._from_local(a, boxes.centre[b], boxes.R[b])
    return points


def test_off_faces_second_pass_skips_only_idle_boxes():
    """_off_faces' second pass looks only at boxes a moved point reaches: the same points as two full passes, with
    boxes millimetres apart (points pushed off one face land in the next box's band) and points on the faces."""
    second_pass_mattered = 0
    for seed in range(4):
        rng = np.random.default_rng(seed)
        n = 30
        half = rng.uniform(0.3, 2.0, (n, 3))
        centre = np.zeros((n, 3))
        gaps = rng.choice([0.0005, 0.0015, 0.003, 0.5], n)
        centre[:, 0] = np.cumsum(2 * half[:, 0] + gaps)  # in a row, some touching
        centre[:, 1] = rng.uniform(-0.5, 0.5, n) * (rng.random(n) < 0.5)
        yaw = rng.choice([0.0, 0.0, 0.3], n)
        R = np.array([[[math.cos(a), -math.sin(a), 0], [math.sin(a), math.cos(a), 0], [0, 0, 1]] for a in yaw])
        boxes = lidar.Boxes(list(range(n)), R, centre, half)
        # Points on and around the faces (within a few BOX_GAP), and scattered ones.
        b = rng.integers(0, n, 20_000)
        local = rng.uniform(-1, 1, (len(b), 3)) * half[b]
        axis = rng.integers(0, 3, len(b))
        side = np.sign(rng.normal(size=len(b)))
        local[np.arange(len(b)), axis] = side * (half[b, axis] + rng.uniform(-3, 3, len(b)) * lidar.BOX_GAP)
        on_faces = centre[b] + np.einsum("pij,pj->pi", R[b], local)
        pts = np.concatenate([on_faces, rng.uniform(-5, centre[-1, 0], (5000, 3))])
        ref = _off_faces_reference(pts, boxes)
        with native.backend("numpy"):  # numpy's passes (the native ones: tests/test_lidar_native.py)
            out = lidar._off_faces(pts, boxes)
        assert np.array_equal(out, ref)
        assert np.any(out != pts, 1).sum() > 1000  # the band is exercised
        one = pts.copy()
        lidar._off_faces_pass(one, boxes, None)
        second_pass_mattered += bool(np.any(one != ref))
    assert second_pass_mattered  # some points needed the second pass


def test_part_corners_are_the_einsums():
    """sample_parts' corners (raycast._yawed) = the einsum they replace, signs of zero included, on yaws with exact
    zeros (0, +-pi/2, pi) and random ones; its per-world part rows are the objects' parts."""
    rng = np.random.default_rng(2)
    yaw = np.concatenate([[0.0, math.pi / 2, -math.pi / 2, math.pi, -0.0], rng.uniform(-math.pi, math.pi, 500)])
    c, s = np.cos(yaw), np.sin(yaw)
    R = np.zeros((len(yaw), 3, 3))
    R[:, 0, 0], R[:, 0, 1], R[:, 1, 0], R[:, 1, 1], R[:, 2, 2] = c, -s, s, c, 1
    v = raycast._SIGNS * rng.uniform(0.05, 3, (len(yaw), 3))[:, None]
    v[:3, :, :2] = 0.0  # zero extents: sums of signed zeros
    ref, out = np.einsum("pcj,pij->pci", v, R), raycast._yawed(v, R)
    assert np.array_equal(ref, out) and np.array_equal(np.signbit(ref), np.signbit(out))
    world = world_model.build_world(1, 0, 2, MINI_LOCATIONS["scene-0061"])
    parts = raycast.sample_parts(world, 0.5)
    rows = [p for i in dict.fromkeys(parts.obj.tolist()) for p in world.objects[i].parts]
    assert np.array_equal(parts.half, np.array([p[1] for p in rows], np.float64))
    assert np.array_equal(parts.kind, np.array([p[3] for p in rows]))
    assert len(raycast._object_parts_ego(world, 0.5, []).corners) == 0  # no objects: no parts


@needs_op
def test_jpeg_pixels_agree():
    """_raycast_rgb8 = camera_jpeg's numpy conversion (scale, round half up, clip) on every float32 value class: in
    [0, 1], halfway cases, out of range, infinite, NaN, in the AVX2 blocks of 32 values and in the scalar tail (45 x
    80 x 3 = 337 x 32 + 16); the JPEGs are the same bytes; bad input is refused."""
    rng = np.random.default_rng(0)
    image = rng.uniform(-0.2, 1.2, (45, 80, 3)).astype(np.float32)
    image[0, :, 0] = (np.arange(80, dtype=np.float32) + 0.5) / np.float32(255)  # round-half cases
    image[1, :3] = [[0.0, 1.0, np.float32(0.5 / 255)], [-0.0, np.inf, -np.inf], [1e30, -1e30, 1 - 2**-24]]
    image[1, 3, 0] = image[-1, -1, 0] = np.nan
    with np.errstate(invalid="ignore"):  # NaN's cast: the x86 conversion (0 here, as the kernel's)
        assert np.array_equal(native.rgb8(image), (image * 255.0 + 0.5).clip(0, 255).astype(np.uint8))
    image = np.nan_to_num(image)
    jpegs = _both(sensors.camera_jpeg, np.clip(image, 0, 1), 4, False, "x.jpg")
    assert jpegs[0] == jpegs[1]
    with pytest.raises(TypeError, match="image must be float32"):
        native.rgb8(image.astype(np.float64))
    with pytest.raises(RuntimeError, match=r"_raycast_rgb8: image must be contiguous float32 \(H, W, 3\)"):
        native.op(native.RGB8_OP)(torch.zeros(4, 4))


@needs_op
def test_opcheck():
    """torch.library.opcheck of the four operators (schemas, mutation annotations, fake kernels)."""
    cam = raycast.make_camera("CAM_FRONT", 4)
    parts = _random_parts(np.random.default_rng(3), 12)
    visible, rects = raycast._visible(cam, parts)
    group, objs = raycast._coverage_groups(visible)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    table, H, W = raycast._part_table(cam, visible), *cam.shape
    zbuffer_args = (t(cam.planes), t(table), t(rects), t(cam.ground_key), t(group), len(objs), True)
    torch.library.opcheck(torch.ops.bev._raycast_zbuffer.default, zbuffer_args)
    key, face, _ = torch.ops.bev._raycast_zbuffer(*zbuffer_args)
    origin = raycast._part_frames(cam, visible)[0].astype(np.float32)
    glass = np.zeros(len(table), np.int8)
    out = (torch.zeros(H, W, 3), torch.zeros(H, W), torch.zeros(H, W, dtype=torch.int32))
    per_part = (t(origin), t(visible.half), t(glass), t(visible.cols), t(visible.label))
    torch.library.opcheck(torch.ops.bev._raycast_shade.default, (key, face, t(cam.planes), t(table), *per_part, *out))
    maps = [t(a) for a in (cam.rotation, cam.translation, cam.intrinsic, np.eye(3), np.zeros(3))]
    torch.library.opcheck(torch.ops.bev._raycast_rects.default, (t(parts.corners), *maps, H, W, 0.1))
    n = 6
    ground = (torch.zeros(n), torch.zeros(n), torch.arange(n), torch.zeros(2), torch.zeros(2, 3))
    ground += (torch.zeros(16, 3, dtype=torch.uint8), torch.zeros(3), torch.zeros(H, W, 3))
    torch.library.opcheck(torch.ops.bev._raycast_ground.default, (*ground, 0.0, 0.0, 1.0, 0.0, 10.0, 0.5, 0, 0, 4, 4))
