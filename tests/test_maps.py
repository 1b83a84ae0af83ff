"""HD-map targets: layer names and presets, the rasteriser against the devkit's get_map_mask,
map and boxes in one frame, the index cache key, and bad input (missing map expansion)."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from bev.data import NuScenesBEVDataset
from bev.data.maps import PRESETS, devkit_map_mask, load_map_geometry, rasterize_map
from bev.data.rasterize import box_footprints, lss_polygon_mask
from bev.geometry import Grid
from helpers.tiny_nuscenes import LOCATION, ego_box, ego_pose, write_tiny

LAYERS = (
    "drivable_area",
    "road_segment",
    "lane",
    "ped_crossing",
    "walkway",
    "stop_line",
    "carpark_area",
    "road_divider",
    "lane_divider",
)


@pytest.fixture(scope="module")
def nusc_map(tiny_root):
    from nuscenes.map_expansion.map_api import NuScenesMap

    return NuScenesMap(str(tiny_root), LOCATION)


@pytest.fixture(scope="module")
def geometry(tiny_root):
    return load_map_geometry(tiny_root, [LOCATION], LAYERS, verbose=False)


def _rot(yaw: float) -> np.ndarray:
    c, s = math.cos(yaw), math.sin(yaw)
    return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1.0]])


POSES = [  # (translation, yaw): the fixture's ego poses, and yawed poses in the intersection
    (*ego_pose(0, 0),),
    (*ego_pose(0, 1),),
    (*ego_pose(1, 0),),
    (np.array([110.0, 205.0, 0.0]), math.radians(37.0)),
    (np.array([108.0, 203.0, 0.0]), math.radians(-121.0)),
]


@pytest.mark.parametrize("pose", range(len(POSES)))
def test_rasteriser_matches_devkit_get_map_mask(nusc_map, geometry, pose):
    grid = Grid()
    t, yaw = POSES[pose]
    ours = rasterize_map(geometry, LOCATION, _rot(yaw), t, grid, len(LAYERS)).astype(bool)
    ref = devkit_map_mask(nusc_map, t, yaw, LAYERS, grid)
    for k, layer in enumerate(LAYERS):
        inter, union = (ours[k] & ref[k]).sum(), (ours[k] | ref[k]).sum()
        if union == 0:
            continue
        assert inter / union >= 0.98, (layer, inter / union, ours[k].sum(), ref[k].sum())
    if pose == 3:  # in the intersection every layer is in view: the comparison is not vacuous
        assert all(ref[k].sum() > 10 for k in range(len(LAYERS))), ref.reshape(len(LAYERS), -1).sum(1)


def test_synthetic_map_targets_match_the_devkit(synthetic_root, tmp_path):
    """The reader's map targets against the devkit's get_map_mask (BEVFusion's call) at the same ego poses, on
    the road-network map: every BEVFusion class on the 0.5 m grid, summed over the val samples."""
    from nuscenes.map_expansion.map_api import NuScenesMap

    from bev.data.maps import ego_yaw

    ds = NuScenesBEVDataset(synthetic_root, split="mini_val", map_layers="bevfusion", verbose=False, cache_dir=tmp_path)
    assert set(ds.map_layers) == set(PRESETS["bevfusion"])
    k0, maps = ds.num_object_classes, {}
    inter, union = np.zeros(len(ds.map_layers)), np.zeros(len(ds.map_layers))
    for i in range(len(ds)):
        loc = str(ds.index["location"][i])
        nmap = maps.setdefault(loc, NuScenesMap(str(synthetic_root), loc))
        ours = ds.targets(i)[0][k0:].astype(bool)
        pose = ds.index["ego_translation"][i], ego_yaw(ds.index["ego_rotation"][i])
        ref = devkit_map_mask(nmap, *pose, ds.map_layers, ds.grid)
        inter += (ours & ref).sum((1, 2))
        union += (ours | ref).sum((1, 2))
    in_view = {name: inter[k] / union[k] for k, name in enumerate(ds.map_layers) if union[k] > 0}
    assert {"drivable_area", "walkway", "divider"} <= set(in_view)
    assert all(iou >= 0.98 for iou in in_view.values()), in_view


def test_known_cells_at_a_yawed_intersection(geometry):
    # Ego at the intersection centre facing north (yaw 90 deg): ego x = global y, ego y = -global x.
    grid = Grid()
    m = rasterize_map(geometry, LOCATION, _rot(math.pi / 2), np.array([110.0, 205.0, 0.0]), grid, len(LAYERS))
    # The north-south road (global x 103..117) runs along ego x, ego y in [-7, 7]: cell coords 86..114
    # after rounding corners, filled inclusive -> y_index 86..114 (here: ahead of the east-west road).
    road = m[0].astype(bool)
    assert road[120:, 86:115].all() and not road[120:, 70:86].any() and not road[120:, 115:130].any()
    # The stop line (global x 95..96, y 198..205): ego x = gy - 205 in [-7, 0], ego y = 110 - gx in [14, 15]
    # -> x cells 86..100, y cells 128..130.
    stop = np.zeros(grid.bev_shape, bool)
    stop[86:101, 128:131] = True
    assert np.array_equal(m[LAYERS.index("stop_line")].astype(bool), stop)
    # The hole of the island square (global 136..144 x 231..239) stays empty, its ring is filled.
    i, j = grid.xy_to_index(np.array([[235 - 205, 110 - 140], [235 - 205, 110 - 132]]))
    assert road[i[0], i[1]] == 0 and road[j[0], j[1]] == 1


def test_line_width(geometry):
    grid = Grid()
    m = rasterize_map(geometry, LOCATION, _rot(0.0), np.array([60.0, 205.0, 0.0]), grid, len(LAYERS))
    div = m[LAYERS.index("road_divider")].astype(bool)
    # The divider at global y = 205 lies on the grid's y = 0 (cell coordinate 100): cv2 thickness 2
    # (LINE_WIDTH_M at 0.5 m) covers cells 99..101 across an axis-aligned line, for its whole length.
    assert [np.flatnonzero(div[i]).tolist() for i in (70, 120, 180)] == [[99, 100, 101]] * 3
    assert not div[:55].any() and div[60:186, 99:102].all()  # the line starts at global x 40 (cell 60)
    coarse = rasterize_map(
        geometry,
        LOCATION,
        _rot(0.0),
        np.array([60.0, 205.0, 0.0]),
        Grid(xbound=(-50, 50, 1.0), ybound=(-50, 50, 1.0)),
        len(LAYERS),
    )[LAYERS.index("road_divider")]
    assert np.flatnonzero(coarse[40]).tolist() == [50]  # 1 m cells: thickness 1


def test_dataset_map_channels_share_the_box_frame(tiny_root, tmp_path):
    ds = NuScenesBEVDataset(
        tiny_root,
        split="mini_train",
        map_layers=["carpark_area", "drivable_area"],
        raster="lss",
        cache_dir=tmp_path,
        verbose=False,
    )
    assert ds.class_names == ("vehicle", "carpark_area", "drivable_area") and ds.num_classes == 3
    s = ds[0]
    assert s["bev"].shape == (3, 200, 200)
    vehicle, carpark = s["bev"][0].numpy() > 0, s["bev"][1].numpy() > 0
    # The parking spot is the truck's footprint: with the LSS rule on both, the same cells near the
    # truck, up to a boundary cell where cv2 fills LSS's [x, y] image and the devkit's [y, x] canvas differently.
    _, c, wlh, R = ego_box(1)
    truck = lss_polygon_mask(box_footprints(c[None], wlh[None], R[None])[0], ds.grid)
    near = np.zeros_like(truck)
    i, j = ds.grid.xy_to_index(c[:2])
    near[i - 20 : i + 20, j - 20 : j + 20] = True
    assert truck.sum() > 40 and ((carpark & near) ^ truck).sum() <= 2
    assert np.array_equal(truck & vehicle, truck)
    # With the default centre rule the truck's cells lie in the spot (the map's rounded rule grows it
    # by about a cell; cv2's slanted-edge decisions may leave out a corner cell or two).
    centre = (
        NuScenesBEVDataset(
            tiny_root, split="mini_train", map_layers=["carpark_area"], cache_dir=tmp_path, verbose=False
        )[0]["bev"].numpy()
        > 0
    )
    assert centre[0][near].sum() > 60 and (centre[0] & near & ~centre[1]).sum() <= 2
    assert (centre[1] & near).sum() > centre[0][near].sum()
    # The map follows the ego: in the next sample (moved and turned) it matches the devkit there.
    from nuscenes.map_expansion.map_api import NuScenesMap

    t, yaw = ego_pose(0, 1)
    ref = devkit_map_mask(NuScenesMap(str(tiny_root), LOCATION), t, yaw, ["carpark_area", "drivable_area"], ds.grid)
    got = ds[1]["bev"][1:].numpy() > 0
    assert all((got[k] & ref[k]).sum() / (got[k] | ref[k]).sum() >= 0.98 for k in range(2))


def test_index_caches_map_geometry_keyed_by_layers_and_map_file(tiny_root, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(tiny_root, root, ignore=shutil.ignore_patterns(".bev_cache"))
    cache = tmp_path / "cache"
    a = NuScenesBEVDataset(root, split="mini_val", map_layers="lss", cache_dir=cache, verbose=False)
    assert a.index["location"].tolist() == [LOCATION, LOCATION]
    files = sorted(cache.glob("*.npz"))
    assert len(files) == 1
    b = NuScenesBEVDataset(root, split="mini_val", map_layers=["walkway"], cache_dir=cache, verbose=False)
    assert len(sorted(cache.glob("*.npz"))) == 2 and b.num_classes == 2
    # Editing the map file invalidates the cache: the new geometry is used.
    import json

    path = root / "maps" / "expansion" / f"{LOCATION}.json"
    m = json.loads(path.read_text())
    m["drivable_area"][0]["polygon_tokens"] = []
    path.write_text(json.dumps(m))
    c = NuScenesBEVDataset(root, split="mini_val", map_layers="lss", cache_dir=cache, verbose=False)
    assert a[0]["bev"][1].sum() > 0 and c[0]["bev"][1].sum() == 0


def test_missing_map_expansion_is_a_clear_error(tmp_path):
    root = write_tiny(tmp_path / "nomap", samples=1, with_map=False)
    with pytest.raises(
        FileNotFoundError, match=r"nuScenes-map-expansion-v1.3.zip.*maps/expansion/<location>.json"
    ) as e:
        NuScenesBEVDataset(root, split="mini_train", map_layers="bevfusion", cache_dir=tmp_path / "c", verbose=False)
    assert str(root / "maps" / "expansion" / f"{LOCATION}.json") in str(e.value)
    with pytest.raises(ValueError, match="unknown map layer"):
        NuScenesBEVDataset(root, split="mini_train", map_layers=["sidewalk"], cache_dir=tmp_path / "c", verbose=False)
    # Without map layers the same dataroot works.
    assert NuScenesBEVDataset(root, split="mini_train", cache_dir=tmp_path / "c", verbose=False).num_classes == 1


def test_bad_map_file_names_the_file(tmp_path):
    root = write_tiny(tmp_path / "badmap", samples=1)
    (root / "maps" / "expansion" / f"{LOCATION}.json").write_text('{"version": "1.3"}')
    with pytest.raises(ValueError, match=f"{LOCATION}.json.*devkit"):
        NuScenesBEVDataset(root, split="mini_train", map_layers="lss", cache_dir=tmp_path / "c", verbose=False)


@pytest.mark.e2e
def test_train_and_eval_with_map_layers(tiny_root, tmp_path, monkeypatch, capsys):
    """bev-train (1 epoch, focal loss, per-class pos_weight) then bev-eval on the tiny map fixture."""
    import json

    from helpers.cli import TINY, eval_cli, read_csv_metric, train_cli

    run = tmp_path / "run"
    args = [
        *TINY,
        f"data.dataroot={tiny_root}",
        "data.map_layers=bevfusion",
        "data.raster=lss",
        f"data.cache_dir={tmp_path / 'cache'}",
        "model.segmentation.loss=focal",
        "model.segmentation.pos_weight={vehicle:2.13,divider:3.0}",
        "callbacks.bev_png.every_n_steps=1",
        f"hydra.run.dir={run}",
    ]
    assert train_cli(args, monkeypatch) == 0
    names = ["vehicle", "drivable_area", "ped_crossing", "walkway", "stop_line", "carpark_area", "divider"]
    assert read_csv_metric(run, "val/iou") and read_csv_metric(run, "val/miou_map")
    assert all(read_csv_metric(run, f"val/iou_{n}") is not None for n in names)
    assert list(run.glob("bev_png/*.png")) or list(run.rglob("step_*.png"))
    out = tmp_path / "eval"
    assert (
        eval_cli(
            [
                f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
                f"data.dataroot={tiny_root}",
                f"data.cache_dir={tmp_path / 'cache'}",
                f"hydra.run.dir={out}",
                "num_pngs=1",
            ],
            monkeypatch,
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert all(n in printed for n in names) and "mIoU" in printed
    rec = json.loads((out / "metrics.json").read_text())
    assert rec["map_classes"] == names[1:] and "iou_divider@0.35" in rec["metrics"] and "miou_map" in rec["metrics"]
    assert rec["metrics"]["iou"] == rec["metrics"]["iou_vehicle"]


def test_bad_loss_and_pos_weight_are_clear_errors():

    from bev.lit import BEVLitModule
    from helpers.models import stand_in_net

    net = stand_in_net(1, 3)
    kw = dict(net=net, optimizer=None)
    classes = dict(object_classes=["vehicle"], map_classes=["drivable_area", "divider"])
    m = BEVLitModule(**kw, segmentation=dict(**classes, pos_weight={"vehicle": 2.0}))
    assert m.task_modules.segmentation.loss_fn.pos_weight.flatten().tolist() == [2.0, 1.0, 1.0]
    assert BEVLitModule(
        **kw, segmentation=dict(**classes, pos_weight=[1, 2, 3])
    ).task_modules.segmentation.loss_fn.pos_weight.flatten().tolist() == [
        1.0,
        2.0,
        3.0,
    ]
    with pytest.raises(ValueError, match="unknown class.*'road'.*vehicle"):
        BEVLitModule(**kw, segmentation=dict(**classes, pos_weight={"road": 2.0}))
    with pytest.raises(ValueError, match="2 values for 3 classes"):
        BEVLitModule(**kw, segmentation=dict(**classes, pos_weight=[1, 2]))
    with pytest.raises(ValueError, match="unknown model.segmentation.loss 'dice'"):
        BEVLitModule(**kw, segmentation=dict(**classes, loss="dice"))
    with pytest.raises(ValueError, match="num_classes=3 but"):
        BEVLitModule(net=net, optimizer=None, segmentation=dict(object_classes=["vehicle"], map_classes=["divider"]))
    # Focal loss: gamma 0 is BCE; confident right answers cost less than with BCE.
    import torch
    import torch.nn.functional as F

    logits, target = torch.randn(2, 3, 4, 4), (torch.rand(2, 3, 4, 4) > 0.5).float()
    f0 = BEVLitModule(
        **kw, segmentation=dict(**classes, pos_weight=1.0, loss="focal", focal_gamma=0.0)
    ).task_modules.segmentation.loss_fn(logits, target)
    torch.testing.assert_close(f0, F.binary_cross_entropy_with_logits(logits, target))
    f2 = BEVLitModule(
        **kw, segmentation=dict(**classes, pos_weight=1.0, loss="focal")
    ).task_modules.segmentation.loss_fn(logits, target)
    assert f2 < f0


def test_class_weight_weighs_each_channel_mean_loss():
    import torch
    import torch.nn.functional as F

    from bev.lit import BEVLitModule
    from helpers.models import stand_in_net

    net = stand_in_net(1, 3)
    kw = dict(net=net, optimizer=None)
    classes = dict(object_classes=["vehicle"], map_classes=["drivable_area", "divider"], pos_weight=2.0)
    logits, target = torch.randn(2, 3, 4, 5), (torch.rand(2, 3, 4, 5) > 0.7).float()
    per_class = [
        F.binary_cross_entropy_with_logits(logits[:, k], target[:, k], pos_weight=torch.tensor(2.0)) for k in range(3)
    ]
    got = BEVLitModule(
        **kw, segmentation=dict(**classes, class_weight={"vehicle": 4.0})
    ).task_modules.segmentation.loss_fn(logits, target)
    torch.testing.assert_close(got, (4 * per_class[0] + per_class[1] + per_class[2]) / 6)
    torch.testing.assert_close(
        BEVLitModule(**kw, segmentation=dict(**classes, class_weight=1.0)).task_modules.segmentation.loss_fn(
            logits, target
        ),
        BEVLitModule(**kw, segmentation=classes).task_modules.segmentation.loss_fn(logits, target),
    )
    focal = BEVLitModule(
        **kw, segmentation=dict(**classes, loss="focal", focal_gamma=0.0, class_weight=[0, 1, 0])
    ).task_modules.segmentation.loss_fn(logits, target)
    torch.testing.assert_close(focal, per_class[1])
    with pytest.raises(ValueError, match="class_weight names unknown class.*'car'"):
        BEVLitModule(**kw, segmentation=dict(**classes, class_weight={"car": 2.0}))
    with pytest.raises(ValueError, match="class_weight must be >= 0 and not all 0"):
        BEVLitModule(**kw, segmentation=dict(**classes, class_weight=[0, 0, 0]))


def test_clip_drops_degenerate_rings():
    # Map files can hold sliver rings (< 3 distinct vertices); they have no area and must not
    # make the whole polygon fail to clip.
    import numpy as np

    from bev.data.maps import _clip

    outer = np.array([[-5.0, -5.0], [20.0, -5.0], [20.0, 20.0], [-5.0, 20.0]])
    parts = _clip([outer, np.array([[1.0, 1.0], [2.0, 2.0]])], False, 10, 10)
    assert len(parts) == 1 and len(parts[0]) == 1
    assert np.ptp(parts[0][0], axis=0).tolist() == [10.0, 10.0]
    assert _clip([np.array([[-5.0, -5.0], [20.0, -5.0], [-5.0, -5.0]])], False, 10, 10) == []


def test_reading_maps_leaves_the_matplotlib_style_alone():
    # The devkit's map_api calls plt.style.use(...) when imported: our pictures must not change with it.
    import subprocess
    import sys

    code = (
        "import matplotlib; before = dict(matplotlib.rcParams)\n"
        "from bev.data.maps import _map_api\n"
        "assert _map_api().NuScenesMap.__module__ == 'nuscenes.map_expansion.map_api'\n"
        "changed = sorted(k for k, v in matplotlib.rcParams.items() if before[k] != v)\n"
        "assert not changed, changed\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
