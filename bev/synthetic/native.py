"""The synthetic world's native ray caster: bev.ops._C's private operators bev::_raycast_zbuffer,
bev::_raycast_shade, bev::_raycast_rects and bev::_raycast_ground (C++, CPU, parallel with at::parallel_for; kernels
in bev/ops/csrc/cpu/raycast_cpu.cpp).

zbuffer computes what bev.synthetic.raycast's numpy caster does with _slab + zbuffer + _front (+ _coverage): per
ray of a camera (or of the LiDAR's panorama, bev.synthetic.lidar) the least z-buffer key over the ground and the
parts tested on it, (float32 depth bits << 32) | (part + 1), with the same float32 operations in the same order,
so the keys are the numpy caster's bit for bit (tests/test_raycast_native.py); optionally the entry face of the
winning part and each annotated object's unoccluded coverage. shade writes the won rays' depth, id and colour
(raycast._colours, glass included) into a camera's buffers; rects bounds the parts' projections (raycast._part_rects);
ground paints the textured, hazed ground (raycast._ground_render). The numpy caster stays the reference.

The LiDAR's point cloud has its own operators (LIDAR_OPS, bev/ops/csrc/cpu/lidar_cpu.cpp): the returns, the moves off
the annotated boxes' faces, the .pcd.bin rows and the points in each box, equal to bev.synthetic.lidar's numpy
functions bit for bit (float64, the same operations in the same order).

Which caster runs: the native one when the extension loaded with this operator (bev.ops._native), else numpy;
BEV_RAYCAST=numpy (environment, read at import) or `backend("numpy")` forces the reference, "native" requires
the operator (an error without it), "auto" is the default.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import numpy as np
import torch

OP_NAME = "_raycast_zbuffer"
SHADE_OP = "_raycast_shade"
RECTS_OP = "_raycast_rects"
GROUND_OP = "_raycast_ground"
OP_NAMES = (OP_NAME, SHADE_OP, RECTS_OP, GROUND_OP)
RGB8_OP = "_raycast_rgb8"  # a render's JPEG pixels (sensors.camera_jpeg)
LIDAR_OPS = ("_lidar_returns", "_lidar_off_faces", "_lidar_cloud", "_lidar_count", "_lidar_intensity")  # lidar_cpu
BACKENDS = ("auto", "native", "numpy")
_backend = os.environ.get("BEV_RAYCAST", "auto")
if _backend not in BACKENDS:
    raise ValueError(f"BEV_RAYCAST must be one of {BACKENDS}, got {_backend!r}")


_found: dict[str, object] = {}  # name -> operator or None: torch.ops' lookup costs ~10 us, asked ~150 times a sample


_loader = None  # bev.ops._native, imported on first use (an import statement costs ~1 us each time it runs)


def _ext():
    global _loader
    if _loader is None:
        from bev.ops import _native

        _loader = _native
    return _loader


def op(name: str | None = None):
    """The native operator `name` (default OP_NAME), or None when bev.ops._C did not load or was built without it."""
    if _ext()._C is None:
        return None
    name = name or OP_NAME
    if name not in _found:
        try:
            _found[name] = getattr(torch.ops.bev, name)
        except (AttributeError, RuntimeError):
            _found[name] = None
    return _found[name]


def active(names: tuple[str, ...] | None = None) -> bool:
    """Whether the casters of bev.synthetic (cameras, LiDAR, occupancy masks) run natively now; with `names`
    (LIDAR_OPS), whether those operators do (the LiDAR's point cloud)."""
    if _backend == "numpy":
        return False
    names = (OP_NAME, SHADE_OP, RECTS_OP, GROUND_OP) if names is None else names
    if all(op(name) is not None for name in names):
        return True
    if _backend == "native":
        raise RuntimeError(
            "the native ray caster was asked for (BEV_RAYCAST=native) but bev.ops._C lacks one of "
            f"{names} "
            f"({_ext().LOAD_ERROR or 'a build without it'}); rebuild with `python setup.py build_ext --inplace`"
        )
    return False


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Run the casters with `name` ("auto", "native" or "numpy") inside the block (this process)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    saved, _backend = _backend, name
    try:
        yield
    finally:
        _backend = saved


def _check(name: str, a, dtype, shape: tuple) -> None:
    """`a` is a C-contiguous numpy array of `dtype` and `shape` (None: any size)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise TypeError(f"{name} must be {np.dtype(dtype).name}, got {a.dtype.name}")
    if a.ndim != len(shape) or any(s is not None and s != n for s, n in zip(shape, a.shape)):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"{name} must have shape {want}, got {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def zbuffer(
    rays: np.ndarray,
    parts: np.ndarray,
    rects: np.ndarray,
    ground_key: np.ndarray,
    group: np.ndarray | None = None,
    num_groups: int = 0,
    faces: bool = False,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Cast rays (3, H, W) float32 planes (raycast.Camera.planes) against parts (P, 8) float32 rows [yaw cos, sin,
    slab near x y z, far x y z] (raycast._part_table), part p on the rays of rects[p] = [r0, r1, c0, c1) (P, 4)
    int64, over ground_key (H * W,) int64 (raycast.Camera.ground_key). Returns the least key per ray (H * W,)
    int64; the entry face (H * W,) int8 of the part that wins each ray (0 where the ground or sky does) when
    `faces`, else None; and per group of parts (group (P,) int64 in [-1, num_groups), -1: none) the rays any of
    its parts hits, occluded or not, (num_groups,) int64."""
    _check("rays", rays, np.float32, (3, None, None))
    _check("parts", parts, np.float32, (None, 8))
    P, (H, W) = len(parts), rays.shape[1:]
    _check("rects", rects, np.int64, (P, 4))
    _check("ground_key", ground_key, np.int64, (H * W,))
    if group is None:
        group, num_groups = np.full(P, -1, np.int64), 0
    _check("group", group, np.int64, (P,))
    bad = (rects[:, 0] < 0) | (rects[:, 0] > rects[:, 1]) | (rects[:, 1] > H)
    bad |= (rects[:, 2] < 0) | (rects[:, 2] > rects[:, 3]) | (rects[:, 3] > W)
    if bad.any():
        p = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"rects[{p}] = {rects[p].tolist()} is not within the ({H}, {W}) image: "
            "0 <= r0 <= r1 <= H, 0 <= c0 <= c1 <= W"
        )
    if P and (group.min() < -1 or group.max() >= num_groups):
        raise ValueError(f"group values must lie in [-1, num_groups = {num_groups})")
    fn = op()
    if fn is None:
        raise RuntimeError(f"bev.ops._C has no {OP_NAME}: use the numpy caster (bev.synthetic.raycast)")
    t = torch.from_numpy
    key, face, coverage = fn(t(rays), t(parts), t(rects), t(ground_key), t(group), int(num_groups), bool(faces))
    return key.numpy(), face.numpy() if faces else None, coverage.numpy()


def shade(
    key: np.ndarray,
    face: np.ndarray,
    rays: np.ndarray,
    parts: np.ndarray,
    origin: np.ndarray,
    half: np.ndarray,
    glass: np.ndarray,
    colours: np.ndarray,
    label: np.ndarray,
    image: np.ndarray,
    depth: np.ndarray,
    ids: np.ndarray,
) -> None:
    """Write the rays that parts win (zbuffer's key, part field > 0, and face) into a camera's image (H, W, 3)
    float32, depth (H, W) float32 and ids (H, W) int32, in place: raycast._colours and render_camera's writes.
    Per part: parts (P, 8) as zbuffer's, origin (P, 3) float32 the camera centre in its frame, half (P, 3) float64,
    glass (P,) int8 (1 CABIN, 2 WINDOWS, 0 neither), colours (P, 12, 3) float32, label (P,) int32."""
    _check("rays", rays, np.float32, (3, None, None))
    H, W = rays.shape[1:]
    _check("parts", parts, np.float32, (None, 8))
    P = len(parts)
    for name, a, dtype, shape in (
        ("key", key, np.int64, (H * W,)),
        ("face", face, np.int8, (H * W,)),
        ("origin", origin, np.float32, (P, 3)),
        ("half", half, np.float64, (P, 3)),
        ("glass", glass, np.int8, (P,)),
        ("colours", colours, np.float32, (P, 12, 3)),
        ("label", label, np.int32, (P,)),
        ("image", image, np.float32, (H, W, 3)),
        ("depth", depth, np.float32, (H, W)),
        ("ids", ids, np.int32, (H, W)),
    ):
        _check(name, a, dtype, shape)
    if len(key) and int(_low_halves(key).max()) > P:
        raise ValueError(f"key names a part beyond the {P} parts")
    fn = op(SHADE_OP)
    if fn is None:
        raise RuntimeError(f"bev.ops._C has no {SHADE_OP}: use the numpy caster (bev.synthetic.raycast)")
    t = torch.from_numpy
    fn(*(t(a) for a in (key, face, rays, parts, origin, half, glass, colours, label, image, depth, ids)))


def _low_halves(key: np.ndarray) -> np.ndarray:
    """The low 32 bits of int64 keys as a strided uint32 view (no temporary array)."""
    return key.view(np.uint32)[0 if sys.byteorder == "little" else 1 :: 2]


def rects(corners: np.ndarray, rotation, translation, intrinsic, post_rot, post_tran, H: int, W: int, near: float):
    """(P, 4) int64 pixel rectangles [r0, r1, c0, c1) bounding the projections of boxes with corners (P, 8, 3)
    float64 (ego frame) in a camera (camera->ego rotation (3, 3), translation (3,), intrinsic (3, 3), post_rot (3, 3)
    and post_tran (3,), float64) of H x W pixels, clipped at camera depth `near`: raycast._part_rects."""
    _check("corners", corners, np.float64, (None, 8, 3))
    mats = {"rotation": rotation, "translation": translation, "intrinsic": intrinsic}
    mats.update(post_rot=post_rot, post_tran=post_tran)
    for name, a in mats.items():
        _check(name, a, np.float64, (3,) if name.endswith("translation") or name == "post_tran" else (3, 3))
    fn = op(RECTS_OP)
    if fn is None:
        raise RuntimeError(f"bev.ops._C has no {RECTS_OP}: use the numpy caster (bev.synthetic.raycast)")
    t = torch.from_numpy
    return fn(t(corners), *(t(a) for a in mats.values()), int(H), int(W), float(near)).numpy()


def ground(gx, gy, pixels, clear, fog, texels, grass, image, e0, e1, c, s, scale, unit, col0, row0, size, side) -> None:
    """Paint the ground rays into `image` (H, W, 3) float32 (sky already there), in place: raycast._ground_render.
    Per ground ray: ego-frame gx, gy (N,) float32, flat pixel (N,) int64; the first K hazed with clear (K,) and fog
    (K, 3) float32. texels (side * side, 3) uint8 is the ring of map tiles (raycast._Ring), the window of tiles from
    texel (col0, row0), `size` texels wide, grass (3,) float32 beyond it; ego pose e0, e1, yaw cos c, sin s; `scale`
    texels a metre; `unit` the colour of texel value 1."""
    n, k = len(gx), len(clear)
    for name, a, dtype, shape in (
        ("gx", gx, np.float32, (n,)),
        ("gy", gy, np.float32, (n,)),
        ("pixels", pixels, np.int64, (n,)),
        ("clear", clear, np.float32, (k,)),
        ("fog", fog, np.float32, (k, 3)),
        ("texels", texels, np.uint8, (side * side, 3)),
        ("grass", grass, np.float32, (3,)),
        ("image", image, np.float32, (None, None, 3)),
    ):
        _check(name, a, dtype, shape)
    fn = op(GROUND_OP)
    if fn is None:
        raise RuntimeError(f"bev.ops._C has no {GROUND_OP}: use the numpy caster (bev.synthetic.raycast)")
    t = torch.from_numpy
    scalars = (float(e0), float(e1), float(c), float(s), float(scale), float(unit))
    fn(
        *(t(a) for a in (gx, gy, pixels, clear, fog, texels, grass, image)),
        *scalars,
        int(col0),
        int(row0),
        int(size),
        int(side),
    )


def _lidar_op(name: str):
    fn = op(name)
    if fn is None:
        raise RuntimeError(f"bev.ops._C has no {name}: use the numpy LiDAR (bev.synthetic.lidar)")
    return fn


def lidar_returns(depth: np.ndarray, rays: np.ndarray, origin: np.ndarray, jitter: np.ndarray):
    """The returns of a scan's depth (BEAMS, AZIMUTHS) float32 (inf: none) along rays (BEAMS * AZIMUTHS, 3) float32
    from origin (3,) float64, each range plus jitter (N,) float64 (one per return): (N, 3) float64 ego points in
    firing order (azimuth step by step, the rings of each) and their beams (N,) int64, as lidar.point_cloud's."""
    _check("depth", depth, np.float32, (None, None))
    _check("rays", rays, np.float32, (depth.size, 3))
    _check("origin", origin, np.float64, (3,))
    _check("jitter", jitter, np.float64, (None,))
    returns = int(np.count_nonzero(np.isfinite(depth)))
    if len(jitter) != returns:
        raise ValueError(f"jitter must hold one value per return ({returns}), got {len(jitter)}")
    points, beam = _lidar_op(LIDAR_OPS[0])(*map(torch.from_numpy, (depth, rays, origin, jitter)))
    return points.numpy(), beam.numpy()


def _box_arrays(centre, R, half, reach) -> tuple:
    """Annotated boxes (B,) as the kernels take them: centre (B, 3), R (B, 3, 3), half (B, 3), reach (B,) float64."""
    B = len(centre)
    for name, a, shape in (
        ("centre", centre, (B, 3)),
        ("R", R, (B, 3, 3)),
        ("half", half, (B, 3)),
        ("reach", reach, (B,)),
    ):
        _check(name, a, np.float64, shape)
    return tuple(map(torch.from_numpy, (centre, R, half, reach)))


def lidar_off_faces(points: np.ndarray, centre, R, half, reach) -> None:
    """lidar._off_faces in place on points (N, 3) float64, boxes per _box_arrays (reach: |half| + BOX_GAP)."""
    _check("points", points, np.float64, (None, 3))
    _lidar_op(LIDAR_OPS[1])(torch.from_numpy(points), *_box_arrays(centre, R, half, reach))


def lidar_cloud(points: np.ndarray, value: np.ndarray, ring: np.ndarray, rotation, translation):
    """The .pcd.bin rows (N, 5) float32 of ego points (N, 3) float64 with intensity value (N,) float64 and ring (N,)
    int64 for a LiDAR at rotation (3, 3) / translation (3,) float64 (lidar -> ego); and (N, 3) float64 the ego points
    a reader gets back from those rows (lidar.to_ego)."""
    n = len(points)
    for name, a, dtype, shape in (
        ("points", points, np.float64, (n, 3)),
        ("value", value, np.float64, (n,)),
        ("ring", ring, np.int64, (n,)),
        ("rotation", rotation, np.float64, (3, 3)),
        ("translation", translation, np.float64, (3,)),
    ):
        _check(name, a, dtype, shape)
    cloud, ego = _lidar_op(LIDAR_OPS[2])(*map(torch.from_numpy, (points, value, ring, rotation, translation)))
    return cloud.numpy(), ego.numpy()


def lidar_count(points: np.ndarray, centre, R, half, reach) -> np.ndarray:
    """(B,) int64 the points (N, 3) float64 inside each box, faces included (lidar.points_in_boxes; reach: |half|)."""
    _check("points", points, np.float64, (None, 3))
    return _lidar_op(LIDAR_OPS[3])(torch.from_numpy(points), *_box_arrays(centre, R, half, reach)).numpy()


def rgb8(image: np.ndarray) -> np.ndarray:
    """(H, W, 3) uint8 pixels of a render (H, W, 3) float32 RGB in [0, 1]: sensors.camera_jpeg's conversion."""
    _check("image", image, np.float32, (None, None, 3))
    fn = op(RGB8_OP)
    if fn is None:
        raise RuntimeError(f"bev.ops._C has no {RGB8_OP}: use sensors.camera_jpeg's numpy conversion")
    return fn(torch.from_numpy(image)).numpy()


def lidar_intensity(points, part, part_value, spread, ground_value, labels, e0, e1, m00, m01, m10, m11, scale, *window):
    """lidar.intensity's values (N,) float64 of returns at ego points (N, 3) float64 on part (N,) int64 (-1: the
    ground): part_value (P,) float64 per part, ground_value (G,) float64 per ground class, times spread (N,) float64,
    rounded and clipped to 0-255. A ground point's class is labels (side * side,) uint8 (raycast's ring of tiles,
    window (col0, row0, size, side) as ground's) at its map texel: ego -> map by (e0, e1) + [[m00, m01], [m10, m11]],
    `scale` texels a metre; NaN where it lies beyond the window."""
    n, P = len(points), len(part_value)
    for name, a, dtype, shape in (
        ("points", points, np.float64, (n, 3)),
        ("part", part, np.int64, (n,)),
        ("part_value", part_value, np.float64, (P,)),
        ("spread", spread, np.float64, (n,)),
        ("ground_value", ground_value, np.float64, (None,)),
        ("labels", labels, np.uint8, (None,)),
    ):
        _check(name, a, dtype, shape)
    if n and int(part.max()) >= P:
        raise ValueError(f"part names a part beyond the {P} parts")
    fn = _lidar_op(LIDAR_OPS[4])
    t = torch.from_numpy
    scalars = [float(v) for v in (e0, e1, m00, m01, m10, m11, scale)]
    tensors = (points, part, part_value, spread, ground_value, labels)
    return fn(*map(t, tensors), *scalars, *(int(w) for w in window)).numpy()
