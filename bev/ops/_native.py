"""Loads the native extension `bev.ops._C` and registers autograd and fake (meta) kernels for
its operators. The schemas are declared in csrc/ops.cpp, the kernels registered per device in
csrc/cpu/ and csrc/cuda/; a missing or broken build only disables this backend.

Operators (namespace `bev`; a leading underscore marks an internal step):
  voxel_sum(feats, keys, order, offsets, grid_shape) -> out        out (B, C, Z, X, Y)
  bev_pool(depth, feats, keys, order, offsets, grid_shape) -> out
  _voxel_keys(coords, grid_shape, batch_column) -> keys           flat voxel keys (CPU only)
  _sort_keys(keys, num_voxels) -> (order, offsets)                stable sort: counting (CPU),
                                                                  device radix sort (CUDA)
  _voxel_sum_backward(grad_out, keys, order, offsets) -> grad_feats
  _bev_pool_backward(grad_out, depth, feats, keys, offsets) -> (grad_depth, grad_feats)
  _raycast_zbuffer(rays, parts, rects, ground_key, group, num_groups, faces) -> (key, face, coverage)
  _raycast_shade(key, face, rays, parts, origin, half, glass, colours, label, image!, depth!, ids!)
  _raycast_rects(corners, rotation, translation, intrinsic, post_rot, post_tran, H, W, near) -> rects
  _raycast_ground(gx, gy, pixels, clear, fog, texels, grass, image!, pose..., window...)
  _raycast_rgb8(image) -> pixels
                                                                  the synthetic world's ray caster (CPU only;
                                                                  bev.synthetic.native)
  _lidar_returns(depth, rays, origin, jitter) -> (points, beam)
  _lidar_off_faces(points!, centre, R, half, reach)
  _lidar_cloud(points, value, ring, rotation, translation) -> (cloud, ego)
  _lidar_count(points, centre, R, half, reach) -> counts
  _lidar_intensity(points, part, part_value, spread, ground_value, labels, pose..., window...) -> value
                                                                  the synthetic LiDAR's point cloud (CPU only;
                                                                  bev.synthetic.native)
"""

from __future__ import annotations

import torch

LOAD_ERROR: str | None = None
CUDA_BUILT = False
try:
    from . import _C  # noqa: F401  (registers the operators)

    CUDA_BUILT = bool(_C.cuda_built())
except Exception as e:  # ImportError, OSError (undefined symbol, ABI mismatch), ...
    _C = None
    LOAD_ERROR = f"{type(e).__name__}: {e}"


def available(device: torch.device | str | None = None) -> bool:
    """Whether native kernels exist for `device` (any device if None)."""
    if _C is None:
        return False
    if device is None:
        return True
    kind = torch.device(device).type
    return kind == "cpu" or (kind == "cuda" and CUDA_BUILT)


def unavailable_reason(device: torch.device | str) -> str:
    if _C is None:
        return f"the native extension bev.ops._C did not load ({LOAD_ERROR}); rebuild with `pip install --no-build-isolation -e .`"
    return f"the native extension was built without kernels for {torch.device(device).type} devices"


# Autograd of the two public operators: the backward is its own native operator.
def _voxel_sum_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[1:4])  # keys, order, offsets


def _voxel_sum_grad(ctx, grad_out):
    keys, order, offsets = ctx.saved_tensors
    return torch.ops.bev._voxel_sum_backward(grad_out, keys, order, offsets), None, None, None, None


def _bev_pool_setup(ctx, inputs, output):
    depth, feats, keys, _, offsets = inputs[:5]
    ctx.save_for_backward(depth, feats, keys, offsets)


def _bev_pool_grad(ctx, grad_out):
    depth, feats, keys, offsets = ctx.saved_tensors
    grad_depth, grad_feats = torch.ops.bev._bev_pool_backward(grad_out, depth, feats, keys, offsets)
    return grad_depth, grad_feats, None, None, None, None


def _register_fakes() -> None:
    """Output shapes without computing them (torch.compile, export, meta tensors)."""

    @torch.library.register_fake("bev::_voxel_keys")
    def _voxel_keys_fake(coords, grid_shape, batch_column):
        n = coords.shape[0] if batch_column else coords.numel() // 3
        return coords.new_empty(n, dtype=torch.long)

    @torch.library.register_fake("bev::_sort_keys")
    def _sort_keys_fake(keys, num_voxels):
        return torch.empty_like(keys), keys.new_empty(num_voxels + 1)

    @torch.library.register_fake("bev::voxel_sum")
    def _voxel_sum_fake(feats, keys, order, offsets, grid_shape):
        B, Z, X, Y = grid_shape
        return feats.new_empty(B, feats.shape[1], Z, X, Y)

    @torch.library.register_fake("bev::_voxel_sum_backward")
    def _voxel_sum_backward_fake(grad_out, keys, order, offsets):
        return grad_out.new_empty(keys.shape[0], grad_out.shape[1])

    @torch.library.register_fake("bev::bev_pool")
    def _bev_pool_fake(depth, feats, keys, order, offsets, grid_shape):
        B, Z, X, Y = grid_shape
        return feats.new_empty(B, feats.shape[-1], Z, X, Y)

    @torch.library.register_fake("bev::_bev_pool_backward")
    def _bev_pool_backward_fake(grad_out, depth, feats, keys, offsets):
        return torch.empty_like(depth), torch.empty_like(feats)


def _register_raycast_fakes() -> None:
    """Fake kernels of the synthetic world's ray caster (bev.synthetic.native): output shapes for opcheck."""

    @torch.library.register_fake("bev::_raycast_zbuffer")
    def _raycast_zbuffer_fake(rays, parts, rects, ground_key, group, num_groups, faces):
        n = rays.shape[1] * rays.shape[2]
        return ground_key.new_empty(n), rays.new_empty(n if faces else 0, dtype=torch.int8), group.new_empty(num_groups)

    @torch.library.register_fake("bev::_raycast_shade")
    def _raycast_shade_fake(key, face, rays, parts, origin, half, glass, colours, label, image, depth, ids):
        return None

    @torch.library.register_fake("bev::_raycast_rects")
    def _raycast_rects_fake(corners, rotation, translation, intrinsic, post_rot, post_tran, H, W, near):
        return corners.new_empty(corners.shape[0], 4, dtype=torch.long)

    @torch.library.register_fake("bev::_raycast_ground")
    def _raycast_ground_fake(gx, gy, pixels, clear, fog, texels, grass, image, *scalars):
        return None

    @torch.library.register_fake("bev::_raycast_rgb8")
    def _raycast_rgb8_fake(image):
        return image.new_empty(image.shape, dtype=torch.uint8)


def _register_lidar_fakes() -> None:
    """Fake kernels of the synthetic LiDAR's point cloud (bev.synthetic.native): output shapes for opcheck."""

    @torch.library.register_fake("bev::_lidar_returns")
    def _lidar_returns_fake(depth, rays, origin, jitter):  # one return per finite depth, as many as jitter
        n = jitter.shape[0]
        return depth.new_empty(n, 3, dtype=torch.float64), depth.new_empty(n, dtype=torch.long)

    @torch.library.register_fake("bev::_lidar_off_faces")
    def _lidar_off_faces_fake(points, centre, R, half, reach):
        return None

    @torch.library.register_fake("bev::_lidar_cloud")
    def _lidar_cloud_fake(points, value, ring, rotation, translation):
        return points.new_empty(points.shape[0], 5, dtype=torch.float32), torch.empty_like(points)

    @torch.library.register_fake("bev::_lidar_count")
    def _lidar_count_fake(points, centre, R, half, reach):
        return points.new_empty(centre.shape[0], dtype=torch.long)

    @torch.library.register_fake("bev::_lidar_intensity")
    def _lidar_intensity_fake(points, part, part_value, spread, ground_value, labels, *scalars):
        return points.new_empty(points.shape[0])


def _register() -> None:
    _register_fakes()
    torch.library.register_autograd("bev::voxel_sum", _voxel_sum_grad, setup_context=_voxel_sum_setup)
    torch.library.register_autograd("bev::bev_pool", _bev_pool_grad, setup_context=_bev_pool_setup)


if _C is not None:
    try:
        _register()
    except Exception as e:  # a stale build without some operator: fall back, never crash import
        _C, CUDA_BUILT = None, False
        LOAD_ERROR = f"{type(e).__name__} while registering bev operators: {e}"
if _C is not None:
    for _fakes in (_register_raycast_fakes, _register_lidar_fakes):
        try:
            _fakes()
        except Exception:  # a build without these ops: bev.synthetic.native falls back to numpy, pooling unaffected
            pass
