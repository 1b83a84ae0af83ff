"""Corrupt tables end the index build quickly with one clear error, never a hang or silently changed data:
cycles and stray links in the sample chain (bev.data.index._scene_samples), duplicated tokens in any table
(_duplicated_token). Each case corrupts a copy of the synthetic set's JSON tables (2 scenes x 3 samples)."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bev.classes import normalize_categories
from bev.data.index import build_index
from bev.data.tables import _LINKS, TABLES

VERSION = "v1.0-mini"
TRAIN_SCENE = "scene-0061"  # mini_train; scene-0103 is mini_val
GUARD_S = 30  # a regression that loops fails here instead of hanging the suite


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    def _expired(signum, frame):
        raise TimeoutError(f"the index build ran past {seconds} s: a walk over the tables does not stop")

    previous = signal.signal(signal.SIGALRM, _expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def tables(synthetic_root: Path, tmp_path: Path) -> Callable[[str], list[dict]]:
    """A copy of the synthetic set whose tables the test edits: tables(name) reads one, save(name, records)
    (as tables.save) writes it back; tables.root is the dataroot (images and maps linked, not copied)."""
    root = tmp_path / "nuscenes"
    shutil.copytree(synthetic_root / VERSION, root / VERSION)
    for entry in synthetic_root.iterdir():
        if entry.name != VERSION:
            (root / entry.name).symlink_to(entry)

    def read(name: str) -> list[dict]:
        return json.loads((root / VERSION / f"{name}.json").read_text())

    def save(name: str, records: list[dict]) -> None:
        (root / VERSION / f"{name}.json").write_text(json.dumps(records))

    read.save, read.root = save, root  # type: ignore[attr-defined]
    return read


def _build(root: Path) -> dict:
    with _time_limit(GUARD_S):
        return build_index(root, VERSION, "mini_train", normalize_categories(("vehicle.",)), verbose=False)


def _chain(tables, scene_name: str) -> tuple[dict, list[dict]]:
    """(scene record, its samples in chain order)."""
    scene = next(s for s in tables("scene") if s["name"] == scene_name)
    by_token = {s["token"]: s for s in tables("sample")}
    chain, token = [], scene["first_sample_token"]
    while token:
        chain.append(by_token[token])
        token = by_token[token]["next"]
    return scene, chain


def _relink(tables, token: str, next_token: str) -> None:
    samples = tables("sample")
    for s in samples:
        if s["token"] == token:
            s["next"] = next_token
    tables.save("sample", samples)


def _assert_one_clear_error(e: pytest.ExceptionInfo, *names: str) -> None:
    msg = str(e.value)
    assert len(msg.splitlines()) == 1, msg
    for name in names:
        assert name in msg, (name, msg)


def test_the_uncorrupted_copy_builds(tables):
    index = _build(tables.root)
    _, chain = _chain(tables, TRAIN_SCENE)
    assert list(index["sample_token"]) == [s["token"] for s in chain] and len(chain) == 3


def test_a_cycle_in_the_sample_chain_is_an_error_not_a_hang(tables):
    _, chain = _chain(tables, TRAIN_SCENE)
    _relink(tables, chain[-1]["token"], chain[0]["token"])  # last -> first
    with pytest.raises(ValueError, match="cycle") as e:
        _build(tables.root)
    _assert_one_clear_error(e, TRAIN_SCENE, chain[0]["token"])


def test_a_link_into_another_scene_is_an_error(tables):
    _, chain = _chain(tables, TRAIN_SCENE)
    other, other_chain = _chain(tables, "scene-0103")
    _relink(tables, chain[-1]["token"], other_chain[0]["token"])
    with pytest.raises(ValueError, match="belongs to scene") as e:
        _build(tables.root)
    _assert_one_clear_error(e, TRAIN_SCENE, other_chain[0]["token"], other["token"])


def test_more_samples_than_the_scene_says_is_an_error(tables):
    scenes = tables("scene")
    for s in scenes:
        if s["name"] == TRAIN_SCENE:
            s["nbr_samples"] = 2
    tables.save("scene", scenes)
    _, chain = _chain(tables, TRAIN_SCENE)
    with pytest.raises(ValueError, match="nbr_samples=2") as e:
        _build(tables.root)
    _assert_one_clear_error(e, TRAIN_SCENE, chain[2]["token"])


@pytest.mark.parametrize("table", TABLES)
def test_a_duplicated_record_in_any_table_is_an_error(tables, table):
    records = tables(table)
    if table == "sample":  # a sample of the indexed scene: it once dropped that scene's samples silently
        _, chain = _chain(tables, TRAIN_SCENE)
        twin = chain[1]
    elif table == "scene":  # once indexed the scene twice
        twin = next(s for s in records if s["name"] == TRAIN_SCENE)
    else:
        twin = records[0]
    tables.save(table, [*records, dict(twin)])
    with pytest.raises(ValueError, match=f"table {table} .* more than one record") as e:
        _build(tables.root)
    _assert_one_clear_error(e, f"{table}.json", twin["token"])


def test_a_duplicated_token_on_different_records_is_an_error(tables):
    """Not a copied record: two ego poses that differ but share a token (the devkit would keep the last)."""
    poses = tables("ego_pose")
    clash = {**poses[1], "token": poses[0]["token"]}
    tables.save("ego_pose", [*poses, clash])
    with pytest.raises(ValueError, match="table ego_pose") as e:
        _build(tables.root)
    _assert_one_clear_error(e, poses[0]["token"])


@pytest.mark.parametrize(("table", "field", "target"), _LINKS, ids=[f"{t}.{f}" for t, f, _ in _LINKS])
def test_a_dangling_link_names_table_record_and_token(tables, table, field, target):
    records = tables(table)
    record = records[0]
    record[field] = ["deadbeef"] if isinstance(record[field], list) else "deadbeef"
    tables.save(table, records)
    with pytest.raises(ValueError, match=f"{field} names {target} token 'deadbeef'") as e:
        _build(tables.root)
    _assert_one_clear_error(e, f"table {table}", record["token"], f"{table}.json")


def test_a_missing_link_field_is_named(tables):
    scenes = tables("scene")
    del scenes[0]["first_sample_token"]
    tables.save("scene", scenes)
    with pytest.raises(ValueError, match="has no first_sample_token field") as e:
        _build(tables.root)
    _assert_one_clear_error(e, "table scene", scenes[0]["token"])
