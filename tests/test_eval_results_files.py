"""Hostile nuScenes results files never reach the devkit: bev.tasks.detection.nusc_eval.evaluate (bev-eval's scoring)
checks every field of every box, and the file itself, and refuses with one line naming the sample token, the
box index, the field and the rule (checks, not `assert`s: they hold under `python -O` too)."""

from __future__ import annotations

import json
import math

import pytest

from bev.tasks.detection import nusc_eval
from bev.tasks.detection.nusc_eval import evaluate

VERSION, SPLIT = "v1.0-mini", "mini_val"


@pytest.fixture(scope="module")
def tokens(nusc):
    return nusc_eval.split_sample_tokens(nusc, SPLIT)


@pytest.fixture(autouse=True)
def no_devkit(monkeypatch):
    """Every case here is refused before the devkit is called."""

    def refuse(*args, **kwargs):
        raise AssertionError("the devkit was called")

    monkeypatch.setattr(nusc_eval, "_run_devkit", refuse)


def _box(token: str, **changes) -> dict:
    box = {
        "sample_token": token,
        "translation": [600.0, 1600.0, 1.0],
        "size": [1.9, 4.5, 1.6],
        "rotation": [1.0, 0.0, 0.0, 0.0],
        "velocity": [1.0, 0.5],
        "detection_name": "car",
        "detection_score": 0.5,
        "attribute_name": "vehicle.moving",
    }
    box.update(changes)
    return {k: v for k, v in box.items() if v is not DROP}


DROP = object()
BAD_FIELDS = {  # name -> (changes to a good box, the field named, words of the rule)
    "nan_translation": ({"translation": [math.nan, 0.0, 0.0]}, "translation", "finite"),
    "inf_translation": ({"translation": [math.inf, 0.0, 0.0]}, "translation", "finite"),
    "huge_translation": ({"translation": [1e30, 0.0, 0.0]}, "translation", "within"),
    "huge_int_translation": ({"translation": [10**400, 0, 0]}, "translation", "finite"),
    "string_translation": ({"translation": ["1", 0.0, 0.0]}, "translation", "finite"),
    "zero_size": ({"size": [0.0, 4.5, 1.6]}, "size", "> 0"),
    "negative_size": ({"size": [1.0, -4.5, 1.6]}, "size", "> 0"),
    "short_size": ({"size": [1.9, 4.5]}, "size", "list of 3"),
    "huge_size": ({"size": [1e30, 4.5, 1.6]}, "size", "within"),
    "nan_size": ({"size": [math.nan, 4.5, 1.6]}, "size", "finite"),
    "zero_quaternion": ({"rotation": [0.0, 0.0, 0.0, 0.0]}, "rotation", "not zero"),
    "rotation_of_3": ({"rotation": [1.0, 0.0, 0.0]}, "rotation", "list of 4"),
    "inf_velocity": ({"velocity": [math.inf, 0.0]}, "velocity", "finite"),
    "huge_velocity": ({"velocity": [1e30, 0.0]}, "velocity", "within"),
    "velocity_of_3": ({"velocity": [1.0, 0.0, 0.0]}, "velocity", "list of 2"),
    "unknown_attribute": ({"attribute_name": "vehicle.flying"}, "attribute_name", "unknown attribute"),
    "unknown_class": ({"detection_name": "van"}, "detection_name", "unknown class name 'van'"),
    "nan_score": ({"detection_score": math.nan}, "detection_score", "finite"),
    "string_score": ({"detection_score": "0.5"}, "detection_score", "finite"),
    "bool_score": ({"detection_score": True}, "detection_score", "finite"),
    "missing_size": ({"size": DROP}, "size", "is missing"),
    "missing_attribute": ({"attribute_name": DROP}, "attribute_name", "is missing"),
    "bad_ego_translation": ({"ego_translation": [0.0, math.nan, 0.0]}, "ego_translation", "finite"),
}


def _results(tokens, boxes_of_first) -> dict:
    return {t: (boxes_of_first if i == 0 else []) for i, t in enumerate(tokens)}


def _one_line(e: pytest.ExceptionInfo, *words: str) -> str:
    msg = str(e.value)
    assert len(msg.splitlines()) == 1, msg
    for w in words:
        assert w in msg, msg
    return msg


@pytest.mark.parametrize("case", list(BAD_FIELDS))
def test_a_bad_box_field_is_refused_naming_the_sample_box_field_and_rule(case, tokens, nusc, synthetic_root, tmp_path):
    changes, field, rule = BAD_FIELDS[case]
    boxes = [_box(tokens[0]), _box(tokens[0], **changes)]  # the second box is the bad one
    with pytest.raises(ValueError) as e:
        evaluate(_results(tokens, boxes), synthetic_root, VERSION, SPLIT, tmp_path, nusc=nusc)
    _one_line(e, f"sample {tokens[0]}, box 1: {field}", rule)
    assert not (tmp_path / nusc_eval.RESULTS_FILE).exists()
    if case == "huge_int_translation":
        return  # JSON cannot carry it as a float anyway
    path = tmp_path / "theirs.json"  # the same box in a results file someone else wrote
    path.write_text(json.dumps({"meta": nusc_eval.CAMERA_META, "results": _results(tokens, boxes)}))
    with pytest.raises(ValueError) as e:
        evaluate(path, synthetic_root, VERSION, SPLIT, tmp_path, nusc=nusc)
    _one_line(e, f"results file {path}: sample {tokens[0]}, box 1: {field}", rule)


@pytest.mark.parametrize(
    "boxes, words",
    [
        ({"0": _box("x")}, "its boxes must be a list of box objects, got dict"),
        (3, "its boxes must be a list of box objects, got int"),
        ("boxes", "its boxes must be a list of box objects, got str"),
        ([[600.0, 1600.0, 1.0]], "box 0: the box must be an object"),
        ([None], "box 0: the box must be an object"),
    ],
)
def test_boxes_of_the_wrong_form_are_refused(boxes, words, tokens, nusc, synthetic_root, tmp_path):
    path = tmp_path / "theirs.json"
    path.write_text(json.dumps({"meta": nusc_eval.CAMERA_META, "results": _results(tokens, boxes)}))
    with pytest.raises(ValueError) as e:
        evaluate(path, synthetic_root, VERSION, SPLIT, tmp_path, nusc=nusc)
    _one_line(e, f"sample {tokens[0]}", words)


def test_a_box_under_another_sample_is_refused(tokens, nusc, synthetic_root, tmp_path):
    with pytest.raises(ValueError) as e:
        evaluate(_results(tokens, [_box(tokens[1])]), synthetic_root, VERSION, SPLIT, tmp_path, nusc=nusc)
    _one_line(e, f"listed under sample {tokens[0]} names sample '{tokens[1]}'")


def _write(path, kind: str):
    body = json.dumps({"meta": nusc_eval.CAMERA_META, "results": {}})
    if kind == "binary":
        path.write_bytes(b"\x80\x81\xfe" + bytes(range(256)))
    elif kind == "utf16":
        path.write_bytes(body.encode("utf-16"))
    elif kind == "folder":
        path.mkdir()
    elif kind == "deep":
        path.write_text("[" * 200_000 + "]" * 200_000)
    elif kind == "not_json":
        path.write_text("{meta: 1")
    elif kind == "huge_int":
        path.write_text('{"meta": {}, "results": ' + "9" * 10_000 + "}")
    return path


@pytest.mark.parametrize(
    "kind, words",
    [
        ("binary", "binary (not UTF-8 text)"),
        ("utf16", "UTF-16 text"),
        ("folder", "is a folder"),
        ("deep", "nests JSON too deeply"),
        ("not_json", "is not valid JSON"),
        ("huge_int", "is not valid JSON"),
    ],
)
def test_a_file_that_is_not_a_results_file_gets_one_clear_error(kind, words, nusc, synthetic_root, tmp_path):
    path = _write(tmp_path / "theirs.json", kind)
    with pytest.raises((ValueError, OSError)) as e:
        evaluate(path, synthetic_root, VERSION, SPLIT, tmp_path, nusc=nusc)
    _one_line(e, str(path), words)


def test_the_file_size_is_capped_before_reading(tokens, nusc, synthetic_root, tmp_path, monkeypatch):
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"meta": nusc_eval.CAMERA_META, "results": _results(tokens, [_box(tokens[0])])}))
    monkeypatch.setattr(type(path), "read_bytes", lambda self: pytest.fail("read despite the cap"))
    with pytest.raises(ValueError) as e:
        evaluate(path, synthetic_root, VERSION, SPLIT, tmp_path, nusc=nusc, max_bytes=100)
    _one_line(e, str(path), f"{path.stat().st_size:,} bytes, over the 100", "max_bytes=")
