"""The synthetic writer's shortcuts give what the plain computations give, bit for bit, and its worker
processes fail loudly: a sample's error or a dead worker ends the run with one message, never a hang."""

from __future__ import annotations

import math
import os
import signal

import numpy as np
import pytest

from bev.data.rig import MINI_LOCATIONS
from bev.synthetic import occupancy, raycast, samples, writer
from bev.synthetic import world as world_model
from helpers.synthetic import RENDER_SCALE, SEED


@pytest.fixture(scope="module")
def world():
    return world_model.build_world(SEED, 0, 6, MINI_LOCATIONS["scene-0061"])


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_cached_poses_are_the_poses(world):
    """cache_poses (one path lookup per moving object for all times) = poses computed time by time."""
    times = [k * world_model.SAMPLE_DT for k in range(6)]
    fresh = world_model.World(**{**world.__dict__, "_xy": {}})
    fresh.cache_poses(times)
    lazy = world_model.World(**{**world.__dict__, "_xy": {}})
    for t in reversed(times):  # not the cache's order: the first time computed is not the first of the drive
        assert all(_same(a, b) for a, b in zip(fresh.poses(t), lazy.poses(t)))
        for i in range(0, len(world.objects), 7):
            centre, yaw = fresh.object_pose(i, t)
            ref_centre, ref_yaw = world.object_global(world.objects[i], t)
            assert _same(centre, ref_centre) and yaw == ref_yaw


def test_render_depth_is_render_cameras_depth(world):
    t = 2 * world_model.SAMPLE_DT
    parts = raycast.sample_parts(world, t)
    for cam in (raycast.make_camera("CAM_FRONT", RENDER_SCALE), raycast.make_camera("CAM_BACK_LEFT", RENDER_SCALE)):
        ref = raycast.render_camera(world, t, cam, parts=parts).depth
        assert _same(raycast.render_depth(world, t, cam, parts=parts), ref), cam.name
    assert np.isinf(ref).any() and np.isfinite(ref).any()  # sky and surfaces both tested


def test_occupancy_from_the_drawn_parts_is_the_same(world):
    """occupancy_sample with the renders' parts (a subset taken) = with the parts placed again."""
    t = 3 * world_model.SAMPLE_DT
    parts = raycast.sample_parts(world, t)
    renders, _ = raycast.render_sample(world, t, RENDER_SCALE, parts)
    a = occupancy.occupancy_sample(world, t, renders, RENDER_SCALE)
    b = occupancy.occupancy_sample(world, t, renders, RENDER_SCALE, parts)
    assert all(_same(x, y) for x, y in zip(a, b))


def test_ground_ring_reads_the_tiles(world):
    """ground_colour's ring of tiles, with tiles replaced as the centre drives on and jumps back, gives each
    point its own tile's texel (plain grass off the window)."""
    raycast._RINGS.clear()
    rng = np.random.default_rng(0)
    tile_m = raycast.TILE * raycast.TEX_RES
    x0, y0 = (c / 2 for c in world.road.canvas)
    centres = [(x0 + 25.0 * k, y0 + 9.0 * k) for k in range(8)] + [(x0, y0), (x0 - 120.0, y0 + 60.0)]
    grass = raycast._PALETTE[raycast._CLASS["grass"]]
    for cx, cy in centres:
        x = cx + rng.uniform(-160, 160, 400)
        y = cy + rng.uniform(-160, 160, 400)
        got = raycast.ground_colour(world.seed, world.location, x, y, (cx, cy))
        t0x, t0y = math.floor((cx - raycast.TEX_RANGE) / tile_m), math.floor((cy - raycast.TEX_RANGE) / tile_m)
        n = max(
            math.floor((cx + raycast.TEX_RANGE) / tile_m) - t0x + 1,
            math.floor((cy + raycast.TEX_RANGE) / tile_m) - t0y + 1,
        )
        col, row = np.floor(x * (1 / raycast.TEX_RES)).astype(int), np.floor(y * (1 / raycast.TEX_RES)).astype(int)
        for k in range(len(x)):
            tx, ty = col[k] // raycast.TILE, row[k] // raycast.TILE
            if t0x <= tx < t0x + n and t0y <= ty < t0y + n:
                texel = raycast._tile(world.seed, world.location, tx, ty)[row[k] % raycast.TILE, col[k] % raycast.TILE]
                assert _same(got[k], texel * np.float32(1 / 255))
            else:
                assert _same(got[k], grass)


def _overlaps_brute_force(placed: list, xy, yaw, size) -> bool:
    """_Fleet.add's test against every placed track (no bounding-box prefilter)."""
    half = np.array([size[1], size[0]]) / 2 + world_model.CLEARANCE / 2
    for pxy, pyaw, phalf in placed:
        near = np.square(pxy - xy).sum(1) < np.square(np.linalg.norm(phalf) + np.linalg.norm(half))
        k = np.flatnonzero(near)
        if (
            len(k)
            and world_model.rectangles_overlap(
                pxy[k], pyaw[k], np.broadcast_to(phalf, (len(k), 2)), xy[k], yaw[k], np.broadcast_to(half, (len(k), 2))
            ).any()
        ):
            return True
    return False


def test_fleet_places_what_a_brute_force_test_places():
    rng = np.random.default_rng(1)
    fleet, placed, kept = world_model._Fleet(), [], 0
    for _ in range(300):  # more than the buffers' first capacity
        start, v = rng.uniform(0, 120, 2), rng.uniform(-6, 6, 2) * rng.integers(0, 2)
        xy = start + np.arange(12)[:, None] * 0.5 * v  # moving or parked
        yaw = np.full(12, rng.uniform(-math.pi, math.pi))
        size = (rng.uniform(0.5, 2.5), rng.uniform(0.5, 8.0), 1.5)
        expected = not _overlaps_brute_force(placed, xy, yaw, size)
        assert fleet.add(xy, yaw, size) == expected
        if expected:
            placed.append((xy, yaw, np.array([size[1], size[0]]) / 2 + world_model.CLEARANCE / 2))
            kept += 1
    assert 20 < kept < 300  # both outcomes tested


def _failing_lidar(how: str):
    real = samples.lidar_key_frame

    def lidar_key_frame(world, t, *a, **k):
        if t >= world_model.SAMPLE_DT:  # the second sample of each scene
            if how == "raise":
                raise ValueError("a broken sample")
            os.kill(os.getpid(), signal.SIGKILL)
        return real(world, t, *a, **k)

    return lidar_key_frame


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the workers inherit the patched writer only when forked")
@pytest.mark.parametrize(
    "how, message",
    [
        ("raise", "writing sample 1 of scene scene-0061 failed: ValueError: a broken sample"),
        ("die", "worker process died"),
    ],
)
def test_a_failing_worker_ends_the_run_with_one_message(tmp_path, monkeypatch, capsys, how, message):
    monkeypatch.setattr(samples, "lidar_key_frame", _failing_lidar(how))
    monkeypatch.setattr(writer, "default_workers", lambda: 2)
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the run hung"))
    signal.alarm(120)
    try:
        with pytest.raises(writer.WorkerError, match=message):
            writer.make_synthetic(
                tmp_path / "a", scenes=1, samples_per_scene=2, workers=2, render_scale=4, progress=False
            )
        args = ["--out", str(tmp_path / "b"), "--scenes", "1", "--samples-per-scene", "2", "--render-scale", "4"]
        assert writer.main([*args, "--workers", "2"]) == 1
    finally:
        signal.alarm(0)
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("bev-make-synthetic: error: ") and message in err[-1]
    assert "Traceback" not in "\n".join(err)
