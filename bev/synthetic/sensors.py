"""The sensors of a synthetic set: the cameras' render scales, image sizes and JPEGs (with the intrinsics of each
size), and the LIDAR_TOP mount (its point clouds: bev.synthetic.lidar)."""

from __future__ import annotations

import math

import cv2
import numpy as np

from bev.data.rig import IMAGE_H, IMAGE_W
from bev.geometry import yaw_to_quaternion
from bev.synthetic import native, raycast

JPEG_QUALITY = 90
RENDER_SCALES = (1, 2, 4)  # divisors of 1600x900 that keep whole pixels
# The JPEGs' size: "full" 1600x900 as nuScenes' cameras (the renders upscaled), or "render" the render resolution
# itself, with the intrinsics of that size (the same scene, no pixels made up: a 1/scale**2 of the JPEG work).
IMAGE_SIZES = ("full", "render")


def _check_image_size(image_size) -> str:
    if image_size not in IMAGE_SIZES:
        raise ValueError(f"image_size must be one of {', '.join(map(repr, IMAGE_SIZES))}, got {image_size!r}")
    return image_size


def _check_render_scale(scale) -> int:
    """`scale` as an int if it is one of RENDER_SCALES, else a ValueError."""
    if isinstance(scale, bool) or not isinstance(scale, (int, np.integer)) or int(scale) not in RENDER_SCALES:
        raise ValueError(
            f"render_scale must be one of {', '.join(map(str, RENDER_SCALES))} "
            f"(ray-cast at 1600x900 / render_scale), got {scale!r}"
        )
    return int(scale)


def image_scale(render_scale: int, image_size: str) -> int:
    """How many times smaller than 1600x900 the written JPEGs are."""
    return render_scale if image_size == "render" else 1


def scaled_intrinsic(K, scale: int) -> list[list[float]]:
    """A 1600x900 camera matrix for its image 1/scale the size: pixel centres map by u' + 0.5 = (u + 0.5) / scale,
    as raycast.downscale's post_rot / post_tran."""
    post_rot, post_tran = raycast.downscale(scale)
    P = post_rot.double().numpy()
    P[:2, 2] = post_tran[:2].double().numpy()
    return (P @ np.asarray(K, np.float64)).tolist()


def camera_jpeg(image: np.ndarray, scale: int, upscale: bool, name: str) -> bytes:
    """A camera's render (H, W, 3 RGB in [0, 1], at 1600x900 / scale) as its JPEG's bytes: upscaled to 1600x900
    when `upscale`, else at the render resolution (`name`: the file, for the error)."""
    if image.dtype == np.float32 and native.active((native.RGB8_OP,)):
        img = native.rgb8(np.ascontiguousarray(image))  # the same pixels in one pass
    else:
        img = (image * 255.0 + 0.5).clip(0, 255).astype(np.uint8)
    # RGB -> BGR before upscaling (same pixels): a contiguous array encodes ~3x faster than a flipped view.
    img = cv2.cvtColor(img, cv2.COLOR_RGB2BGR)
    if upscale and scale > 1:
        img = cv2.resize(img, (IMAGE_W, IMAGE_H), interpolation=cv2.INTER_LINEAR)
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
    if not ok:
        raise RuntimeError(f"JPEG encoding failed for {name}")
    return buf.tobytes()


# LIDAR_TOP mount: the real position (m) and a -90 degree yaw (lidar x points to the ego's right).
LIDAR_TRANSLATION = [0.943713, 0.0, 1.84023]
LIDAR_ROTATION = yaw_to_quaternion(-math.pi / 2)
