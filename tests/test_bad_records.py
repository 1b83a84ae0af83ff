"""Broken records in the tables and the map expansion, met when the split index is built: a broken pose
is one error naming its table, token and fix; a broken box or map shape is skipped, counted and named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bev.data.nuscenes import NuScenesBEVDataset
from helpers.tiny_nuscenes import LOCATION, write_tiny


@pytest.fixture
def root(tmp_path) -> Path:
    return write_tiny(tmp_path / "nuscenes", samples=2)


def edit_table(root: Path, table: str, edit) -> list[dict]:
    """Apply edit(records) to v1.0-mini/<table>.json; returns the records (after the edit)."""
    path = root / "v1.0-mini" / f"{table}.json"
    records = json.loads(path.read_text())
    edit(records)
    path.write_text(json.dumps(records))  # NaN written as the devkit's json.load reads it back
    return records


def dataset(root: Path, tmp_path: Path, **kw) -> NuScenesBEVDataset:
    return NuScenesBEVDataset(root, split="mini_train", cache_dir=tmp_path / "cache", verbose=False, **kw)


@pytest.mark.parametrize(
    "table, field, value",
    [
        ("ego_pose", "rotation", [0.0, 0.0, 0.0, 0.0]),
        ("ego_pose", "rotation", [float("nan"), 0.0, 0.0, 1.0]),
        ("ego_pose", "translation", [1.0, float("nan"), 0.0]),
        ("calibrated_sensor", "rotation", [0.0, 0.0, 0.0, 0.0]),
        ("calibrated_sensor", "translation", [float("inf"), 0.0, 1.5]),
    ],
)
def test_a_broken_pose_is_one_error_naming_table_token_and_fix(root, tmp_path, table, field, value):
    def edit(records):
        for r in records:
            r[field] = value

    records = edit_table(root, table, edit)
    with pytest.raises(ValueError) as e:
        dataset(root, tmp_path)
    msg = str(e.value)
    assert msg.startswith(f"{table} ") and field in msg and f"Fix or re-export that record of {table}.json" in msg
    assert any(msg.startswith(f"{table} {r['token']}:") for r in records)


@pytest.mark.parametrize(
    "field, value", [("size", [0.0, 4.0, 1.5]), ("size", [2.0, float("nan"), 1.5]), ("rotation", [0, 0, 0, 0])]
)
def test_a_broken_box_is_skipped_counted_and_named(root, tmp_path, field, value):
    clean = dataset(root, tmp_path / "clean")
    anns = json.loads((root / "v1.0-mini" / "sample_annotation.json").read_text())
    used = {t.decode() for t in clean.index["box_instance"]}  # annotations of the target classes
    target = next(a for a in anns if a["instance_token"] in used)

    def edit(records):
        next(r for r in records if r["token"] == target["token"])[field] = value

    edit_table(root, "sample_annotation", edit)
    with pytest.warns(UserWarning, match=rf"skipped 1 sample_annotation box.*{target['token']}"):
        broken = dataset(root, tmp_path / "broken")
    assert len(broken.index["box_label"]) == len(clean.index["box_label"]) - 1
    assert np.isfinite(broken.index["box_footprint"]).all()


def edit_map(root: Path, edit) -> None:
    path = root / "maps" / "expansion" / f"{LOCATION}.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def _nodes(m: dict, pts) -> list[str]:
    toks = []
    for x, y in pts:
        toks.append(f"bad{len(m['node'])}")
        m["node"].append({"token": toks[-1], "x": x, "y": y})
    return toks


def _add_polygon(m: dict, layer: str, ext, holes=()) -> str:
    tok = f"badpoly{len(m['polygon'])}"
    m["polygon"].append(
        {"token": tok, "exterior_node_tokens": _nodes(m, ext), "holes": [{"node_tokens": _nodes(m, h)} for h in holes]}
    )
    if layer == "drivable_area":
        m[layer][0]["polygon_tokens"].append(tok)
    else:
        m[layer].append({**m[layer][0], "token": f"{layer}_{tok}", "polygon_token": tok})
    return tok


def test_broken_map_shapes_are_skipped_or_repaired_and_named(root, tmp_path):
    clean = dataset(root, tmp_path / "clean", map_layers="bevfusion")
    made = {}

    def edit(m):
        made["two_points"] = _add_polygon(m, "ped_crossing", [(10, 10), (12, 12)])
        made["bowtie_ped"] = _add_polygon(m, "ped_crossing", [(0, 0), (4, 4), (4, 0), (0, 4)])
        made["nan"] = _add_polygon(m, "walkway", [(0, 0), (float("nan"), 4), (4, 0)])
        made["bowtie_drivable"] = _add_polygon(m, "drivable_area", [(300, 300), (304, 304), (304, 300), (300, 304)])
        made["thin_hole"] = _add_polygon(m, "walkway", [(20, 20), (30, 20), (30, 30)], holes=[[(22, 22), (23, 23)]])

    edit_map(root, edit)
    with pytest.warns(UserWarning, match="map expansion") as w:
        broken = dataset(root, tmp_path / "broken", map_layers="bevfusion")
    msg = " ".join(str(x.message) for x in w)
    for key in ("two_points", "bowtie_ped", "nan", "bowtie_drivable"):
        assert made[key] in msg, key
    assert "repaired" in msg and "fewer than 3" in msg and "non-finite" in msg
    shapes = len(clean.index["map_shape_class"])
    # kept: the bow tie of drivable area as its two triangles, the walkway without its 2-point hole
    assert len(broken.index["map_shape_class"]) == shapes + 3
    assert np.isfinite(broken.index["map_xy"]).all()
    assert broken.map_target(0).shape == clean.map_target(0).shape


def test_a_map_polygon_naming_a_missing_node_is_skipped_and_named(root, tmp_path):
    clean = dataset(root, tmp_path / "clean", map_layers="bevfusion")
    made = {}

    def edit(m):
        made["node"] = _add_polygon(m, "walkway", [(0, 0), (4, 0), (4, 4)])
        m["polygon"][-1]["exterior_node_tokens"][1] = "nonexistent_node"

    edit_map(root, edit)
    with pytest.warns(UserWarning, match="map expansion") as w:
        broken = dataset(root, tmp_path / "broken", map_layers="bevfusion")
    msg = " ".join(str(x.message) for x in w)
    assert f"walkway_{made['node']}: its polygon {made['node']} names a missing node nonexistent_node" in msg
    assert len(broken.index["map_shape_class"]) == len(clean.index["map_shape_class"])


@pytest.mark.parametrize("layer, field", [("walkway", "polygon_token"), ("road_divider", "line_token")])
def test_a_map_record_naming_a_missing_polygon_or_line_is_one_error(root, tmp_path, layer, field):
    def edit(m):
        m[layer].append({**m[layer][0], "token": "lost_record", field: "nonexistent_shape"})

    edit_map(root, edit)
    with pytest.raises(ValueError) as e:
        dataset(root, tmp_path, map_layers="bevfusion")
    msg = str(e.value)
    assert f"{layer} record lost_record names a missing token 'nonexistent_shape'" in msg
    assert LOCATION in msg and "Fix that record" in msg and len(msg.splitlines()) == 1
