"""The split-index cache is keyed on the tables' content and checked when loaded: an edit that keeps a
table's (or a map file's) size and mtime makes it stale, a cache with zeroed or missing arrays is rebuilt with a warning,
and a copied dataroot (cp -a: new ctime) reuses its cache after one rehash of the tables."""

import json
import os
import shutil
import warnings

import numpy as np
import pytest

import bev.data.index as reader
from bev.data import NuScenesBEVDataset


@pytest.fixture
def root(synthetic_root, tmp_path):
    """A copy of the synthetic dataroot with its index cache built for mini_val."""
    dst = tmp_path / "data"
    shutil.copytree(synthetic_root, dst, ignore=shutil.ignore_patterns(".bev_cache"))
    NuScenesBEVDataset(dst, split="mini_val", verbose=False)
    return dst


def _cache(root):
    (f,) = (root / ".bev_cache").glob("*.npz")
    return f


def _rewrite(cache, change):
    """The cache file with its arrays changed by `change(dict)`, key and checksum copied as they were."""
    with np.load(cache, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    change(arrays)
    with open(cache, "wb") as f:
        np.savez(f, **arrays)


def _no_devkit(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the index was rebuilt")

    monkeypatch.setattr(reader, "build_index", boom)


def test_a_cache_with_zeroed_arrays_is_rebuilt(root):
    fresh = NuScenesBEVDataset(root, split="mini_val", verbose=False).index
    assert fresh["box_size"].any()
    _rewrite(
        _cache(root), lambda a: a.update(box_size=np.zeros_like(a["box_size"]), box_label=np.zeros_like(a["box_label"]))
    )
    with pytest.warns(UserWarning, match="do not match the checksum"):
        ds = NuScenesBEVDataset(root, split="mini_val", verbose=False)
    assert all(np.array_equal(ds.index[k], fresh[k]) for k in fresh)
    assert ds[0]["bev"].any()  # labels, not an empty target


def test_a_cache_missing_an_array_is_rebuilt(root):
    _rewrite(_cache(root), lambda a: a.pop("rots"))
    with pytest.warns(UserWarning, match="rebuilt from the tables"):
        ds = NuScenesBEVDataset(root, split="mini_val", verbose=False)
    assert ds.index["rots"].shape[1:] == (6, 3, 3)
    ds[0]


def test_an_edit_that_keeps_size_and_mtime_makes_the_cache_stale(root):
    first = NuScenesBEVDataset(root, split="mini_val", verbose=False).index
    table = root / "v1.0-mini" / "sample_annotation.json"
    st, text = table.stat(), table.read_text()
    # A vehicle of the split made 1 m longer in as many bytes ("3.25..." -> "4.25..."), the mtime put back
    # (as cp -a or tar would keep it): sizes and mtimes are all the same.
    tables = {n: json.loads((root / "v1.0-mini" / f"{n}.json").read_text()) for n in ("instance", "category")}
    category = {c["token"]: c["name"] for c in tables["category"]}
    vehicles = {i["token"] for i in tables["instance"] if category[i["category_token"]].startswith("vehicle.")}
    row = next(
        r
        for r in json.loads(text)
        if r["instance_token"] in vehicles
        and r["sample_token"] in set(first["sample_token"])
        and 1 <= r["size"][1] < 9
        and text.count(json.dumps(r["size"][1])) == 1
    )
    old = json.dumps(row["size"][1])
    table.write_text(text.replace(old, str(int(old[0]) + 1) + old[1:]))
    os.utime(table, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (table.stat().st_size, table.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    changed = NuScenesBEVDataset(root, split="mini_val", verbose=False).index
    diff = changed["box_size"].astype(np.float64) - first["box_size"]
    assert np.count_nonzero(diff) == 1 and np.isclose(diff.max(), 1.0, atol=1e-5)


def test_a_copied_dataroot_reuses_its_cache(root, tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)  # copy2: sizes and mtimes kept, ctimes and inodes new
    _no_devkit(monkeypatch)
    ds = NuScenesBEVDataset(copy, split="mini_val", verbose=False)
    assert len(ds) == 3


def test_a_map_edit_that_keeps_size_and_mtime_makes_the_cache_stale(root):
    locations = NuScenesBEVDataset(root, split="mini_val", verbose=False).index["location"]
    path = root / "maps" / "expansion" / f"{locations[0]}.json"
    m = json.loads(path.read_text())
    path.write_text(json.dumps(m))  # one node per {"token": ..., "x": ...} text below
    first = NuScenesBEVDataset(root, split="mini_val", map_layers="lss", verbose=False).index
    # A drivable-area node moved by 1 m in as many bytes (its x's leading digit + 1), the mtime put back.
    polygon = {q["token"]: q for q in m["polygon"]}[m["drivable_area"][0]["polygon_tokens"][0]]
    node = next(n for n in m["node"] if n["token"] in polygon["exterior_node_tokens"] and str(n["x"])[0] in "12345678")
    old = json.dumps({"token": node["token"], "x": node["x"]})[:-1]
    new = old[: -len(str(node["x"]))] + str(int(str(node["x"])[0]) + 1) + str(node["x"])[1:]
    st, text = path.stat(), path.read_text()
    assert text.count(old) == 1
    path.write_text(text.replace(old, new))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with warnings.catch_warnings():  # the moved node may make its polygon self-intersect (then repaired)
        warnings.simplefilter("ignore")
        changed = NuScenesBEVDataset(root, split="mini_val", map_layers="lss", verbose=False).index
    assert changed["map_xy"].shape != first["map_xy"].shape or not np.array_equal(changed["map_xy"], first["map_xy"])
