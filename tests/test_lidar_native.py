"""The synthetic LiDAR's native point cloud (bev.synthetic.native's LIDAR_OPS, bev/ops/csrc/cpu/lidar_cpu.cpp) is
numpy's (bev.synthetic.lidar, the reference) bit for bit: the returns, the moves off the boxes' faces, the .pcd.bin
rows and the points counted in each box, on random boxes and on the synthetic world; a written set is the same
bytes with either; without the operators numpy runs; bad input is refused with a message that names it."""

from __future__ import annotations

import filecmp
import math

import numpy as np
import pytest
import torch

from bev.data.rig import MINI_LOCATIONS
from bev.ops import _native
from bev.synthetic import lidar, native, raycast
from bev.synthetic import world as world_model
from bev.synthetic.world import SOLID
from bev.synthetic.writer import make_synthetic

needs_ops = pytest.mark.skipif(
    any(native.op(n) is None for n in native.LIDAR_OPS), reason="bev.ops._C was built without the LiDAR operators"
)


@pytest.fixture(scope="module")
def world():
    return world_model.build_world(3, 1, 6, MINI_LOCATIONS["scene-0061"])


def _yaws(yaw: np.ndarray) -> np.ndarray:
    c, s = np.cos(yaw), np.sin(yaw)
    R = np.zeros((len(yaw), 3, 3))
    R[:, 0, 0], R[:, 0, 1], R[:, 1, 0], R[:, 1, 1], R[:, 2, 2] = c, -s, s, c, 1
    return R


def _random_boxes(rng: np.random.Generator, n: int, objects: int) -> tuple[lidar.Boxes, raycast.Parts]:
    """n yawed boxes on the ground within 40 m, every third one millimetres from the one before (points pushed off one
    land in the other's band), as annotated boxes and as the parts a scan meets (objects of the world, in turn)."""
    yaw, half = rng.uniform(-math.pi, math.pi, n), rng.uniform(0.3, 3.0, (n, 3))
    centre = np.concatenate([rng.uniform(-40, 40, (n, 2)), half[:, 2:]], 1)
    for i in range(2, n, 3):  # beside box i - 1 along its x axis, a gap of 0.5-3 mm
        yaw[i], half[i, 2], centre[i, 2] = yaw[i - 1], half[i - 1, 2], centre[i - 1, 2]
        step = half[i - 1, 0] + half[i, 0] + rng.choice([0.0005, 0.0015, 0.003])
        centre[i, :2] = centre[i - 1, :2] + step * np.array([math.cos(yaw[i]), math.sin(yaw[i])])
    R = _yaws(yaw)
    signs = np.array([[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)], np.float64)
    corners = centre[:, None] + np.einsum("pcj,pij->pci", signs * half[:, None], R)
    obj = np.arange(n) % objects
    parts = raycast.Parts(
        (obj + 1).astype(np.int32), obj, R, centre, half, np.zeros((n, 12, 3), np.float32), np.full(n, SOLID), corners
    )
    return lidar.Boxes(list(range(n)), R, centre, half), parts


def _on_faces(rng: np.random.Generator, boxes: lidar.Boxes, n: int) -> np.ndarray:
    """n ego points on or within a few BOX_GAP of the boxes' faces, a quarter of them on a face exactly (in the box
    frame: whether the float64 round trip keeps them in is up to the last bits)."""
    b = rng.integers(0, len(boxes.obj), n)
    local = rng.uniform(-1, 1, (n, 3)) * boxes.half[b]
    axis, side = rng.integers(0, 3, n), np.sign(rng.normal(size=n))
    offset = np.where(rng.random(n) < 0.25, 0.0, rng.uniform(-3, 3, n) * lidar.BOX_GAP)
    local[np.arange(n), axis] = side * (boxes.half[b, axis] + offset)
    return boxes.centre[b] + np.einsum("pij,pj->pi", boxes.R[b], local)


def _both(fn, *args):
    with native.backend("numpy"):
        ref = fn(*args)
    with native.backend("native"):
        out = fn(*args)
    return ref, out


@needs_ops
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cloud_and_counts_agree_on_random_boxes(seed, world):
    """_cloud (returns, noise, moves off the faces, intensity, LIDAR_TOP rows) and the counts per box: the same
    bytes; the native ego points are what lidar.to_ego reads back from the rows."""
    boxes, parts = _random_boxes(np.random.default_rng(seed), 60, len(world.objects))
    with native.backend("numpy"):
        scan = lidar.cast(lidar.sensor(), parts)
    (ref, none), (out, ego) = _both(
        lambda: lidar._cloud(world, 0.0, scan, parts, boxes, np.random.default_rng(seed), lidar.RANGE_NOISE)
    )
    assert none is None and ref.tobytes() == out.tobytes()
    assert np.array_equal(ego, lidar.to_ego(out))
    ref_counts, counts = _both(lidar.points_in_boxes, ego, boxes)
    assert counts == ref_counts and sum(counts.values()) > 1000


@needs_ops
def test_off_faces_agree_with_boxes_millimetres_apart():
    """Points on and around the faces of boxes millimetres apart: the two native passes move them as numpy's
    _off_faces does, to the last bit (points pushed off one box into the next one's band need the second pass)."""
    second_pass_mattered = 0
    for seed in range(3):
        rng = np.random.default_rng(seed)
        boxes, _ = _random_boxes(rng, 45, 1)
        pts = np.concatenate([_on_faces(rng, boxes, 20_000), rng.uniform(-45, 45, (5000, 3))])
        ref, out = _both(lidar._off_faces, pts, boxes)
        assert np.array_equal(out, ref)
        assert np.any(out != pts, 1).sum() > 1000
        one = pts.copy()
        lidar._off_faces_pass(one, boxes, None)
        second_pass_mattered += bool(np.any(one != ref))
    assert second_pass_mattered


@needs_ops
def test_counts_agree_on_the_faces():
    """Points exactly on the faces (in or out by the last bits of the float64 products) and near them: the same
    counts; the kernel's products are numpy's elementwise ones, in the same order."""
    rng = np.random.default_rng(4)
    boxes, _ = _random_boxes(rng, 40, 1)
    pts = _on_faces(rng, boxes, 40_000)
    ref, out = _both(lidar.points_in_boxes, pts, boxes)
    assert out == ref and 0 < sum(ref.values()) < len(pts)


@needs_ops
@pytest.mark.parametrize("t", [0.0, 1.5, 2.5])
def test_world_key_frames_agree(t, world):
    """key_frame of the synthetic world: the cloud's bytes and num_lidar_pts."""
    annotated = list(range(len(world.objects)))
    ref, out = _both(lambda: lidar.key_frame(world, t, annotated, np.random.default_rng(7)))
    assert ref.cloud.tobytes() == out.cloud.tobytes() and ref.num_points == out.num_points
    assert sum(out.num_points.values()) > 100


@needs_ops
def test_intensity_agrees_beyond_the_tiles(world):
    """Intensities of part and ground returns, some ground ones beyond the ring of map tiles (no LiDAR return lies
    there, but any point is served: numpy's classes for those)."""
    rng = np.random.default_rng(3)
    pts = np.concatenate([rng.uniform(-60, 60, (3000, 3)), rng.uniform(200, 300, (200, 3))])
    parts = raycast.sample_parts(world, 0.5)
    part = np.where(rng.random(len(pts)) < 0.3, rng.integers(0, len(parts.obj), len(pts)), -1)
    ref, out = _both(lambda: lidar.intensity(world, 0.5, parts, part, pts, np.random.default_rng(1)))
    assert np.array_equal(ref, out) and len(np.unique(out[-200:])) > 3


@needs_ops
def test_written_sets_are_the_same_bytes(tmp_path):
    """A set of 1 scene x 8 samples (cameras, key-frame clouds, a sweep, occupancy, tables) written with the numpy
    casters and LiDAR and with the native ones: every file the same bytes."""
    roots = {}
    for name in ("numpy", "native"):
        with native.backend(name):
            kwargs = dict(workers=1, progress=False, render_scale=4, image_size="render", lidar_sweeps=1)
            roots[name] = make_synthetic(tmp_path / name, 1, 8, **kwargs)
    files = sorted(p.relative_to(roots["numpy"]) for p in roots["numpy"].rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(roots["native"]) for p in roots["native"].rglob("*") if p.is_file())
    assert sum(str(f).endswith(".pcd.bin") for f in files) == 15
    _, differ, errors = filecmp.cmpfiles(roots["numpy"], roots["native"], [str(f) for f in files], shallow=False)
    assert not differ and not errors


def test_falls_back_to_numpy_without_the_operators(monkeypatch, world):
    """No extension, or one without a LiDAR operator: numpy makes the same key frame; asking for the native casters
    then is an error that says why."""
    with native.backend("numpy"):
        ref = lidar.key_frame(world, 0.5, [0, 1, 2], np.random.default_rng(1))
    called = []
    monkeypatch.setattr(lidar, "_off_faces_pass", lambda *a, f=lidar._off_faces_pass: called.append(1) or f(*a))
    for patch in [(_native, "_C", None), (native, "LIDAR_OPS", (*native.LIDAR_OPS[:3], "_lidar_missing"))]:
        with monkeypatch.context() as m:
            m.setattr(*patch)
            called.clear()
            assert not native.active(native.LIDAR_OPS)
            out = lidar.key_frame(world, 0.5, [0, 1, 2], np.random.default_rng(1))
            assert ref.cloud.tobytes() == out.cloud.tobytes() and ref.num_points == out.num_points
            assert called
            with native.backend("native"), pytest.raises(RuntimeError, match="_lidar_missing|native ray caster"):
                native.active(native.LIDAR_OPS)


@needs_ops
def test_bad_input_is_refused():
    """Wrong dtypes, shapes or jitter lengths: a TypeError / ValueError naming the argument (the wrappers), a
    RuntimeError naming it from the operators themselves."""
    spin = lidar.sensor()
    depth = np.full((lidar.BEAMS, lidar.AZIMUTHS), np.inf, np.float32)
    depth[3, :10] = 5.0
    rays, origin = spin.rays.reshape(-1, 3), spin.translation
    points, beam = native.lidar_returns(depth, rays, origin, np.zeros(10))
    assert points.shape == (10, 3) and np.array_equal(beam, 3 * lidar.AZIMUTHS + np.arange(10))
    with pytest.raises(ValueError, match=r"jitter must hold one value per return \(10\), got 9"):
        native.lidar_returns(depth, rays, origin, np.zeros(9))
    with pytest.raises(TypeError, match="depth must be float32"):
        native.lidar_returns(depth.astype(np.float64), rays, origin, np.zeros(10))
    with pytest.raises(ValueError, match=r"rays must have shape \(34560, 3\)"):
        native.lidar_returns(depth, rays[:-1], origin, np.zeros(10))
    boxes = lidar._native_boxes(_random_boxes(np.random.default_rng(0), 4, 1)[0], 0.0)
    with pytest.raises(ValueError, match=r"points must have shape \(\*, 3\)"):
        native.lidar_count(points[:, :2].copy(), *boxes)
    with pytest.raises(ValueError, match=r"R must have shape \(4, 3, 3\)"):
        native.lidar_off_faces(points, boxes[0], boxes[1][:3], *boxes[2:])
    with pytest.raises(TypeError, match="half must be float64"):
        native.lidar_count(points, *boxes[:2], boxes[2].astype(np.float32), boxes[3])
    with pytest.raises(ValueError, match=r"ring must have shape \(10\), got \(9,\)"):
        native.lidar_cloud(points, np.zeros(10), np.zeros(9, np.int64), spin.rotation, origin)
    labels, part, points = np.zeros(64, np.uint8), np.array([-1, 0, 2] + [-1] * 7), np.full((10, 3), 0.35)
    window = (0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 10.0, 0, 0, 8, 8)
    with pytest.raises(ValueError, match="part names a part beyond the 2 parts"):
        native.lidar_intensity(points, part, np.ones(2), np.ones(10), np.ones(7), labels, *window)
    with pytest.raises(ValueError, match=r"labels must have shape \(\*\), got \(64, 1\)"):
        native.lidar_intensity(points, part, np.ones(3), np.ones(10), np.ones(7), labels[:, None], *window)
    t = torch.from_numpy
    with pytest.raises(RuntimeError, match=r"_lidar_intensity: labels must be contiguous Byte \[64\]"):
        native.op("_lidar_intensity")(*map(t, (points, part, np.ones(3), np.ones(10), np.ones(7), labels[:9])), *window)
    with pytest.raises(RuntimeError, match=r"_lidar_intensity: labels\[27\] = 9 names no ground class of 7"):
        native.lidar_intensity(points, part, np.ones(3), np.ones(10), np.ones(7), labels + 9, *window)
    with pytest.raises(RuntimeError, match=r"_lidar_returns: jitter must hold one value per finite depth \(10\)"):
        native.op("_lidar_returns")(t(depth), t(rays), t(origin), torch.zeros(11, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="_lidar_count: reach must be contiguous Double"):
        native.op("_lidar_count")(t(points), *map(t, boxes[:3]), t(boxes[3]).float())
    with pytest.raises(RuntimeError, match="_lidar_cloud: value must be contiguous Double"):
        native.op("_lidar_cloud")(t(points), torch.zeros(3), t(beam), t(spin.rotation), t(origin))


@needs_ops
def test_opcheck():
    """torch.library.opcheck of the LiDAR operators and the JPEG pixels' (schemas, mutation annotations, fake
    kernels): the shapes the fakes give are the kernels'."""
    rng = np.random.default_rng(5)
    t = torch.from_numpy
    depth = np.where(rng.random((4, 6)) < 0.5, rng.uniform(2, 30, (4, 6)), np.inf).astype(np.float32)
    rays = rng.normal(size=(24, 3)).astype(np.float32)
    jitter = rng.normal(size=int(np.isfinite(depth).sum()))
    returns = (t(depth), t(rays), t(np.zeros(3)), t(jitter))
    torch.library.opcheck(torch.ops.bev._lidar_returns.default, returns)
    points = rng.uniform(-5, 5, (40, 3))
    boxes = (
        t(rng.uniform(-3, 3, (2, 3))),
        t(_yaws(rng.uniform(-3, 3, 2))),
        t(np.full((2, 3), 1.5)),
        t(np.full(2, 3.0)),
    )
    torch.library.opcheck(torch.ops.bev._lidar_off_faces.default, (t(points.copy()), *boxes))
    torch.library.opcheck(torch.ops.bev._lidar_count.default, (t(points), *boxes))
    cloud = (t(points), t(rng.uniform(0, 1, 40)), t(np.arange(40) % 32), t(np.eye(3)), t(np.zeros(3)))
    torch.library.opcheck(torch.ops.bev._lidar_cloud.default, cloud)
    torch.library.opcheck(torch.ops.bev._raycast_rgb8.default, (torch.rand(3, 4, 3),))
    part = t(np.where(np.arange(40) % 3 == 0, -1, np.arange(40) % 2))
    values = (t(np.array([10.0, 20.0])), t(np.ones(40)), t(np.array([5.0, 6.0])), t(np.zeros(16, np.uint8)))
    scalars = (0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.5, 0, 0, 4, 4)
    inside = rng.uniform(0.1, 7.9, (40, 3))  # every ground point on the 4 x 4 texel window: no NaN to compare
    torch.library.opcheck(torch.ops.bev._lidar_intensity.default, (t(inside), part, *values, *scalars))
