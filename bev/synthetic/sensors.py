"""The sensors of a synthetic set: the cameras' render scales, image sizes and JPEGs (with the intrinsics of each
size), and the LIDAR_TOP mount and its point clouds."""

from __future__ import annotations

import math

import cv2
import numpy as np

from bev.data.rig import IMAGE_H, IMAGE_W
from bev.geometry import quaternion_to_matrix, yaw_to_quaternion
from bev.synthetic import raycast
from bev.synthetic.world import World

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
LIDAR_PX_PER_POINT = 100  # one lidar point inside an object's box per 100 visible full-resolution pixels (max 200)


def lidar_points(
    world: World,
    t: float,
    annotated: list[int],
    counts: dict,
    rng: np.random.Generator,
    scale: int = raycast.RENDER_SCALE,
):
    """A small LIDAR_TOP cloud (N, 5: x, y, z, intensity, ring) in the lidar frame, and points per object.

    Ground rings (minus the ground under objects) plus, for each annotated object, points
    inside its box in proportion to its visible pixels (counts at render scale `scale`, so any
    scale gives the same density); num_lidar_pts is then the true count of cloud points in each box.
    """
    ground = _ground_rings()
    boxes, pts = _object_points(world, t, annotated, counts, rng, scale)
    cloud = np.concatenate([ground] + pts)
    under, inside = _points_in_boxes(cloud, boxes)
    under[len(ground) :] = False  # only ground points are dropped: the lidar cannot see the ground under an object
    per_obj = {i: int(np.count_nonzero(~under[idx])) for i, idx in inside}
    cloud = cloud[~under]
    R_l = quaternion_to_matrix(LIDAR_ROTATION)
    cloud[:, :3] = (cloud[:, :3] - np.array(LIDAR_TRANSLATION)) @ R_l  # ego -> lidar: R^T (p - t)
    return cloud.astype(np.float32), per_obj


def _ground_rings() -> np.ndarray:
    """The ground points (N, 5) of the lidar's 32 rings in the ego frame, 64 azimuths each."""
    rings = np.arange(32)
    r = 3.0 * 1.09**rings  # 3 m .. ~45 m
    az = np.linspace(-math.pi, math.pi, 64, endpoint=False)
    return np.stack(
        [
            np.outer(r, np.cos(az)).ravel(),
            np.outer(r, np.sin(az)).ravel(),
            np.zeros(r.size * az.size),
            np.full(r.size * az.size, 10.0),
            np.repeat(rings, az.size).astype(np.float64),
        ],
        -1,
    )


def _object_points(
    world: World, t: float, annotated: list[int], counts: dict, rng: np.random.Generator, scale: int
) -> tuple[list[tuple], list[np.ndarray]]:
    """Each annotated object's box in the ego frame (index, rotation object -> ego, centre, half size) and its
    points (n, 5), n in proportion to its visible pixels."""
    ego_t, ego_yaw = world.ego_pose(t)
    c, s = math.cos(ego_yaw), math.sin(ego_yaw)
    R_ge = np.array([[c, -s, 0], [s, c, 0], [0, 0, 1.0]])  # ego -> global
    boxes, pts = [], []
    for i in annotated:
        obj = world.objects[i]
        centre, yaw = world.object_pose(i, t)
        a = yaw - ego_yaw
        R = np.array([[math.cos(a), -math.sin(a), 0], [math.sin(a), math.cos(a), 0], [0, 0, 1.0]])  # object -> ego
        c_ego = R_ge.T @ (centre - ego_t)
        half = np.array([obj.size[1], obj.size[0], obj.size[2]]) / 2
        boxes.append((i, R, c_ego, half))
        n = int(min(200, counts.get(i, (0, 0))[0] * scale * scale // LIDAR_PX_PER_POINT))
        local = rng.uniform(-0.9, 0.9, (n, 3)) * half  # strictly inside the box
        pts.append(np.concatenate([local @ R.T + c_ego, np.full((n, 1), 60.0), rng.integers(0, 32, (n, 1))], 1))
    return boxes, pts


def _points_in_boxes(cloud: np.ndarray, boxes: list[tuple]) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
    """A mask of the cloud points within 0.05 m of any box, and per box (index, the points inside it)."""
    # Points in each box, in its own frame; a box only tests the points within its reach in x
    # (points sorted by x; the reach covers the 0.05 m margin below).
    order = np.argsort(cloud[:, 0], kind="stable")
    xs, under, inside = cloud[order, 0], np.zeros(len(cloud), bool), []
    for i, R, c_ego, half in boxes:
        reach = math.hypot(half[0], half[1]) + 0.1
        near = order[np.searchsorted(xs, c_ego[0] - reach) : np.searchsorted(xs, c_ego[0] + reach, "right")]
        local = np.abs((cloud[near, :3] - c_ego) @ R)  # rows: R^T (p - c)
        under[near[np.all(local <= half + 0.05, axis=1)]] = True
        inside.append((i, near[np.all(local <= half, axis=1)]))
    return under, inside
