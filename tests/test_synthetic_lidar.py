"""The synthetic world's LIDAR_TOP is a ray-cast spinning 32-beam LiDAR: its returns lie on the first surface
along each beam, where the cameras render that surface; the devkit counts num_lidar_pts in its boxes; sweeps
chain between key frames for the devkit's multi-sweep loader; occupancy's mask_lidar follows the same beams."""

from __future__ import annotations

import numpy as np
import pytest

from bev.data.rig import MINI_LOCATIONS
from bev.geometry import CAMERA_NAMES
from bev.synthetic import lidar, raycast
from bev.synthetic import world as world_model
from bev.synthetic.occupancy import occupancy_sample
from bev.synthetic.world import SAMPLE_DT
from bev.synthetic.writer import make_synthetic, scene_names
from helpers.synthetic import RENDER_SCALE, SAMPLES, SCENES, SEED

NOISE_TOL = 4 * lidar.RANGE_NOISE + 0.01  # metres: a return's range is its surface's within this


def _sample(nusc, root, index: int):
    """(world, t, ego points (N, 3) and the cloud (N, 5)) of key frame `index` of the first scene of the set."""
    scene = nusc.scene[0]
    tok = scene["first_sample_token"]
    for _ in range(index):
        tok = nusc.get("sample", tok)["next"]
    sd = nusc.get("sample_data", nusc.get("sample", tok)["data"]["LIDAR_TOP"])
    cloud = np.fromfile(root / sd["filename"], np.float32).reshape(-1, 5)  # as nuScenes' .pcd.bin
    si = scene_names(SCENES).index(scene["name"])
    world = world_model.build_world(SEED, si, SAMPLES, MINI_LOCATIONS[scene["name"]])
    return world, index * SAMPLE_DT, lidar.to_ego(cloud), cloud


def _first_surface(origin: np.ndarray, dirs: np.ndarray, parts: raycast.Parts) -> np.ndarray:
    """Range of the first surface (ground z = 0 or a part) along unit rays from `origin`, brute force: every
    ray against every part's slabs (inf: nothing)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        first = np.where(dirs[:, 2] < 0, -origin[2] / dirs[:, 2], np.inf)
        for p in range(len(parts.obj)):
            o = (origin - parts.centre[p]) @ parts.R[p]
            d = dirs @ parts.R[p]
            t1, t2 = (-parts.half[p] - o) / d, (parts.half[p] - o) / d
            near, far = np.nanmax(np.minimum(t1, t2), 1), np.nanmin(np.maximum(t1, t2), 1)
            hit = (near <= far) & (near > 0)
            first = np.where(hit & (near < first), near, first)
    return first


def test_returns_are_the_first_surface_along_their_beams(nusc, synthetic_root):
    """Each written return lies on the first surface along its beam (an independent brute-force cast), within the
    range noise, no farther than 70 m, and its ring is its beam's elevation (ring 0 the lowest)."""
    world, t, pts, cloud = _sample(nusc, synthetic_root, 1)
    assert 25_000 < len(pts) <= lidar.BEAMS * lidar.AZIMUTHS
    origin = lidar.sensor().translation
    rng = np.linalg.norm(pts - origin, axis=1)
    assert rng.max() <= lidar.MAX_RANGE + NOISE_TOL and rng.min() >= lidar.MIN_RANGE - NOISE_TOL
    step = (lidar.ELEVATION[1] - lidar.ELEVATION[0]) / (lidar.BEAMS - 1)
    elevation = np.degrees(np.arcsin((pts[:, 2] - origin[2]) / rng))
    assert np.abs(elevation - (lidar.ELEVATION[0] + cloud[:, 4] * step)).max() < 0.1
    pick = np.random.default_rng(0).choice(len(pts), 3000, replace=False)
    dirs = (pts[pick] - origin) / rng[pick, None]
    first = _first_surface(origin, dirs, raycast.sample_parts(world, t))
    assert np.abs(rng[pick] - first).max() < NOISE_TOL
    assert 0 < cloud[:, 3].min() and cloud[:, 3].max() <= 255 and len(np.unique(cloud[:, 3])) > 20  # materials


def test_returns_land_where_the_cameras_render_their_surface(nusc, synthetic_root):
    """A return projected into each camera lies at the depth of the camera's z-buffer (raycast.render_depth's
    values, interpolated in inverse depth, exact for planes) where the 2x2 pixels around it show one part or the
    ground: never in front of it, and behind it only where the camera's view is blocked (the LiDAR sits higher)."""
    world, t, pts, _ = _sample(nusc, synthetic_root, 1)
    parts = raycast.sample_parts(world, t)
    checked = 0
    for name in CAMERA_NAMES:
        cam = raycast.make_camera(name, RENDER_SCALE)
        key = raycast.zbuffer(cam, *raycast._in_view(cam, parts)).reshape(cam.shape)
        z = raycast._key_depth(key).reshape(cam.shape)
        assert np.array_equal(z, raycast.render_depth(world, t, cam, parts=parts))
        uv, d = cam.project_uv(pts), (pts - cam.translation) @ cam.rotation[:, 2]
        H, W = cam.shape
        ok = (d > 0.5) & (uv[:, 0] >= 0) & (uv[:, 0] <= W - 1) & (uv[:, 1] >= 0) & (uv[:, 1] <= H - 1)
        (u, v), d = uv[ok].T, d[ok]
        u0, v0 = np.minimum(u.astype(int), W - 2), np.minimum(v.astype(int), H - 2)
        fu, fv = u - u0, v - v0
        corners = [(v0, u0), (v0, u0 + 1), (v0 + 1, u0), (v0 + 1, u0 + 1)]
        weights = [(1 - fu) * (1 - fv), fu * (1 - fv), (1 - fu) * fv, fu * fv]
        depth = 1 / sum(w / z[c].astype(np.float64) for c, w in zip(corners, weights))
        field = key & 0xFFFFFFFF
        one_surface = np.all([field[c] == field[corners[0]] for c in corners], 0) & np.isfinite(depth)
        diff = (d - depth)[one_surface]
        assert one_surface.mean() > 0.9 and (diff < -NOISE_TOL).mean() < 0.005, name
        assert (np.abs(diff) < NOISE_TOL).mean() > 0.9, name
        checked += len(diff)
    assert checked > 10_000


def test_num_lidar_pts_is_the_devkits_count_of_the_returns(nusc, synthetic_root):
    """For every annotation: the devkit's points_in_box on the cloud moved to the global frame by the devkit's own
    (float32) LidarPointCloud.rotate / translate equals num_lidar_pts; near objects hold hundreds of returns."""
    from nuscenes.utils.data_classes import LidarPointCloud
    from nuscenes.utils.geometry_utils import points_in_box
    from pyquaternion import Quaternion

    counts = []
    for sample in nusc.sample:
        sd = nusc.get("sample_data", sample["data"]["LIDAR_TOP"])
        pc = LidarPointCloud.from_file(str(synthetic_root / sd["filename"]))
        for rec in (
            nusc.get("calibrated_sensor", sd["calibrated_sensor_token"]),
            nusc.get("ego_pose", sd["ego_pose_token"]),
        ):
            pc.rotate(Quaternion(rec["rotation"]).rotation_matrix)
            pc.translate(np.array(rec["translation"]))
        for tok in sample["anns"]:
            ann = nusc.get("sample_annotation", tok)
            assert points_in_box(nusc.get_box(tok), pc.points[:3]).sum() == ann["num_lidar_pts"], tok
            counts.append(ann["num_lidar_pts"])
    counts = np.array(counts)
    assert (counts == 0).any() and (counts > 0).mean() > 0.3 and counts.max() > 1000


def test_the_beams_rectangles_hold_every_hit():
    """cast (each part tested on the beams of its angular rectangle) = every beam against every part, with parts
    across azimuth 0, above the mount and beyond 70 m among them."""
    world = world_model.build_world(SEED, 0, 2, MINI_LOCATIONS["scene-0061"])
    parts = raycast.sample_parts(world, 0.0)
    near = np.flatnonzero(np.linalg.norm(parts.centre[:, :2], axis=1) < 25)[:40]
    far = np.flatnonzero(np.linalg.norm(parts.centre[:, :2], axis=1) > 75)[:5]
    rows = np.concatenate([near, far, near[:2]])
    parts = raycast.Parts(*(x[rows] for x in parts))
    # One part across azimuth 0, one under the mount whose footprint holds it (every azimuth meets it).
    moved = [((6.0, 0.3, 1.0), (0.5, 0.5, 0.5)), ((lidar.sensor().translation[0], 0.0, 0.5), (3.0, 3.0, 0.3))]
    for k, (centre, half) in enumerate(moved):
        p = len(rows) - 1 - k
        parts.centre[p], parts.half[p] = centre, half
        parts.corners[p] = parts.centre[p] + (raycast._SIGNS * parts.half[p]) @ parts.R[p].T
    spin = lidar.sensor()
    got = lidar.cast(spin, parts)
    every = np.tile([0, lidar.BEAMS, 0, lidar.AZIMUTHS], (len(rows), 1))
    key = raycast.zbuffer(spin, parts, every, raycast._pixel_pairs(every, lidar.AZIMUTHS))
    depth = raycast._key_depth(key).reshape(got.depth.shape)
    depth[(depth < lidar.MIN_RANGE) | (depth > lidar.MAX_RANGE)] = np.inf
    assert np.array_equal(got.depth, depth)
    assert (got.part == len(rows) - 1).any() and (got.part == len(rows) - 2).any()  # both moved parts are hit
    assert (got.part >= 0).sum() > 1000


def test_mask_lidar_follows_the_beams(nusc, synthetic_root):
    """The written mask_lidar: a voxel is observed where a beam's (noise-free) return lies in it, or where its
    centre lies before the returns of the four beams around its direction (a beam ending on the ground occludes
    nothing above it; one without a return passes the grid), and nowhere else."""
    from bev.tasks.occupancy import grid as G
    from bev.tasks.occupancy.io import labels_path, read_labels

    world, t, _, _ = _sample(nusc, synthetic_root, 2)
    sample_tok = nusc.get("sample", nusc.get("sample", nusc.scene[0]["first_sample_token"])["next"])["next"]
    mask = read_labels(labels_path(synthetic_root, nusc.scene[0]["name"], sample_tok)).mask_lidar
    scan = lidar.cast(lidar.sensor(), raycast.sample_parts(world, t))
    assert np.array_equal(mask, occupancy_sample(world, t, None, RENDER_SCALE).mask_lidar)
    origin, dirs = lidar.sensor().translation, lidar.beam_directions().reshape(-1, 3)
    hit = np.isfinite(scan.depth).reshape(-1)
    idx, inside = G.points_to_voxels(origin + scan.depth.reshape(-1, 1)[hit] * dirs[hit])
    ended = np.zeros(mask.shape, bool)
    ended[tuple(idx[inside].T)] = True
    assert mask[ended].all()
    centres = G.voxel_centres().reshape(-1, 3)
    pick = np.random.default_rng(1).choice(np.flatnonzero(centres[:, 2] > 0), 5000, replace=False)
    v = centres[pick] - origin
    rng = np.linalg.norm(v, axis=1)
    # The beams around each direction: the rings below and above its elevation, the steps either side of its azimuth.
    ring = (np.degrees(np.arcsin(v[:, 2] / rng)) - lidar.ELEVATION[0]) / (
        (lidar.ELEVATION[1] - lidar.ELEVATION[0]) / (lidar.BEAMS - 1)
    )
    step = np.degrees(np.arctan2(v[:, 1], v[:, 0])) % 360 / (360 / lidar.AZIMUTHS)
    in_fan = (ring >= 0) & (ring <= lidar.BEAMS - 1)
    occluder = np.where(scan.part >= 0, scan.depth, np.inf)
    r0, c0 = np.clip(np.floor(ring), 0, lidar.BEAMS - 2).astype(int), np.floor(step).astype(int)
    around = [occluder[r0 + a, (c0 + b) % lidar.AZIMUTHS] for a in (0, 1) for b in (0, 1)]
    want = ended.reshape(-1)[pick] | (in_fan & (rng <= np.min(around, 0)))
    got = mask.reshape(-1)[pick]
    assert want.sum() > 500 and (~want).sum() > 500
    assert (want != got).mean() < 0.001, ((want & ~got).sum(), (got & ~want).sum())


@pytest.fixture(scope="module")
def with_sweeps(tmp_path_factory):
    return make_synthetic(
        tmp_path_factory.mktemp("sweeps") / "set",
        scenes=1,
        samples_per_scene=2,
        seed=SEED,
        render_scale=4,
        occupancy=False,
        lidar_sweeps=3,
        progress=False,
        workers=1,
    )


def test_sweeps_chain_between_key_frames_for_the_devkit(with_sweeps):
    """lidar_sweeps=3: three non-key LIDAR_TOP sample_data at 20 Hz before the second key frame, chained by
    prev / next through both key frames, each with its own ego pose, read by LidarPointCloud.from_file_multisweep."""
    from nuscenes.nuscenes import NuScenes
    from nuscenes.utils.data_classes import LidarPointCloud

    nusc = NuScenes("v1.0-mini", dataroot=str(with_sweeps), verbose=False)
    first, second = nusc.sample
    chain, tok = [], first["data"]["LIDAR_TOP"]
    while tok:
        chain.append(nusc.get("sample_data", tok))
        tok = chain[-1]["next"]
    assert [sd["is_key_frame"] for sd in chain] == [True, False, False, False, True]
    assert chain[-1]["token"] == second["data"]["LIDAR_TOP"]
    assert all(a["token"] == b["prev"] for a, b in zip(chain, chain[1:]))
    assert np.diff([sd["timestamp"] for sd in chain]).tolist() == [350_000, 50_000, 50_000, 50_000]
    assert all(sd["filename"].startswith("sweeps/LIDAR_TOP/") for sd in chain[1:-1])
    assert [sd["sample_token"] for sd in chain[1:-1]] == [second["token"]] * 3  # the nearest key frame
    poses = [nusc.get("ego_pose", sd["ego_pose_token"]) for sd in chain]
    assert all(p["timestamp"] == sd["timestamp"] for p, sd in zip(poses, chain))
    assert len({tuple(p["translation"]) for p in poses}) == 5  # the ego moves between sweeps
    sizes = [(with_sweeps / sd["filename"]).stat().st_size // 20 for sd in chain]
    pc, times = LidarPointCloud.from_file_multisweep(nusc, second, "LIDAR_TOP", "LIDAR_TOP", nsweeps=4)
    assert pc.points.shape == (4, sum(sizes[1:]))
    assert np.allclose(np.unique(times), [0.0, 0.05, 0.1, 0.15])
    # The sweeps moved into the key frame's lidar frame by the devkit: their returns above the ground lie on the
    # key frame's surfaces (buildings, parked cars) but where something moved or the view changed, so each sweep
    # was cast at the ego pose written for it.
    world = world_model.build_world(SEED, 0, 2, MINI_LOCATIONS[nusc.scene[0]["name"]])
    ego = pc.points[:3].T @ lidar.sensor().rotation.T + lidar.sensor().translation
    pick = np.flatnonzero((times[0] > 0) & (ego[:, 2] > 0.3))[::7]
    origin = lidar.sensor().translation
    rng = np.linalg.norm(ego[pick] - origin, axis=1)
    first = _first_surface(origin, (ego[pick] - origin) / rng[:, None], raycast.sample_parts(world, SAMPLE_DT))
    assert len(pick) > 1000 and (np.abs(rng - first) < 0.1).mean() > 0.8


@pytest.mark.parametrize("sweeps", [-1, 10, 1.5, True])
def test_bad_lidar_sweeps_is_one_clear_error(tmp_path, sweeps):
    with pytest.raises(ValueError, match="lidar_sweeps must be a whole number 0..9"):
        make_synthetic(tmp_path / "out", scenes=1, samples_per_scene=2, lidar_sweeps=sweeps, progress=False)
    assert not (tmp_path / "out").exists()


def test_cli_bad_lidar_sweeps_is_one_line(tmp_path, capsys):
    from bev.synthetic.writer import main

    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "o"), "--lidar-sweeps", "12"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "lidar_sweeps must be a whole number 0..9" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
