"""The nuScenes reader (NuScenesBEVDataset), its index cache, bad input and the DataModule.

Two datasets: a tiny hand-made one (tests/helpers/tiny_nuscenes.py: boxes at known ego positions,
smooth textures) and the synthetic_root fixture (bev.synthetic, rendered scenes).
Geometry is checked against the devkit's own projection path (NuScenes.get_sample_data and
pyquaternion), which shares no code with the reader's index.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from bev.data import NuScenesBEVDataset, NuScenesDataModule
from bev.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from bev.geometry import CAMERA_NAMES, Grid, ego_to_image
from helpers.synthetic import RENDER_SCALE
from helpers.tiny_nuscenes import BOXES, ego_box

HINT = "nuscenes.org/download"


@pytest.fixture()
def tiny_copy(tiny_root, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(tiny_root, dst, ignore=shutil.ignore_patterns(".bev_cache"))
    return dst


@pytest.fixture(scope="module")
def nusc_tiny(tiny_root):
    from nuscenes.nuscenes import NuScenes

    return NuScenes("v1.0-mini", str(tiny_root), verbose=False)


def _ds(root, tmp_path_or_none=None, **kw):
    kw.setdefault("verbose", False)
    return NuScenesBEVDataset(root, cache_dir=tmp_path_or_none, **kw)


# ---------------------------------------------------------------- shapes, splits, targets


@pytest.mark.parametrize("augment", [False, True])
def test_shapes_and_dtypes(tiny_root, augment):
    ds = _ds(tiny_root, split="mini_train", augment=augment)
    assert len(ds) == 2
    s = ds[0]
    shapes = {k: tuple(v.shape) for k, v in s.items() if isinstance(v, torch.Tensor)}
    assert shapes == {
        "images": (6, 3, 128, 352),
        "intrinsics": (6, 3, 3),
        "rots": (6, 3, 3),
        "trans": (6, 3),
        "post_rots": (6, 3, 3),
        "post_trans": (6, 3),
        "cam_ids": (6,),
        "bev": (1, 200, 200),
        "visibility": (200, 200),
        "bev_bounds": (2, 3),
    }
    for k in ("images", "intrinsics", "rots", "trans", "post_rots", "post_trans", "bev"):
        assert s[k].dtype == torch.float32, k
    assert s["visibility"].dtype == torch.uint8 and s["cam_ids"].tolist() == list(range(6))
    assert s["bev_bounds"].tolist() == [[-50.0, 50.0, 0.5], [-50.0, 50.0, 0.5]]
    assert torch.equal(ds.bev_bounds, s["bev_bounds"]) and s["bev_bounds"].dtype == torch.float64
    assert isinstance(s["sample_token"], str) and s["sample_token"] == "s0-0"
    # ImageNet normalisation: de-normalised values lie in [0, 1]
    rgb = s["images"] * torch.tensor(IMAGENET_STD).view(3, 1, 1) + torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    assert rgb.min() >= -1e-5 and rgb.max() <= 1 + 1e-5
    # camera->ego rotations are proper rotations
    torch.testing.assert_close(s["rots"] @ s["rots"].transpose(1, 2), torch.eye(3).expand(6, 3, 3), atol=1e-5, rtol=0)


def test_validation_crop_is_deterministic(tiny_root):
    ds = _ds(tiny_root, split="mini_val")
    a, b = ds[1], ds[1]
    assert torch.equal(a["images"], b["images"])
    torch.testing.assert_close(a["post_rots"], torch.diag(torch.tensor([0.22, 0.22, 1.0])).expand(6, 3, 3))
    torch.testing.assert_close(a["post_trans"], torch.tensor([0.0, -48.0, 0.0]).expand(6, 3))


def test_random_camera_subset_only_in_training(tiny_root):
    torch.manual_seed(0)
    train = _ds(tiny_root, split="mini_train", augment=True, ncams=3)
    seen = set()
    for _ in range(6):
        s = train[0]
        ids = s["cam_ids"].tolist()
        assert len(ids) == 3 and ids == sorted(set(ids)) and s["images"].shape[0] == 3
        torch.testing.assert_close(s["intrinsics"], torch.from_numpy(train.index["intrinsics"][0, ids]))
        seen.add(tuple(ids))
    assert len(seen) > 1
    assert _ds(tiny_root, split="mini_train", augment=False, ncams=3)[0]["cam_ids"].tolist() == list(range(6))
    with pytest.raises(ValueError, match="ncams"):
        _ds(tiny_root, ncams=7)


def test_splits_have_expected_scenes(tiny_root):
    assert set(_ds(tiny_root, split="mini_train").index["scene"]) == {"scene-0061"}
    val = _ds(tiny_root, split="mini_val")
    assert set(val.index["scene"]) == {"scene-0103"}
    box = val.boxes(0)  # target boxes only (no pedestrian), with their devkit names
    assert sorted(box["category"].tolist()) == ["vehicle.bus.rigid", "vehicle.car", "vehicle.truck"]
    assert all(t.startswith("inst1-") for t in box["instance"]) and box["footprint"].shape == (3, 4, 2)


def _cells_in_box(grid: Grid, centre, wlh, R) -> np.ndarray:
    # Independent of bev.data.rasterize: cell centres into the box frame, |x| <= l/2, |y| <= w/2.
    c = grid.cell_centers()
    d = np.concatenate([c - np.asarray(centre)[:2], np.zeros(c.shape[:2] + (1,))], axis=-1) @ np.asarray(R)
    return (np.abs(d[..., 0]) <= wlh[1] / 2 + 1e-9) & (np.abs(d[..., 1]) <= wlh[0] / 2 + 1e-9)


def test_known_boxes_fill_exactly_the_expected_cells(tiny_root):
    ds = _ds(tiny_root, split="mini_val")
    for i in range(len(ds)):
        s = ds[i]
        expected = np.zeros(ds.grid.bev_shape, bool)
        vis = np.zeros(ds.grid.bev_shape, np.uint8)
        for b, (cat, *_rest, vtok) in enumerate(BOXES):
            if cat.startswith("vehicle."):
                m = _cells_in_box(ds.grid, *ego_box(b)[1:])
                assert m.sum() > 10
                expected |= m
                vis[m] = np.maximum(vis[m], int(vtok))
        assert np.array_equal(s["bev"][0].numpy() > 0, expected)
        assert np.array_equal(s["visibility"].numpy(), vis)
    # the car (12.3, 2.1), 4.5 x 1.9: x centres 10.25..14.25 -> i 120..128; y in [1.15, 3.05]: centres 1.25..2.75 -> j 102..105
    car = np.zeros(ds.grid.bev_shape, bool)
    car[120:129, 102:106] = True
    assert np.array_equal(_cells_in_box(ds.grid, *ego_box(0)[1:]), car)


def test_multiclass_categories(tiny_root, tmp_path):
    ds = _ds(tiny_root, tmp_path, split="mini_train", categories=[["vehicle.car"], ["human.pedestrian."]])
    s = ds[0]
    assert s["bev"].shape == (2, 200, 200) and ds.num_classes == 2
    assert ds.class_names == ("vehicle_car", "human_pedestrian")
    for k, b in [(0, 0), (1, 2)]:
        assert np.array_equal(s["bev"][k].numpy() > 0, _cells_in_box(ds.grid, *ego_box(b)[1:]))
    with pytest.raises(ValueError, match="mixes"):
        _ds(tiny_root, tmp_path, categories=["vehicle.", ["human."]])


# ---------------------------------------------------------------- geometry vs the devkit


def _devkit_projections(nusc, sample_token, categories=("vehicle.",)):
    """{(camera, instance): (ego-frame centre, raw (u, v) of the centre)} via the devkit alone."""
    from nuscenes.utils.geometry_utils import view_points
    from pyquaternion import Quaternion

    sample = nusc.get("sample", sample_token)
    lidar = nusc.get("sample_data", sample["data"]["LIDAR_TOP"])
    ego = nusc.get("ego_pose", lidar["ego_pose_token"])
    out = {}
    for cam in CAMERA_NAMES:
        _, boxes, K = nusc.get_sample_data(sample["data"][cam])  # boxes in this camera's frame
        for box in boxes:
            if not box.name.startswith(categories) or box.center[2] < 1.0:
                continue
            ann = nusc.get("sample_annotation", box.token)
            g = nusc.get_box(box.token)
            g.translate(-np.array(ego["translation"]))
            g.rotate(Quaternion(ego["rotation"]).inverse)
            uv = view_points(box.center[:, None], np.asarray(K), normalize=True)[:2, 0]
            out[(cam, ann["instance_token"])] = (g.center, uv)
    return out


def _bilinear(img: np.ndarray, u: float, v: float) -> np.ndarray:
    j, i = int(np.floor(u)), int(np.floor(v))
    a, b = u - j, v - i
    p = img[i : i + 2, j : j + 2].astype(np.float64)
    return (1 - b) * ((1 - a) * p[0, 0] + a * p[0, 1]) + b * ((1 - a) * p[1, 0] + a * p[1, 1])


def _check_projection(ds, nusc, i, aug_tol_px=0.05):
    """Our returned calibration + augmentation projects every box where the devkit does, and the
    returned image shows there what the raw image shows at the devkit's raw pixel."""
    s = ds[i]
    H, W = s["images"].shape[-2:]
    proj = _devkit_projections(nusc, s["sample_token"])
    img = s["images"] * torch.tensor(IMAGENET_STD).view(3, 1, 1) + torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    img = (img.clamp(0, 1) * 255).permute(0, 2, 3, 1).numpy()
    diffs, checked = [], 0
    for n, c in enumerate(s["cam_ids"].tolist()):
        raw = None
        for (cam, _inst), (centre, uv_raw) in proj.items():
            if cam != CAMERA_NAMES[c]:
                continue
            uv, depth = ego_to_image(
                torch.tensor(centre, dtype=torch.float32)[None],
                s["intrinsics"][n],
                s["rots"][n],
                s["trans"][n],
                s["post_rots"][n],
                s["post_trans"][n],
            )
            expect = s["post_rots"][n, :2, :2] @ torch.tensor(uv_raw, dtype=torch.float32) + s["post_trans"][n, :2]
            assert depth.item() > 0
            torch.testing.assert_close(uv[0], expect, atol=aug_tol_px, rtol=0)
            u, v = uv[0].tolist()
            if 2 <= u < W - 3 and 2 <= v < H - 3 and 2 <= uv_raw[0] < 1597 and 2 <= uv_raw[1] < 897:
                if raw is None:
                    raw = np.asarray(Image.open(ds.image_path(i, c)).convert("RGB"))
                diffs.append(np.abs(_bilinear(img[n], u, v) - _bilinear(raw, *uv_raw)).mean())
                checked += 1
    return diffs, checked


@pytest.mark.parametrize("augment", [False, True])
def test_boxes_project_where_the_devkit_projects_them_tiny(tiny_root, nusc_tiny, augment):
    torch.manual_seed(1)
    ds = _ds(tiny_root, split="mini_train", augment=augment)
    total = 0
    for i in range(len(ds)):
        diffs, n = _check_projection(ds, nusc_tiny, i)
        total += n
        # Smooth textures: the augmented pixel equals the raw pixel at the same scene point.
        assert max(diffs) < 6.0, diffs
    assert total >= 4


# ---------------------------------------------------------------- the index cache


def test_cache_is_reused_without_the_devkit_and_rebuilt_when_stale(tiny_copy, monkeypatch):
    import nuscenes.nuscenes as devkit

    calls = []
    real = devkit.NuScenes

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(devkit, "NuScenes", counting)
    first = _ds(tiny_copy, split="mini_train")
    assert len(calls) == 1
    cache_files = list((tiny_copy / ".bev_cache").glob("*.npz"))  # the default cache location
    assert len(cache_files) == 1

    def boom(*a, **k):
        raise AssertionError("the devkit was loaded although the cache is valid")

    monkeypatch.setattr(devkit, "NuScenes", boom)
    second = _ds(tiny_copy, split="mini_train")
    assert torch.equal(second[1]["bev"], first[1]["bev"]) and second[1]["sample_token"] == first[1]["sample_token"]
    # DataLoader workers read only the index (they would inherit the failing devkit here).
    batches = list(torch.utils.data.DataLoader(second, batch_size=1, num_workers=2))
    assert [b["sample_token"][0] for b in batches] == ["s0-0", "s0-1"]

    # The key is the tables' content: a touched table (new mtime) keeps the cache, an edited one makes it stale.
    monkeypatch.setattr(devkit, "NuScenes", counting)
    table = tiny_copy / "v1.0-mini" / "sample_annotation.json"
    st = table.stat()
    os.utime(table, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _ds(tiny_copy, split="mini_train")
    assert len(calls) == 1
    table.write_text(table.read_text().replace(", ", ",\n", 1))  # same size, same records, other bytes
    _ds(tiny_copy, split="mini_train")
    assert len(calls) == 2
    _ds(tiny_copy, split="mini_train")
    assert len(calls) == 2
    # Other categories are another cache entry, not a clash.
    _ds(tiny_copy, split="mini_train", categories=["human."])
    assert len(calls) == 3 and len(list((tiny_copy / ".bev_cache").glob("*.npz"))) == 2


def test_cache_dir_and_corrupt_cache(tiny_copy, tmp_path):
    cache = tmp_path / "cache"
    _ds(tiny_copy, cache, split="mini_val")
    (f,) = cache.glob("*.npz")
    f.write_bytes(b"not an npz file")
    with pytest.warns(UserWarning, match="unreadable index cache"):
        ds = _ds(tiny_copy, cache, split="mini_val")
    assert len(ds) == 2 and not (tiny_copy / ".bev_cache").exists()


# ---------------------------------------------------------------- bad input


def test_missing_dataroot(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=HINT) as e:
        _ds(missing)
    assert str(missing) in str(e.value) and "bev-make-synthetic" in str(e.value)


def test_missing_version_folder(tiny_root):
    with pytest.raises(FileNotFoundError, match="v1.0-trainval") as e:
        _ds(tiny_root, version="v1.0-trainval", split="train")
    assert HINT in str(e.value) and "v1.0-mini" in str(e.value)  # names what it did find


def test_missing_table(tiny_copy):
    (tiny_copy / "v1.0-mini" / "sample_annotation.json").unlink()
    with pytest.raises(FileNotFoundError, match="sample_annotation.json") as e:
        _ds(tiny_copy)
    assert str(tiny_copy / "v1.0-mini") in str(e.value) and HINT in str(e.value)


def test_missing_image_file(tiny_copy):
    img = tiny_copy / "samples" / "CAM_BACK" / "s0-1__CAM_BACK.jpg"
    img.unlink()
    with pytest.raises(FileNotFoundError, match="s0-1__CAM_BACK.jpg") as e:
        _ds(tiny_copy, split="mini_train")
    assert HINT in str(e.value)


def test_image_removed_after_the_cache_was_built(tiny_copy):
    ds = _ds(tiny_copy, split="mini_train")
    (tiny_copy / "samples" / "CAM_FRONT" / "s0-0__CAM_FRONT.jpg").unlink()
    with pytest.raises(FileNotFoundError, match="s0-0__CAM_FRONT.jpg"):
        ds[0]


def test_corrupt_image_names_the_file(tiny_copy):
    ds = _ds(tiny_copy, split="mini_train")
    bad = tiny_copy / "samples" / "CAM_FRONT" / "s0-0__CAM_FRONT.jpg"
    bad.write_bytes(bad.read_bytes()[:200])
    with pytest.raises(OSError, match="s0-0__CAM_FRONT.jpg"):
        ds[0]


def test_unknown_split(tiny_root):
    with pytest.raises(ValueError, match="unknown nuScenes split 'minitrain'.*mini_train"):
        _ds(tiny_root, split="minitrain")


def test_empty_split(tiny_root, tmp_path):
    with pytest.raises(ValueError, match="split 'test' is empty") as e:
        _ds(tiny_root, tmp_path, split="test")
    assert "mini_val" in str(e.value) and str(tiny_root / "v1.0-mini") in str(e.value)


def test_resize_lim_far_from_final_dim_warns(tiny_root):
    with pytest.warns(UserWarning, match="resize_lim"):
        _ds(tiny_root, final_dim=(64, 176), augment=True, resize_lim=(0.193, 0.225))
    ds = _ds(tiny_root, final_dim=(64, 176), augment=True)  # the default scales LSS's range
    assert ds.resize_lim == pytest.approx((0.0965, 0.1125))
    assert ds.bot_pct_lim == (0.0, 0.22) and ds.rot_lim == (-5.4, 5.4)


# ---------------------------------------------------------------- DataModule


def test_datamodule_from_hydra_config(tiny_root, tmp_path):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(
        {
            "_target_": "bev.data.NuScenesDataModule",
            "dataroot": str(tiny_root),
            "final_dim": [64, 176],
            "resize_lim": [0.0965, 0.1125],
            "grid": {"xbound": [-20, 20, 0.5], "ybound": [-20, 20, 0.5], "zbound": [-10, 10, 20], "dbound": [4, 45, 1]},
            "categories": ["vehicle."],
            "batch_size": 2,
            "num_workers": 2,
            "ncams": 5,
            "cache_dir": str(tmp_path),
        }
    )
    dm = instantiate(cfg)
    assert isinstance(dm, NuScenesDataModule) and dm.persistent_workers
    dm.prepare_data()
    dm.setup("fit")
    (batch,) = list(dm.train_dataloader())
    assert batch["images"].shape == (2, 5, 3, 64, 176) and batch["bev"].shape == (2, 1, 80, 80)
    val = next(iter(dm.val_dataloader()))
    assert val["images"].shape == (2, 6, 3, 64, 176) and val["sample_token"] == ["s1-0", "s1-1"]
    assert next(iter(dm.test_dataloader()))["sample_token"] == val["sample_token"]
    dm0 = NuScenesDataModule(tiny_root, num_workers=0, persistent_workers=True, cache_dir=tmp_path)
    assert dm0.persistent_workers is False and dm0.val_dataloader().num_workers == 0
    assert dm.class_names == ("vehicle",) and dm.num_classes == 1


def test_datamodule_with_map_layers(tiny_root, tmp_path):
    dm = NuScenesDataModule(
        tiny_root,
        categories=[["vehicle."], ["human."]],
        map_layers="bevfusion",
        raster="lss",
        num_workers=0,
        batch_size=2,
        cache_dir=tmp_path,
    )
    assert dm.class_names == (
        "vehicle",
        "human",
        "drivable_area",
        "ped_crossing",
        "walkway",
        "stop_line",
        "carpark_area",
        "divider",
    )
    assert dm.num_object_classes == 2 and dm.num_classes == 8
    batch = next(iter(dm.train_dataloader()))
    assert batch["bev"].shape == (2, 8, 200, 200)
    assert (batch["bev"].sum((2, 3)) > 0).all()  # scene-0061 is at the intersection: every channel has cells


def test_targets_are_memoised_exactly_and_bounded(tiny_root, tmp_path, monkeypatch):
    import bev.data.nuscenes as nuscenes

    kw = dict(categories=[["vehicle."], ["human."]], map_layers="bevfusion", augment=True)
    ds = _ds(tiny_root, tmp_path, **kw)
    first = [ds[i] for i in range(len(ds))]
    assert len(ds._memo) == len(ds)
    for i, s in enumerate(first):  # from the memo: the same targets, fresh arrays
        again = ds[i]
        assert torch.equal(again["bev"], s["bev"]) and torch.equal(again["visibility"], s["visibility"])
        assert again["bev"].dtype == torch.float32 and again["bev"].sum() > 0
        again["bev"].zero_()
        assert torch.equal(ds[i]["bev"], s["bev"])
    monkeypatch.setattr(nuscenes, "TARGET_MEMO_BYTES", 0)
    fresh = _ds(tiny_root, tmp_path, **kw)
    assert all(torch.equal(fresh[i]["bev"], s["bev"]) for i, s in enumerate(first)) and not fresh._memo


def test_inputs_are_memoised_without_augmentation_only(tiny_copy, tmp_path):
    kw = dict(depth_target=True, input_memo_mb=64)
    ds = _ds(tiny_copy, tmp_path, **kw)
    first = [ds[i] for i in range(len(ds))]
    for path in (tiny_copy / "samples").rglob("*.jpg"):
        path.unlink()  # from now on only the memo can serve the images
    for i, s in enumerate(first):
        again = ds[i]
        for key in ("images", "post_rots", "post_trans", "depth"):
            assert torch.equal(again[key], s[key]), key
        again["images"].zero_(), again["depth"].zero_(), again["post_rots"].zero_()  # callers own what they get
        assert torch.equal(ds[i]["images"], s["images"]) and torch.equal(ds[i]["depth"], s["depth"])
        assert torch.equal(ds[i]["post_rots"], s["post_rots"])
    with pytest.raises(FileNotFoundError, match="missing"):  # augmented crops change every call: never memoised
        _ds(tiny_copy, tmp_path, augment=True, **kw)[0]
    with pytest.raises(FileNotFoundError, match="missing"):  # the memo keeps no more than input_memo_mb
        _ds(tiny_copy, tmp_path, depth_target=True, input_memo_mb=0.1)[0]


def test_input_memo_is_bounded_and_checked(tiny_root, tmp_path):
    one_crop = 128 * 352 * 3
    ds = _ds(tiny_root, tmp_path, input_memo_mb=2.5 * one_crop / 2**20)
    ds[0]
    assert len(ds._inputs) == 2 and ds._inputs_bytes == 2 * one_crop
    with pytest.raises(ValueError, match="input_memo_mb must be >= 0"):
        _ds(tiny_root, tmp_path, input_memo_mb=-1)


# ---------------------------------------------------------------- the synthetic dataset


def test_synthetic_splits_and_shapes(synthetic_root, tmp_path):
    from nuscenes.utils.splits import create_splits_scenes

    splits = create_splits_scenes()
    for split in ("mini_train", "mini_val"):
        ds = _ds(synthetic_root, tmp_path, split=split)
        assert len(ds) == 3
        assert set(ds.index["scene"]) <= set(splits[split])
        s = ds[0]
        assert s["images"].shape == (6, 3, 128, 352) and s["bev"].shape == (1, 200, 200)
        assert s["bev"].sum() > 0  # the synthetic road has vehicles near the ego


@pytest.mark.parametrize("augment", [False, True])
def test_synthetic_boxes_project_onto_the_same_scene_points(synthetic_root, nusc, tmp_path, augment):
    torch.manual_seed(2)
    ds = _ds(synthetic_root, tmp_path, split="mini_val", augment=augment)
    diffs = []
    for i in range(len(ds)):
        d, _ = _check_projection(ds, nusc, i)
        diffs += d
    assert len(diffs) >= 10
    # Rendered scenes have sharp edges, so a few points near an edge may differ after resampling;
    # most agree closely (a wrong warp or calibration leaves the median far higher).
    assert np.median(diffs) < 8.0, np.median(diffs)


def test_synthetic_bev_matches_devkit_boxes(synthetic_root, nusc, tmp_path):
    from pyquaternion import Quaternion

    ds = _ds(synthetic_root, tmp_path, split="mini_train")
    for i in range(len(ds)):
        s = ds[i]
        sample = nusc.get("sample", s["sample_token"])
        ego = nusc.get("ego_pose", nusc.get("sample_data", sample["data"]["LIDAR_TOP"])["ego_pose_token"])
        expected = np.zeros(ds.grid.bev_shape, bool)
        for tok in sample["anns"]:
            box = nusc.get_box(tok)
            if not box.name.startswith("vehicle."):
                continue
            box.translate(-np.array(ego["translation"]))
            box.rotate(Quaternion(ego["rotation"]).inverse)
            expected |= _cells_in_box(ds.grid, box.center, box.wlh, box.rotation_matrix)
        got = s["bev"][0].numpy() > 0
        # Exact up to cells whose centre is within float rounding of a footprint edge.
        assert (got != expected).sum() <= 2, (got != expected).sum()
        assert expected.sum() > 0


@pytest.fixture(scope="module")
def synthetic_renders(synthetic_root, nusc):
    """The generator's own renders (image + instance ids) of the mini_val samples of synthetic_root,
    with the vehicle annotations as (object index, ego centre, visibility). Seed/size as in conftest."""
    from bev.geometry import quaternion_to_matrix
    from bev.synthetic import raycast
    from bev.synthetic import world as world_model
    from bev.synthetic.writer import scene_names

    names = scene_names(2)
    (scene,) = [s for s in nusc.scene if s["name"] == "scene-0103"]
    world = world_model.build_world(0, names.index(scene["name"]), 3, nusc.get("log", scene["log_token"])["location"])
    out, tok, k = [], scene["first_sample_token"], 0
    while tok:
        sample = nusc.get("sample", tok)
        t = k * world_model.SAMPLE_DT
        pose = nusc.get("ego_pose", nusc.get("sample_data", sample["data"]["LIDAR_TOP"])["ego_pose_token"])
        R, tr = quaternion_to_matrix(pose["rotation"]), np.array(pose["translation"])
        by_centre = {tuple(np.round(world.object_global(o, t)[0], 6)): i for i, o in enumerate(world.objects)}
        anns = []
        for a in sample["anns"]:
            ann = nusc.get("sample_annotation", a)
            if ann["category_name"].startswith("vehicle."):
                anns.append(
                    (by_centre[tuple(np.round(ann["translation"], 6))], (np.array(ann["translation"]) - tr) @ R)
                )
        cams = {
            name: (raycast.make_camera(name, RENDER_SCALE), raycast.render_camera(world, t, name, scale=RENDER_SCALE))
            for name in CAMERA_NAMES
        }
        out.append((tok, anns, cams))
        tok, k = sample["next"], k + 1
    return out


_BOX_OFFSETS = np.array([[0, 0, 0], [0.6, 0, 0], [-0.6, 0, 0], [0, 0.6, 0], [0, -0.6, 0], [0, 0, 0.3]])


@pytest.mark.parametrize("augment", [False, True])
def test_synthetic_boxes_land_on_their_rendered_pixels(synthetic_root, synthetic_renders, tmp_path, augment):
    """Points inside the boxes projected with the returned intrinsics/rots/trans/post_rots/post_trans
    land, in the returned (augmented) image, on pixels showing the object the generator rendered there."""
    torch.manual_seed(3)
    ds = _ds(synthetic_root, tmp_path, split="mini_val", augment=augment)
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    agree, agree_shifted = [], []
    for i, (tok, anns, cams) in enumerate(synthetic_renders):
        s = ds[i]
        assert s["sample_token"] == tok
        imgs = ((s["images"] * std + mean).clamp(0, 1) * 255).permute(0, 2, 3, 1).numpy()
        Hf, Wf = imgs.shape[1:3]
        for n, c in enumerate(s["cam_ids"].tolist()):
            cam, r = cams[CAMERA_NAMES[c]]
            # Several points per box (_BOX_OFFSETS) give enough checks from one short scene.
            points = [(obj, centre + off) for obj, centre in anns for off in _BOX_OFFSETS]
            for obj, centre in points:
                (ur, vr), dr = (x[0] for x in cam.project(centre[None]))
                row, col = int(round(vr)), int(round(ur))
                if dr < 1.0 or not (4 <= row < r.ids.shape[0] - 4 and 4 <= col < r.ids.shape[1] - 4):
                    continue
                # Only centres inside a flat patch of the object itself (at the 0.2x output scale a
                # render pixel near an edge or a window blends with its neighbours).
                ids, patch = r.ids[row - 4 : row + 5, col - 4 : col + 5], r.image[row - 4 : row + 5, col - 4 : col + 5]
                if not (ids == obj + 1).all() or np.ptp(patch.reshape(-1, 3), axis=0).max() > 0.05:
                    continue
                uv, d = ego_to_image(
                    torch.tensor(centre, dtype=torch.float32)[None],
                    s["intrinsics"][n],
                    s["rots"][n],
                    s["trans"][n],
                    s["post_rots"][n],
                    s["post_trans"][n],
                )
                u, v = uv[0].tolist()
                if not (0 <= u < Wf - 40 and 0 <= v < Hf):
                    continue
                want = r.image[row, col] * 255
                agree.append(np.abs(imgs[n, int(v), int(u)] - want).mean() < 12)
                agree_shifted.append(np.abs(imgs[n, int(v), int(u) + 40] - want).mean() < 12)
    assert len(agree) >= 20, len(agree)
    assert np.mean(agree) >= 0.95, np.mean(agree)
    assert (
        np.mean(agree_shifted) < np.mean(agree) - 0.2
    )  # 40 px off (about 180 raw pixels) is visibly worse: the check can fail
