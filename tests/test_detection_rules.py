"""The nuScenes detection task's rules and its peers' settings: at most 0.5 s of past (one key frame) for the scored
boxes, CenterPoint's greedy track assignment in score order, BEVDet's decoding (no max-pool peak filter, Scale-NMS),
a score for every sample of a temporal model's split, and CBGS epochs that a resumed run draws as the first run did."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bev.classes import DETECTION_CLASSES, DETECTION_GROUPS
from bev.geometry import Grid, box_corners
from bev.tasks.detection.decode import SCALE_NMS_FACTORS, check_decoding, decode, footprint_iou, rotated_nms
from bev.tasks.detection.targets import REGRESSION_FIELDS
from bev.tasks.detection.tracking import TrackVelocity, check_past, track_velocity

GRID = Grid(xbound=(-20.0, 20.0, 0.5), ybound=(-16.0, 16.0, 0.5))
CLS = {name: k for k, name in enumerate(DETECTION_CLASSES)}


# --- the past a velocity reads ---------------------------------------------------------------------------------


def test_more_than_one_past_key_frame_is_refused_naming_the_key_and_the_rule():
    with pytest.raises(ValueError, match=r"track_velocity\.past_frames=2 reads 1 s .* allow at most 0\.5 s") as e:
        TrackVelocity.from_config({"past_frames": 2, "gate": 6.0, "min_past_score": 0.2, "still_speed": 2.5})
    assert "\n" not in str(e.value) and "set model.detection.track_velocity.past_frames=1" in str(e.value)
    assert TrackVelocity(2, 6.0, 0.2, 2.5, outside_rules=True).past_seconds == 1.0  # measurements only
    with pytest.raises(ValueError, match="track_velocity needs exactly"):  # not a config option
        TrackVelocity.from_config(
            {"past_frames": 2, "gate": 6.0, "min_past_score": 0.2, "still_speed": 2.5, "outside_rules": True}
        )


def test_a_temporal_model_with_tracks_or_a_longer_past_is_refused():
    track = TrackVelocity(1, 6.0, 0.2, 2.5)
    check_past(0, track)  # a static model: the tracks' one key frame
    check_past(1, None)  # BEVDet4D: one past key frame, the head's velocity
    with pytest.raises(ValueError, match=r"data\.past_frames=1: .*\(1 s of past in all\).*track_velocity=null"):
        check_past(1, track)
    with pytest.raises(ValueError, match=r"data\.past_frames=2 feeds .* 1 s .*; set data\.past_frames=1"):
        check_past(2, None)


def test_the_experiments_keep_to_the_rule():
    from hydra import compose, initialize_config_dir

    from bev.train import CONFIG_DIR

    for experiment in ("synthetic_det_cpu", "synthetic_det_temporal_cpu", "bevdet_nuscenes", "bevdet4d_nuscenes"):
        with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
            cfg = compose("train", overrides=[f"experiment={experiment}"])
        det = cfg.model.detection
        track = det.get("track_velocity")
        check_past(int(cfg.data.past_frames), None if track is None else TrackVelocity.from_config(track))
        check_decoding(dict(det.decoding))


def _box(token, x, y, score, name="car", velocity=(0.0, 0.0)):
    return {
        "sample_token": token,
        "translation": [x, y, 1.0],
        "size": [2.0, 4.5, 1.6],
        "rotation": [1.0, 0.0, 0.0, 0.0],
        "velocity": list(velocity),
        "detection_name": name,
        "detection_score": score,
        "attribute_name": "",
    }


def _frames(positions):
    """positions: per frame a list of (x, y, score); frames 0.5 s apart, chained by prev links."""
    links = {f"s{f}": (f"s{f - 1}" if f else "", 100.0 + 0.5 * f) for f in range(len(positions))}
    results = {f"s{f}": [_box(f"s{f}", *p) for p in frame] for f, frame in enumerate(positions)}
    return results, links


def test_a_low_scored_box_does_not_take_a_better_boxs_track():
    """The issue's case: a false positive (score 0.15) 1 m from where a car was, the car itself 4 m on (8 m/s).
    Closest pairs first gave the track to the false positive; CenterPoint's order (best score first) to the car."""
    results, links = _frames([[(0.0, 0.0, 0.9)], [(1.0, 0.0, 0.15), (4.0, 0.0, 0.9)]])
    out = track_velocity(results, links, TrackVelocity(1, 6.0, 0.0, 0.0))
    false_positive, car = out["s1"]
    np.testing.assert_allclose(car["velocity"], [8.0, 0.0])
    assert false_positive["velocity"] == [0.0, 0.0]  # no past box left: the head's velocity


def test_a_velocity_reads_the_present_and_the_key_frame_before_only():
    """Two cars crossing head-on: with one past key frame the boxes of s2 get the same velocities whether or not
    the key frame before that (s0) was seen (a track's older boxes once steered the match: 1 s of past)."""
    positions = [
        [(0.0, 0.0, 0.9), (11.0, 0.5, 0.8)],
        [(5.0, 0.0, 0.9), (6.0, 0.5, 0.8)],
        [(10.0, 0.0, 0.9), (1.0, 0.5, 0.8)],
    ]
    results, links = _frames(positions)
    options = TrackVelocity(1, 6.0, 0.0, 0.0)
    whole = track_velocity(results, links, options)
    later = track_velocity({k: results[k] for k in ("s1", "s2")}, links, options)
    assert [b["velocity"] for b in whole["s2"]] == [b["velocity"] for b in later["s2"]]


# --- decoding ----------------------------------------------------------------------------------------------------


def _corners(boxes):
    return box_corners(np.asarray(boxes, dtype=np.float64))[:, :4, :2]


def test_footprint_iou_equals_shapelys_polygon_iou():
    shapely = pytest.importorskip("shapely")
    rng = np.random.default_rng(0)
    n = 400
    a, b = np.zeros((n, 9)), np.zeros((n, 9))
    a[:, :2] = rng.uniform(-3, 3, (n, 2))
    for boxes in (a, b):
        boxes[:, 3:5], boxes[:, 6] = rng.uniform(0.2, 6.0, (n, 2)), rng.uniform(-math.pi, math.pi, n)
    a[:20], b[:20, :2] = b[:20], 0.0  # identical boxes
    a[20:40, 3:5] = b[20:40, 3:5] * 0.3  # one inside the other
    a[20:40, 6] = b[20:40, 6]
    b[40:60, :2] = a[40:60, :2] + [30.0, 0.0]  # far apart
    pa, pb = shapely.polygons(_corners(a)), shapely.polygons(_corners(b))
    inter = shapely.area(shapely.intersection(pa, pb))
    want = inter / (shapely.area(pa) + shapely.area(pb) - inter)
    got = footprint_iou(_corners(a), _corners(b))
    np.testing.assert_allclose(got, want, atol=1e-9)
    assert (got[:20] > 1 - 1e-9).all() and (got[40:60] == 0).all() and 0.05 < want.mean() < 0.5
    # Side by side, touching along an edge: no area in common.
    touching = footprint_iou(_corners([[0, 0, 0, 2, 4, 1, 0, 0, 0]]), _corners([[0, 2, 0, 2, 4, 1, 0, 0, 0]]))
    assert touching.tolist() == [0.0]


def _maps(peaks, regression_at=()):
    """Heatmap logits -10 but at each (class, ix, iy, logit); zero regression but sizes (w, l) at given cells."""
    nx, ny = GRID.bev_shape
    heatmap = torch.full((1, len(DETECTION_CLASSES), nx, ny), -10.0)
    regression = torch.zeros(1, len(DETECTION_GROUPS), len(REGRESSION_FIELDS), nx, ny)
    group = {name: g for g, names in enumerate(DETECTION_GROUPS) for name in names}
    for label, ix, iy, logit in peaks:
        heatmap[0, label, ix, iy] = logit
        w, l = regression_at.get(DETECTION_CLASSES[label], (1.0, 1.0)) if regression_at else (1.0, 1.0)
        regression[0, group[DETECTION_CLASSES[label]], 3:5, ix, iy] = torch.log(torch.tensor([w, l]))
    return heatmap, regression


def test_max_pool_off_keeps_every_cell_as_a_candidate():
    heatmap, regression = _maps([(CLS["car"], 10, 10, 3.0), (CLS["car"], 11, 10, 2.0)])
    (pooled,) = decode(heatmap, regression, GRID, nms=None)
    (every,) = decode(heatmap, regression, GRID, nms=None, max_pool=False)
    assert len(pooled["boxes"]) == 1 and len(every["boxes"]) == 2  # (11, 10) is a neighbour of a higher peak
    (nms,) = decode(heatmap, regression, GRID, nms="circle", max_pool=False)
    assert len(nms["boxes"]) == 1  # the duplicate 0.5 m away goes in NMS instead


def test_scale_nms_grows_small_footprints_and_circles_barriers():
    sizes = {"pedestrian": (0.6, 0.7), "traffic_cone": (0.4, 0.4), "barrier": (2.0, 0.5), "bus": (3.0, 11.0)}
    # Pedestrians 1 m apart (x): their 0.7 x 0.6 m footprints never meet, 4.5 times larger they overlap by IoU
    # (3.15 - 1) / (3.15 + 1) = 0.52 > 0.5 (the pedestrian group's threshold).
    peds = [(CLS["pedestrian"], 10, 10, 3.0), (CLS["pedestrian"], 12, 10, 2.0)]
    # Barriers 0.5 m apart (x, 0.5 m long: touching): circle NMS at 1 m keeps one; 1.5 m apart: both.
    barriers = [(CLS["barrier"], 40, 10, 3.0), (CLS["barrier"], 41, 10, 2.0), (CLS["barrier"], 44, 10, 1.0)]
    # Buses 4 m apart along their length: IoU (11 - 4) / (11 + 4) = 0.47 > 0.2 unscaled, 0.4 x 11 = 4.4 m: 0.05.
    buses = [(CLS["bus"], 60, 40, 3.0), (CLS["bus"], 68, 40, 2.0)]
    heatmap, regression = _maps(peds + barriers + buses, sizes)
    (rotated,) = decode(heatmap, regression, GRID, nms="rotated", max_pool=False)
    (scaled,) = decode(heatmap, regression, GRID, nms="scale_nms", max_pool=False)
    names = lambda out: sorted(DETECTION_CLASSES[k] for k in out["labels"].tolist())  # noqa: E731
    assert names(rotated) == ["barrier", "barrier", "barrier", "bus", "pedestrian", "pedestrian"]
    assert names(scaled) == ["barrier", "barrier", "bus", "bus", "pedestrian"]
    # The boxes keep their own sizes (the factors only widen the footprints for the IoU).
    by_name = {DETECTION_CLASSES[k]: b for k, b in zip(scaled["labels"].tolist(), scaled["boxes"].numpy())}
    np.testing.assert_allclose(by_name["pedestrian"][3:5], sizes["pedestrian"], rtol=1e-5)
    assert SCALE_NMS_FACTORS["pedestrian"] == 4.5 and SCALE_NMS_FACTORS["traffic_cone"] == 9.0


def test_rotated_nms_per_box_scale_and_per_group_threshold():
    # Two 1 x 1 m boxes 0.9 m apart: IoU 0.1 / 1.9; scaled by 3: (3 - 0.9) * 3 / (18 - 6.3) = 0.54.
    boxes = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0, 0], [0.9, 0, 0, 1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    group = torch.tensor([5, 5])
    assert rotated_nms(boxes, group, 0.2).tolist() == [0, 1]
    assert rotated_nms(boxes, group, 0.2, scale=torch.tensor([3.0, 3.0])).tolist() == [0]
    assert rotated_nms(boxes, group, [0.2] * 5 + [0.6], scale=torch.tensor([3.0, 3.0])).tolist() == [0, 1]


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"nms": "scale"}, "nms must be one of"),
        ({"maxpool": False}, "unknown model.detection.decoding key(s) ['maxpool']"),
        ({"nms": "circle", "nms_scale": {"car": 2.0}}, "nms_scale scales footprints for nms=scale_nms only"),
        ({"nms": "scale_nms", "nms_scale": {"pedestrain": 2.0}}, "nms_scale maps class names"),
        ({"nms": "rotated", "nms_iou": [0.2, 0.5]}, "one per class group (6)"),
        ({"max_pool": "false"}, "max_pool must be true"),
    ],
)
def test_bad_decoding_options_are_one_clear_error(options, needle):
    with pytest.raises(ValueError) as e:
        check_decoding(options)
    assert needle in str(e.value) and "\n" not in str(e.value)


# --- temporal windows: every sample scored -----------------------------------------------------------------------


def test_every_val_sample_of_a_temporal_detection_set_has_an_item(synthetic_root):
    from bev.data.nuscenes import NuScenesBEVDataset

    kw = dict(past_frames=1, detection=True, verbose=False)
    val = NuScenesBEVDataset(synthetic_root, split="mini_val", **kw)
    presents = [str(val.index["sample_token"][val.window_frames(w)[1]]) for w in range(len(val))]
    assert presents == [str(t) for t in val.index["sample_token"]]  # the scene's first key frame too
    first = val[0]
    assert first["sample_tokens"] == [presents[0], presents[0]]  # its own past (BEVDet4D)
    torch.testing.assert_close(first["future_egomotion"][0], torch.eye(4))
    torch.testing.assert_close(first["images"][0], first["images"][1])
    train = NuScenesBEVDataset(synthetic_root, split="mini_train", augment=True, **kw)
    assert len(train) == len(train.index["sample_token"]) - 1  # training: whole windows only


# --- CBGS: a resumed run draws the epochs the first run drew --------------------------------------------------


class _Indices(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor(i)


def _fit(sampler, epochs, ckpt_in=None, ckpt_out=None):
    """The sample numbers each epoch of a tiny Lightning run drew, {epoch: [...]}."""
    import lightning as L

    seen: dict[int, list[int]] = {}

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, _):
            seen.setdefault(self.current_epoch, []).extend(batch.tolist())
            return (self.w * 0).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = torch.utils.data.DataLoader(_Indices(sampler.dataset_length), batch_size=64, sampler=sampler)
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), loader, ckpt_path=ckpt_in)
    if ckpt_out:
        trainer.save_checkpoint(ckpt_out)
    return seen


def test_a_resumed_cbgs_run_draws_the_uninterrupted_runs_epoch(synthetic_root, tmp_path):
    from bev.data.cbgs import ClassBalancedSampler
    from bev.data.nuscenes import NuScenesBEVDataset

    ds = NuScenesBEVDataset(synthetic_root, split="mini_train", detection=True, det_range="grid", verbose=False)

    def sampler():
        s = ClassBalancedSampler(ds, seed=7)
        s.dataset_length = len(ds)
        return s

    whole = _fit(sampler(), 3)
    _fit(sampler(), 2, ckpt_out=tmp_path / "two.ckpt")
    resumed = _fit(sampler(), 3, ckpt_in=tmp_path / "two.ckpt")  # a new process: a new sampler
    assert list(resumed) == [2]
    assert resumed[2] == whole[2] and whole[2] != whole[0]


# --- the measurement script ----------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_the_rules_script_scores_six_variants_of_one_pass(synthetic_root, tmp_path, monkeypatch, capsys):
    """scripts/track_velocity_scores.py on a 1-epoch tiny detection run: two decodings x three velocities, the
    velocities leaving mAP as it is, the 1 s tracks labelled outside the rules where printed and in the JSON."""
    import importlib.util
    import json
    from pathlib import Path

    from helpers.cli import TINY, train_cli

    run = tmp_path / "run"
    args = [
        *TINY,
        "data.detection=true",
        "model.net.heads.detection={shared_channels: 8, head_channels: 0}",
        "model.tasks=[segmentation,detection]",
        "callbacks.bev_png.every_n_steps=0",
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={run}",
    ]
    assert train_cli(args, monkeypatch) == 0
    path = Path(__file__).resolve().parents[1] / "scripts/track_velocity_scores.py"
    spec = importlib.util.spec_from_file_location("track_velocity_scores", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "rules.json"
    capsys.readouterr()
    assert script.main([str(run), "--dataroot", str(synthetic_root), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["variants"]
    assert sorted(rows) == sorted(
        f"{d}/{v}" for d in ("maxpool_circle", "bevdet") for v in ("head", "tracks_1_frame", "tracks_2_frames")
    )
    for d in ("maxpool_circle", "bevdet"):
        assert rows[f"{d}/head"]["mAP"] == rows[f"{d}/tracks_1_frame"]["mAP"] == rows[f"{d}/tracks_2_frames"]["mAP"]
        assert rows[f"{d}/tracks_2_frames"]["note"] == "outside the nuScenes detection rules (1 s of past)"
        assert "note" not in rows[f"{d}/tracks_1_frame"] and set(rows[f"{d}/head"]["AP"]) >= {"car", "barrier"}
    assert printed.count("[outside the nuScenes detection rules (1 s of past)]") == 2
    with pytest.raises(SystemExit, match="exists: pass --overwrite"):
        script.main([str(run), "--dataroot", str(synthetic_root), "--out", str(out)])
