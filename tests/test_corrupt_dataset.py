"""The corrupt-dataset suite (issue 39): one tiny nuScenes-format set (helpers.tiny_nuscenes) is written once per
module and each case corrupts a copy of it in one way: wrong types and non-finite numbers, dangling or mistyped
links, missing, empty and truncated files, singular intrinsics, absurd sizes, a chain that goes back in time.

Every case loads the copy as training does (the split index, then every item, with map layers, detection boxes
and depth targets) under a time limit, and must end in ONE clear error (one line naming the table or file, the
record or token, and a fix) or in a counted warning after which the items hold no NaN: never a hang, a raw
KeyError / TypeError / IndexError, or a silent accept. Cases covered elsewhere are not repeated here: cycles,
stray links, duplicates and dangling tokens of every link (test_corrupt_tables), zero / NaN poses and boxes and
broken map shapes (test_bad_records), image sizes (test_bad_images), LiDAR files (test_depth)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bev.data.nuscenes import NuScenesBEVDataset
from bev.data.tables import MAX_BOX_SIZE_M, MAX_IMAGE_SIDE
from helpers.tiny_nuscenes import LOCATION, write_tiny

VERSION = "v1.0-mini"
GUARD_S = 30  # a case that loops fails here instead of hanging the suite
# What a clear error tells the user to do (one of these words).
FIX = re.compile(r"fix|download|regenerate|replace|set data\.|add its", re.IGNORECASE)

# Tokens of the tiny set (tests/helpers/tiny_nuscenes.py): scene-0061 (mini_train) has samples s0-0, s0-1.
SAMPLE, NEXT_SAMPLE = "s0-0", "s0-1"
CAM_SD = "sd-s0-0-CAM_FRONT"
CAM_CS = "cs-CAM_FRONT"
CAR = "ann-s0-0-0"  # the car of sample s0-0: a target box and a detection box
MAP_FILE = f"maps/expansion/{LOCATION}.json"
IMAGE = "samples/CAM_FRONT/s0-0__CAM_FRONT.jpg"
K_OK = [[1260.0, 0.0, 800.0], [0.0, 1260.0, 450.0], [0.0, 0.0, 1.0]]
INF, NAN = float("inf"), float("nan")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """The tiny set, written once for the module (2 scenes x 2 samples, a map expansion): never edited."""
    return write_tiny(tmp_path_factory.mktemp("pristine") / "nuscenes", samples=2)


class DataCopy:
    """A copy of the pristine set to corrupt. Tables are copied; images, LiDAR and map files are symbolic links to
    the pristine ones until file() replaces one by its own copy, so no edit can reach the pristine set."""

    def __init__(self, pristine: Path, root: Path) -> None:
        self.pristine, self.root = pristine, root
        shutil.copytree(pristine, root, copy_function=os.symlink)
        for table in (root / VERSION).glob("*.json"):
            self.file(table.relative_to(root))

    def file(self, rel: str | Path) -> Path:
        """The copy's own file rel (a link replaced by a copy of the pristine file), to edit or delete."""
        path = self.root / rel
        if path.is_symlink():
            path.unlink()
            shutil.copyfile(self.pristine / rel, path)
        return path

    def table(self, name: str) -> list[dict]:
        return json.loads((self.root / VERSION / f"{name}.json").read_text())

    def save(self, name: str, records: Any) -> None:
        (self.root / VERSION / f"{name}.json").write_text(
            json.dumps(records)
        )  # NaN / Infinity as the devkit reads them

    def set(self, table: str, token: str, field: str, value: Any) -> None:
        """Set (or with value DELETE, remove) one field of the record `token` of `table`."""
        records = self.table(table)
        record = next(r for r in records if r.get("token") == token)
        if value is DELETE:
            del record[field]
        else:
            record[field] = value
        self.save(table, records)

    def edit_map(self, edit: Callable[[dict], None]) -> None:
        path = self.file(MAP_FILE)
        m = json.loads(path.read_text())
        edit(m)
        path.write_text(json.dumps(m))


DELETE = object()


@dataclass(frozen=True)
class Case:
    corrupt: Callable[[DataCopy], Any]  # edits the copy
    names: tuple[str, ...]  # what the message must name (table or file, record or token, field)
    error: type[Exception] | None = ValueError  # None: a counted warning (names in it), and the data loads


def _field(table: str, token: str, field: str, value: Any, *names: str, error=ValueError) -> Case:
    """A case that sets one field of one record; the message names the table, the token and the field."""
    return Case(lambda d: d.set(table, token, field, value), (table, token, field, *names), error)


def _box(field: str, value: Any) -> Case:
    """A case that breaks the car's box: skipped, counted and named in a warning."""
    return Case(lambda d: d.set("sample_annotation", CAR, field, value), ("skipped 1 sample_annotation box", CAR), None)


def _intrinsic(value: Any) -> Case:
    return _field("calibrated_sensor", CAM_CS, "camera_intrinsic", value)


def _with_row(k: int, row: list[float]) -> list[list[float]]:
    return [row if i == k else list(r) for i, r in enumerate(K_OK)]


def _truncate(d: DataCopy, rel: str, keep: float) -> None:
    path = d.file(rel)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _delete(d: DataCopy, rel: str) -> None:
    d.file(rel).unlink()


def _node(field: str, value: Any) -> Callable[[DataCopy], None]:
    """Corrupts one coordinate of the first node of the first drivable-area polygon (p0) of the map."""

    def corrupt(d: DataCopy) -> None:
        def edit(m: dict) -> None:
            node = next(n for n in m["node"] if n["token"] == m["polygon"][0]["exterior_node_tokens"][0])
            if value is DELETE:
                del node[field]
            else:
                node[field] = value

        d.edit_map(edit)

    return corrupt


def _chain_back_in_time(d: DataCopy) -> None:
    samples = d.table("sample")
    first = next(s for s in samples if s["token"] == SAMPLE)
    next(s for s in samples if s["token"] == NEXT_SAMPLE)["timestamp"] = first["timestamp"] - 1
    d.save("sample", samples)


LIDAR = "samples/LIDAR_TOP/s0-0.pcd.bin"


def _lidar_points(value: float) -> Case:
    """Two points of sample s0-0's LiDAR file get `value` as coordinates: dropped, counted and named."""

    def corrupt(d: DataCopy) -> None:
        path = d.file(LIDAR)
        points = np.fromfile(path, dtype=np.float32).reshape(-1, 5)
        points[:2, :3] = value
        points.tofile(path)

    return Case(corrupt, (LIDAR, "dropped 2 of"), None)


def _drop_record_token(d: DataCopy) -> None:
    records = d.table("instance")
    del records[0]["token"]
    d.save("instance", records)


CASES: dict[str, Case] = {
    # ---- links: a wrong type where a token belongs, links the devkit's reverse index follows
    "link-token-is-a-list": _field(
        "sample_data", CAM_SD, "calibrated_sensor_token", [CAM_CS], "not a calibrated_sensor token"
    ),
    "link-token-is-a-number": _field("sample_data", CAM_SD, "sample_token", 7, "not a sample token"),
    "link-token-is-null": _field("scene", "scene0", "log_token", None, "not a log token"),
    "category-link-is-null": _field("instance", "inst0-0", "category_token", None, "not a category token"),
    "link-list-is-a-string": _field(
        "sample_annotation", CAR, "attribute_tokens", "abc", "not a list of attribute tokens"
    ),
    "map-log-tokens-null": _field("map", "map0", "log_tokens", None, "not a list of log tokens"),
    "log-no-map-names": Case(lambda d: d.set("map", "map0", "log_tokens", []), ("table log", "log0", "map.json")),
    "record-without-token": Case(_drop_record_token, ("table instance", "record #0", "token", "instance.json")),
    "table-not-a-list": Case(lambda d: d.save("visibility", {}), ("visibility.json", "not a list of records")),
    "record-not-an-object": Case(lambda d: d.save("log", ["log0"]), ("table log", "record #0", "log.json")),
    "sensor-channel-renamed": Case(
        lambda d: d.set("sensor", "sensor-CAM_FRONT", "channel", "CAMERA"), (SAMPLE, "no CAM_FRONT", "sample_data.json")
    ),
    "camera-not-a-key-frame": Case(
        lambda d: d.set("sample_data", "sd-s0-0-CAM_BACK", "is_key_frame", False), (SAMPLE, "no CAM_BACK")
    ),
    "chain-cut-short": Case(
        lambda d: d.set("sample", SAMPLE, "next", ""), ("scene-0061", SAMPLE, NEXT_SAMPLE, "sample.json")
    ),
    "chain-back-in-time": Case(_chain_back_in_time, ("scene-0061", NEXT_SAMPLE, "timestamp", "sample.json")),
    # ---- plain fields of the wrong type
    "timestamp-string": _field("sample", SAMPLE, "timestamp", "yesterday", "sample.json"),
    "timestamp-null": _field("sample", SAMPLE, "timestamp", None),
    "nbr-samples-string": _field("scene", "scene0", "nbr_samples", "2"),
    "is-key-frame-string": _field("sample_data", CAM_SD, "is_key_frame", "yes"),
    "filename-null": _field("sample_data", CAM_SD, "filename", None),
    "num-lidar-pts-string": _field("sample_annotation", CAR, "num_lidar_pts", "many"),
    "location-null": _field("log", "log0", "location", None),
    "category-name-number": _field("category", "cat-vehicle.car", "name", 7),
    "sensor-channel-missing": _field("sensor", "sensor-CAM_FRONT", "channel", DELETE, "is missing"),
    # ---- poses: strings, null, wrong lengths (zero and NaN poses: test_bad_records)
    "translation-string": _field("ego_pose", "ep-s0-0-LIDAR_TOP", "translation", "1,2,3", "ego_pose.json"),
    "translation-numbers-as-strings": _field("calibrated_sensor", CAM_CS, "translation", ["1", "0", "1.5"]),
    "translation-too-short": _field("calibrated_sensor", CAM_CS, "translation", [1.0, 0.0]),
    "translation-inf-camera-pose": _field("ego_pose", "ep-s0-0-CAM_FRONT", "translation", [INF, 0.0, 0.0]),
    "rotation-string": _field("calibrated_sensor", CAM_CS, "rotation", "1 0 0 0", "calibrated_sensor.json"),
    "rotation-null": _field("ego_pose", "ep-s0-0-CAM_BACK", "rotation", None),
    "rotation-too-long": _field("ego_pose", "ep-s0-0-LIDAR_TOP", "rotation", [1.0, 0.0, 0.0, 0.0, 0.0]),
    # ---- intrinsics
    "intrinsics-zeros": _intrinsic([[0.0] * 3] * 3),
    "intrinsics-fx-zero": _intrinsic(_with_row(0, [0.0, 0.0, 800.0])),
    "intrinsics-fy-negative": _intrinsic(_with_row(1, [0.0, -1260.0, 450.0])),
    "intrinsics-last-row-zero": _intrinsic(_with_row(2, [0.0, 0.0, 0.0])),
    "intrinsics-nan": _intrinsic(_with_row(0, [NAN, 0.0, 800.0])),
    "intrinsics-inf": _intrinsic(_with_row(1, [0.0, 1260.0, INF])),
    "intrinsics-string": _intrinsic("1260 0 800; 0 1260 450; 0 0 1"),
    "intrinsics-null": _intrinsic(None),
    "intrinsics-two-rows": _intrinsic(K_OK[:2]),
    "intrinsics-flat": _intrinsic([v for row in K_OK for v in row]),
    # ---- image sizes in the table
    "image-width-zero": _field("sample_data", CAM_SD, "width", 0),
    "image-height-huge": _field("sample_data", CAM_SD, "height", 10**7, str(MAX_IMAGE_SIDE)),
    "image-width-string": _field("sample_data", CAM_SD, "width", "1600"),
    "image-width-fraction": _field("sample_data", CAM_SD, "width", 1600.5),
    # ---- boxes: skipped, counted, named
    "box-size-string": _box("size", "big"),
    "box-size-two-numbers": _box("size", [2.0, 4.5]),
    "box-size-null": _box("size", None),
    "box-size-inf": _box("size", [INF, 4.5, 1.6]),
    "box-size-huge": _box("size", [1.9, 1e6, 1.6]),
    "box-size-negative": _box("size", [-1.9, 4.5, 1.6]),
    "box-translation-string": _box("translation", "here"),
    "box-rotation-inf": _box("rotation", [INF, 0.0, 0.0, 0.0]),
    # ---- files
    "table-cut-in-half": Case(lambda d: _truncate(d, f"{VERSION}/scene.json", 0.5), ("scene.json", "damaged")),
    "table-empty": Case(lambda d: _truncate(d, f"{VERSION}/sample_data.json", 0.0), ("sample_data.json", "damaged")),
    "table-missing": Case(lambda d: _delete(d, f"{VERSION}/attribute.json"), ("attribute.json",), FileNotFoundError),
    "jpeg-truncated": Case(lambda d: _truncate(d, IMAGE, 0.5), (IMAGE, "cannot decode"), OSError),
    "jpeg-empty": Case(lambda d: _truncate(d, IMAGE, 0.0), (IMAGE, "cannot decode"), OSError),
    "jpeg-missing": Case(lambda d: _delete(d, IMAGE), (IMAGE,), FileNotFoundError),
    "map-truncated": Case(
        lambda d: _truncate(d, MAP_FILE, 0.5), (MAP_FILE, "cannot read the map expansion"), ValueError
    ),
    "map-missing": Case(lambda d: _delete(d, MAP_FILE), (MAP_FILE,), FileNotFoundError),
    "map-of-unknown-location": Case(
        lambda d: d.set("log", "log0", "location", "atlantis"), ("maps/expansion/atlantis.json",), FileNotFoundError
    ),
    "map-node-not-a-number": Case(
        _node("x", "east"), (MAP_FILE, "1 shape(s)", "drivable_area polygon p0", "non-numeric"), None
    ),
    "map-node-without-y": Case(
        _node("y", DELETE), (MAP_FILE, "1 shape(s)", "drivable_area polygon p0", "non-numeric"), None
    ),
    # ---- LiDAR points (depth targets): dropped before any product, never numpy's "invalid value" on stderr
    "lidar-points-nan": _lidar_points(NAN),
    "lidar-points-inf": _lidar_points(-INF),
    "lidar-points-huge": _lidar_points(1e30),
}


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    def _expired(signum, frame):
        raise TimeoutError(f"loading the corrupt set ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, _expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _load(root: Path, cache: Path) -> list[dict]:
    """The split's index and every item, as training reads them (maps, detection boxes, depth targets)."""
    with _time_limit(GUARD_S):
        ds = NuScenesBEVDataset(
            root,
            split="mini_train",
            cache_dir=cache,
            verbose=False,
            map_layers="lss",
            detection=True,
            depth_target=True,
        )
        return [ds[i] for i in range(len(ds))]


def _assert_finite(items: list[dict]) -> None:
    for item in items:
        for key, value in item.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                assert torch.isfinite(value).all(), key


def _assert_one_clear_message(msg: str, names: tuple[str, ...], fix: bool = True) -> None:
    assert len(msg.strip().splitlines()) == 1 and len(msg) < 1000, msg
    for name in names:
        assert name in msg, (name, msg)
    assert not fix or FIX.search(msg), f"no fix in {msg!r}"


def test_the_uncorrupted_copy_loads_without_a_warning(pristine, tmp_path):
    import warnings

    data = DataCopy(pristine, tmp_path / "nuscenes")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        items = _load(data.root, tmp_path / "cache")
    assert len(items) == 2 and [it["sample_token"] for it in items] == [SAMPLE, NEXT_SAMPLE]
    _assert_finite(items)


def test_the_copy_never_edits_the_pristine_set(pristine, tmp_path):
    before = {p: p.read_bytes() for p in pristine.rglob("*") if p.is_file()}
    for case in ("table-cut-in-half", "jpeg-truncated", "map-node-not-a-number", "image-width-zero"):
        CASES[case].corrupt(DataCopy(pristine, tmp_path / case))
    assert before == {p: p.read_bytes() for p in pristine.rglob("*") if p.is_file()}


@pytest.mark.parametrize("name", list(CASES))
def test_a_corrupt_set_ends_in_one_clear_error_or_a_counted_warning(pristine, tmp_path, name):
    case = CASES[name]
    data = DataCopy(pristine, tmp_path / "nuscenes")
    case.corrupt(data)
    if case.error is None:
        with pytest.warns(UserWarning) as caught:
            items = _load(data.root, tmp_path / "cache")
        named = [str(w.message) for w in caught if all(n in str(w.message) for n in case.names)]
        assert len(named) == 1, [str(w.message) for w in caught]
        assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
        _assert_one_clear_message(named[0], case.names)
        _assert_finite(items)
        return
    with pytest.raises(Exception) as e:
        _load(data.root, tmp_path / "cache")
    assert type(e.value) is case.error, f"{type(e.value).__name__}: {e.value}"
    _assert_one_clear_message(str(e.value), case.names)


def test_large_but_real_sizes_are_kept(pristine, tmp_path):
    """The bounds refuse absurd values only: a 30 m box (longer than any nuScenes object) is still trained on."""
    assert MAX_BOX_SIZE_M > 30 and MAX_IMAGE_SIDE > 1600
    data = DataCopy(pristine, tmp_path / "nuscenes")
    data.set("sample_annotation", CAR, "size", [2.5, 30.0, 4.0])
    clean = NuScenesBEVDataset(pristine, split="mini_train", cache_dir=tmp_path / "clean", verbose=False)
    with _time_limit(GUARD_S):
        ds = NuScenesBEVDataset(data.root, split="mini_train", cache_dir=tmp_path / "cache", verbose=False)
    assert len(ds.index["box_label"]) == len(clean.index["box_label"])
    assert [2.5, 30.0, 4.0] in ds.index["box_size"].tolist()
    assert ds.targets(0)[0].sum() > clean.targets(0)[0].sum()  # the long box covers more cells
