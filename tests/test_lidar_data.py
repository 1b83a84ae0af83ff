"""The LiDAR loader (bev.data.lidar): multi-sweep points against the devkit's from_file_multisweep on a synthetic
set written with sweeps, the BEV augmentation applied to the points as to the targets, the grid cut and the point
cap, batches, the data.lidar option, and bad input (damaged, missing and misordered files)."""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pytest
import torch

from bev.data import NuScenesBEVDataset
from bev.data.lidar import LidarOptions, collate_points
from bev.geometry import Grid, quaternion_to_matrix

SWEEPS = 3  # written between key frames


@pytest.fixture(scope="module")
def sweep_root(tmp_path_factory):
    from bev.synthetic.writer import make_synthetic

    return make_synthetic(
        tmp_path_factory.mktemp("lidar") / "set",
        scenes=2,
        samples_per_scene=3,
        seed=0,
        render_scale=4,
        occupancy=False,
        lidar_sweeps=SWEEPS,
        progress=False,
        workers=1,
    )


def dataset(root, tmp_path, split="mini_train", sweeps=SWEEPS, max_points=10**7, **options):
    lidar = {"enabled": True, "sweeps": sweeps, "max_points": max_points}
    return NuScenesBEVDataset(root, split=split, lidar=lidar, cache_dir=tmp_path / "cache", verbose=False, **options)


def devkit_points(nusc, sample_token: str, nsweeps: int) -> np.ndarray:
    """(M, 5) x, y, z (key frame ego), intensity, time lag by the devkit's LidarPointCloud.from_file_multisweep."""
    from nuscenes.utils.data_classes import LidarPointCloud

    sample = nusc.get("sample", sample_token)
    pc, lag = LidarPointCloud.from_file_multisweep(nusc, sample, "LIDAR_TOP", "LIDAR_TOP", nsweeps=nsweeps)
    sd = nusc.get("sample_data", sample["data"]["LIDAR_TOP"])
    cs = nusc.get("calibrated_sensor", sd["calibrated_sensor_token"])
    xyz = pc.points[:3].T @ quaternion_to_matrix(cs["rotation"]).T + np.asarray(cs["translation"])
    return np.c_[xyz, pc.points[3], lag[0]]


@pytest.mark.parametrize("sweeps", [0, SWEEPS, 2 * SWEEPS + 1])
def test_points_are_the_devkits_multisweep_cloud(sweep_root, tmp_path, sweeps):
    """Key frame + `sweeps` earlier sweeps (across key frames when more than written between two), moved into the
    key frame's ego frame: the devkit's cloud point for point (nsweeps = sweeps + 1), before the grid cut."""
    from nuscenes.nuscenes import NuScenes

    from bev.data.lidar import sample_points

    nusc = NuScenes("v1.0-mini", dataroot=str(sweep_root), verbose=False)
    seen = set()
    for split in ("mini_train", "mini_val"):
        ds = dataset(sweep_root, tmp_path, split, sweeps)
        for i, token in enumerate(ds.index["sample_token"]):
            got, want = sample_points(ds.dataroot, ds.sweeps, i), devkit_points(nusc, str(token), sweeps + 1)
            assert got.shape == want.shape and got.dtype == np.float32
            np.testing.assert_allclose(got[:, :3], want[:, :3], atol=2e-4)
            np.testing.assert_array_equal(got[:, 3], want[:, 3])
            np.testing.assert_allclose(got[:, 4], want[:, 4], atol=1e-6)
            seen.add(len(np.unique(got[:, 4])))
    assert max(seen) == min(sweeps, 2 * SWEEPS + 1) + 1 and min(seen) == 1  # a scene's first key frame has none


def test_items_hold_the_points_in_the_grid_and_batches_hold_them_flat(sweep_root, tmp_path):
    grid = Grid(xbound=(-20.0, 20.0, 0.5), ybound=(-15.0, 15.0, 0.5), zbound=(-1.0, 3.0, 4.0))
    ds = dataset(sweep_root, tmp_path, grid=grid)
    from bev.data.lidar import sample_points

    raw = sample_points(ds.dataroot, ds.sweeps, 2)
    item = ds[2]
    lo, hi = np.array([grid.xbound[0], grid.ybound[0], -1.0]), np.array([grid.xbound[1], grid.ybound[1], 3.0])
    inside = ((raw[:, :3] >= lo) & (raw[:, :3] < hi)).all(1)
    assert 0 < inside.sum() < len(raw)
    assert torch.equal(item["points"], torch.from_numpy(raw[inside]))
    batch = collate_points([ds[1], ds[0], ds[2]])
    counts = [len(ds[k]["points"]) for k in (1, 0, 2)]
    assert batch["num_points"].tolist() == counts and batch["points"].shape == (sum(counts), 6)
    assert batch["points"][:, 0].tolist() == sum(([float(b)] * n for b, n in enumerate(counts)), [])
    assert torch.equal(batch["points"][counts[0] : counts[0] + counts[1], 1:], ds[0]["points"])
    assert batch["bev"].shape[0] == 3 and len(batch["sample_token"]) == 3


def test_max_points_keeps_a_subset_random_in_training_fixed_otherwise(sweep_root, tmp_path):
    full = dataset(sweep_root, tmp_path)[2]["points"]
    ds = dataset(sweep_root, tmp_path, max_points=1000)
    a, b = ds[2]["points"], ds[2]["points"]
    assert len(a) == 1000 and torch.equal(a, b)
    rows = {tuple(r) for r in full.tolist()}
    assert all(tuple(r) in rows for r in a.tolist())
    assert (np.diff(a[:, 4].numpy()) >= 0).all()  # kept in the cloud's order (sweeps in time order)
    most = dataset(sweep_root, tmp_path, max_points=len(full) - 50)[2]["points"]  # drawn as the 50 left out
    assert len(most) == len(full) - 50 and {tuple(r) for r in most.tolist()} <= rows
    assert len({tuple(r) for r in most.tolist()}) == len(most) and (np.diff(most[:, 4].numpy()) >= 0).all()
    train = dataset(sweep_root, tmp_path, max_points=1000, augment=True)
    torch.manual_seed(0)
    c, d = train.lidar_item(2, None), train.lidar_item(2, None)
    assert len(c) == len(d) == 1000 and not torch.equal(c, d)


def _in_footprints(xy: np.ndarray, footprints: np.ndarray) -> np.ndarray:
    from matplotlib.path import Path

    inside = np.zeros(len(xy), bool)
    for fp in footprints:
        inside |= Path(fp).contains_points(xy)
    return inside


def test_bev_augmentation_moves_the_points_with_the_targets(sweep_root, tmp_path):
    """With a fixed BEV rotation, scale and flip: the item's points are A p of the points without it, and the points
    inside the vehicle boxes land on the vehicle target cells of the augmented item as they do without it."""
    aug = {"rot_lim": [35.0, 35.0], "scale_lim": [1.04, 1.04], "flip_x": 1.0, "flip_y": 0.0}
    plain = dataset(sweep_root, tmp_path)
    moved = dataset(sweep_root, tmp_path, augment=True, bev_aug=aug)
    i = 2
    item, base = moved[i], plain[i]
    A = item["bev_aug"].double().numpy()
    np.testing.assert_allclose(A[:2, :2] @ [1, 0], [-1.04 * np.cos(np.radians(35)), 1.04 * np.sin(np.radians(35))])
    from bev.data.lidar import in_grid, sample_points

    raw = sample_points(plain.dataroot, plain.sweeps, i).astype(np.float64)
    want = raw.copy()
    want[:, :3] = raw[:, :3] @ A.T
    want = want[in_grid(want, plain.grid)]
    np.testing.assert_allclose(item["points"].numpy(), want, atol=1e-4)

    boxes = plain.boxes(i)
    vehicles = boxes["footprint"][boxes["label"] == 0]
    # Each box's points are where the box moved: per vehicle box, as many in its moved footprint as without.
    near = vehicles[(np.abs(vehicles) < 40).all((1, 2))]
    counts = [_in_footprints(base["points"][:, :2].numpy(), fp[None]).sum() for fp in near]
    moved_counts = [_in_footprints(item["points"][:, :2].numpy(), (fp @ A[:2, :2].T)[None]).sum() for fp in near]
    assert len(near) >= 3 and sum(counts) > 1000 and counts == moved_counts
    # Returns lie on the boxes' faces, so in cells at the footprints' edges: about 2/3 are on the target cells
    # (a cell is filled when its centre lies in a footprint), about as many with the augmentation as without...
    base_share = _share_on_target(base["points"].numpy(), vehicles, base["bev"][0].numpy(), plain.grid)
    moved_share = _share_on_target(item["points"].numpy(), vehicles @ A[:2, :2].T, item["bev"][0].numpy(), plain.grid)
    assert base_share > 0.5 and abs(moved_share - base_share) < 0.15, (base_share, moved_share)
    # ... while points left where they were (A not applied) miss the augmented targets.
    assert _share_on_target(base["points"].numpy(), vehicles, item["bev"][0].numpy(), plain.grid) < 0.35


def _share_on_target(points: np.ndarray, footprints: np.ndarray, target: np.ndarray, grid: Grid) -> float:
    """The share of the points inside the footprints (below 1.5 m: the boxes' bodies) whose cell is on target."""
    hit = _in_footprints(points[:, :2], footprints) & (points[:, 2] < 1.5)
    ix = np.floor((points[hit, 0] - grid.xbound[0]) / grid.xbound[2]).astype(int)
    iy = np.floor((points[hit, 1] - grid.ybound[0]) / grid.ybound[2]).astype(int)
    assert hit.sum() > 200
    return float(target[ix, iy].mean())


def test_lidar_is_off_by_default_and_the_option_is_checked(sweep_root, tmp_path):
    ds = NuScenesBEVDataset(sweep_root, split="mini_train", cache_dir=tmp_path / "c", verbose=False)
    assert ds.sweeps is None and "points" not in ds[0] and "points" not in collate_points([ds[0], ds[1]])
    assert ds.lidar == LidarOptions() and not ds.lidar.enabled
    assert LidarOptions.from_any({"enabled": True, "sweeps": 9}) == LidarOptions(True, 9, 300_000)
    for bad, what in [
        ({"enabled": 1}, "data.lidar.enabled must be true or false"),
        ({"enabled": True, "sweeps": -1}, r"data.lidar.sweeps must be a whole number 0..30"),
        ({"enabled": True, "sweeps": 31}, r"data.lidar.sweeps must be a whole number 0..30"),
        ({"max_points": 0}, "data.lidar.max_points must be a whole number >= 1"),
        ({"sweep": 3}, "data.lidar must be null or"),
        ("on", "data.lidar must be null or"),
    ]:
        with pytest.raises(ValueError, match=what):
            NuScenesBEVDataset(sweep_root, split="mini_train", lidar=bad, verbose=False)


def test_the_data_config_composes_with_lidar_and_the_datamodule_batches_points(sweep_root, tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from bev.utils.config import CONFIG_DIR

    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                "data.lidar.enabled=true",
                "data.lidar.sweeps=2",
                "data.num_workers=0",
                f"data.dataroot={sweep_root}",
            ],
        )
    assert dict(cfg.data.lidar) == {"enabled": True, "sweeps": 2, "max_points": 300000}
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        off = compose("train")
    assert LidarOptions.from_any(dict(off.data.lidar)) == LidarOptions()  # off unless asked for
    dm = instantiate(cfg.data, cache_dir=str(tmp_path / "c"), batch_size=2, _convert_="all")
    batch = next(iter(dm.val_dataloader()))
    assert batch["points"].shape[1] == 6 and batch["num_points"].shape == (2,)
    assert set(batch["points"][:, 0].tolist()) == {0.0, 1.0} and (batch["points"][:, 5] <= 0.1 + 1e-6).all()


# ---------------------------------------------------------------- bad input


@pytest.fixture
def damaged(sweep_root, tmp_path):
    """A copy of the set to damage (no index cache)."""
    root = tmp_path / "set"
    shutil.copytree(sweep_root, root, ignore=shutil.ignore_patterns(".bev_cache"))
    return root


def _sample_data(root):
    return json.loads((root / "v1.0-mini" / "sample_data.json").read_text())


def _chain_files(root, split_samples: int = 1):
    """The LIDAR_TOP files of the first scene's key frame k=1: [key frame, its sweeps newest first]."""
    ds = NuScenesBEVDataset(root, split="mini_train", lidar={"enabled": True, "sweeps": SWEEPS}, verbose=False)
    a, b = ds.sweeps["offsets"][split_samples : split_samples + 2]
    return [root / p.decode() for p in ds.sweeps["path"][a:b]]


def test_nan_points_are_dropped_and_counted_once_per_file(damaged, tmp_path):
    key = _chain_files(damaged)[0]
    cloud = np.fromfile(key, np.float32).reshape(-1, 5)
    cloud[[3, 10, 11], 0] = np.nan
    cloud[20, 2] = np.inf
    cloud[21, 3] = np.nan  # intensity
    cloud.tofile(key)
    ds = dataset(damaged, tmp_path, sweeps=0)
    with pytest.warns(RuntimeWarning, match=r"dropped 5 of \d+ points with a NaN, infinite or absurd") as rec:
        pts = ds[1]["points"]
    assert str(key) in str(rec[0].message) and len(rec) == 1 and torch.isfinite(pts).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds[1]  # once per file


def test_clouds_without_points_are_fine(damaged, tmp_path):
    key = _chain_files(damaged, 0)[0]  # the scene's first key frame: no sweeps before it
    key.write_bytes(b"")
    item = dataset(damaged, tmp_path)[0]
    assert item["points"].shape == (0, 5)
    batch = collate_points([item, dataset(damaged, tmp_path)[1]])
    assert batch["num_points"][0] == 0 and batch["points"][:, 0].min() == 1


@pytest.mark.parametrize("cut", [3, 8, 20 * 7 + 4])
def test_a_truncated_file_is_one_error_naming_it(damaged, tmp_path, cut):
    sweep = _chain_files(damaged)[2]
    data = sweep.read_bytes()
    sweep.write_bytes(data[:-cut])
    with pytest.raises(ValueError, match="not a whole number of 20-byte points") as e:
        dataset(damaged, tmp_path)[1]
    assert str(sweep) in str(e.value) and "truncated or damaged" in str(e.value) and "re-download" in str(e.value)


def test_a_missing_sweep_gives_fewer_sweeps_with_a_warning(damaged, tmp_path):
    files = _chain_files(damaged)
    ds = dataset(damaged, tmp_path)
    full = ds[1]["points"]
    files[2].unlink()
    with pytest.warns(RuntimeWarning, match="is missing: its sample uses fewer sweeps") as rec:
        fewer = ds[1]["points"]
    assert str(files[2]) in str(rec[0].message)
    assert len(np.unique(fewer[:, 4])) == len(np.unique(full[:, 4])) - 1 and len(fewer) < len(full)
    files[0].unlink()
    with pytest.raises(FileNotFoundError, match="LiDAR key frame .* is missing"):
        ds[1]


def test_sweeps_out_of_order_are_one_error_naming_the_file(damaged, tmp_path):
    files = _chain_files(damaged)
    table = _sample_data(damaged)
    name = str(files[2].relative_to(damaged))
    rec = next(r for r in table if r["filename"] == name)
    rec["timestamp"] += 10**6  # later than the sweep after it
    (damaged / "v1.0-mini" / "sample_data.json").write_text(json.dumps(table))
    with pytest.raises(ValueError, match="out of order") as e:
        dataset(damaged, tmp_path)
    assert name in str(e.value) and "prev/next links of sample_data.json" in str(e.value)


def test_a_sweep_from_another_scene_is_one_error_naming_the_file(damaged, tmp_path):
    files = _chain_files(damaged)
    table = _sample_data(damaged)
    samples = json.loads((damaged / "v1.0-mini" / "sample.json").read_text())
    name = str(files[1].relative_to(damaged))
    rec = next(r for r in table if r["filename"] == name)
    scene = next(s["scene_token"] for s in samples if s["token"] == rec["sample_token"])
    rec["sample_token"] = next(s["token"] for s in samples if s["scene_token"] != scene)
    (damaged / "v1.0-mini" / "sample_data.json").write_text(json.dumps(table))
    with pytest.raises(ValueError, match="is from scene") as e:
        dataset(damaged, tmp_path)
    assert name in str(e.value) and "prev/next links of sample_data.json" in str(e.value)


def test_items_without_cameras_hold_no_image_and_the_same_points_and_targets(sweep_root, tmp_path, monkeypatch):
    """data.cameras=false (the LiDAR-only experiments): no image decoded, no camera key in the item, the same points
    and targets, also under BEV augmentation; camera depth targets and a camera branch are refused."""
    aug = {"rot_lim": [35.0, 35.0], "scale_lim": [1.04, 1.04], "flip_x": 1.0, "flip_y": 0.0}
    with_cams = dataset(sweep_root, tmp_path, augment=True, bev_aug=aug, ncams=6)
    without = dataset(sweep_root, tmp_path, augment=True, bev_aug=aug, ncams=6, cameras=False)
    base = with_cams[2]
    monkeypatch.setattr(type(without), "load_image", lambda *a, **k: pytest.fail("an image was decoded"))
    item = without[2]
    assert not {"images", "intrinsics", "rots", "trans", "post_rots", "post_trans", "depth"} & set(item)
    for key in ("points", "bev", "visibility", "bev_aug"):
        assert torch.equal(item[key], base[key]), key
    with pytest.raises(ValueError, match=r"data.depth_target=true is the cameras' depth: set data.cameras=true"):
        dataset(sweep_root, tmp_path, cameras=False, depth_target=True)
