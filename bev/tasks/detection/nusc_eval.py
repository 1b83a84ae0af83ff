"""Scoring 3D boxes with the nuScenes devkit's DetectionEval (config detection_cvpr_2019).

`to_results` turns ego-frame boxes (bev.geometry.BOX_FIELDS, in the ego frame of each sample's LIDAR_TOP)
into the devkit's result boxes in the global frame; `write_results` writes a results file the devkit
accepts (every sample of the split, nothing else, known classes, at most 500 boxes per sample);
`evaluate` runs DetectionEval and returns flat metrics; `format_table` prints them as the devkit does.
With `ranges` it adds the mAP per band of distance from the ego (range_aps): the devkit's accumulate and calc_ap on
the ground truth and the predictions whose centres lie in the band, both filtered alike after its class ranges.

Splits: the devkit's own (train, val, mini_train, mini_val, ...) where the dataset's version and scene
names fit them, and custom splits from `<dataroot>/<version>/splits.json` ({"name": [scene names]}) for a
dataset with its own scene names. Custom splits need nuscenes-devkit >= 1.2.0 (PR #1046,
`nuscenes.utils.splits.get_scenes_of_custom_split`, DetectionEval's custom-split branch); 1.1.x only
knows the predefined splits. A splits.json name that is also a devkit split name is refused: the
devkit would silently use its own scene list.

A results set without a single box (a model early in training) is scored here as the devkit scores
missing detections (mAP 0, NDS 0, every TP error 1) without calling it: DetectionEval cannot load it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bev.classes import DETECTION_CLASSES
from bev.geometry import BOX_FIELDS, MAX_BOXES, quaternion_to_matrix, yaw_to_quaternion
from bev.utils.io import atomic_write

DETECTION_CONFIG = "detection_cvpr_2019"
# The order in which the devkit lists the classes (detection_cvpr_2019's class_range; its DETECTION_NAMES).
DEVKIT_CLASS_ORDER = (
    "car",
    "truck",
    "bus",
    "trailer",
    "construction_vehicle",
    "pedestrian",
    "motorcycle",
    "bicycle",
    "traffic_cone",
    "barrier",
)
MOVING_SPEED = 0.2  # m/s: faster is moving / with rider (BEVFusion's rule)
# The detection task's rule: at inference at most 0.5 s of past sensor data, one key frame before the present.
KEY_FRAME_SECONDS = 0.5  # nuScenes key frames are 2 Hz
MAX_PAST_KEY_FRAMES = 1
RESULTS_FILE = "results_nusc.json"
SUMMARY_FILE = "metrics_summary.json"  # the devkit's summary, written beside the results
PLOTS_DIR = "plots"  # made by the devkit's DetectionEval beside the results
CAMERA_META = {"use_camera": True, "use_lidar": False, "use_radar": False, "use_map": False, "use_external": False}
# TP error names of the devkit -> the mean's name it prints.
TP_ERRORS = {"trans_err": "mATE", "scale_err": "mASE", "orient_err": "mAOE", "vel_err": "mAVE", "attr_err": "mAAE"}
# TP errors the devkit does not score for a class (NaN in its metrics).
UNSCORED = {"traffic_cone": ("orient_err", "vel_err", "attr_err"), "barrier": ("vel_err", "attr_err")}
# Bands of distance from the ego (m) bev-eval scores apart, as segmentation's and occupancy's
RANGES = ((0.0, 20.0), (20.0, 35.0), (35.0, 50.0))

_VEHICLES = ("car", "truck", "construction_vehicle", "bus", "trailer")
_CYCLES = ("motorcycle", "bicycle")
# class -> (attribute when moving, attribute when still); '' for classes without attributes.
ATTRIBUTE_RULE: dict[str, tuple[str, str]] = {
    **{c: ("vehicle.moving", "vehicle.parked") for c in _VEHICLES},
    "bus": ("vehicle.moving", "vehicle.stopped"),  # mmdet3d's rule: a still bus is at a stop, not parked
    **{c: ("cycle.with_rider", "cycle.without_rider") for c in _CYCLES},
    "pedestrian": ("pedestrian.moving", "pedestrian.standing"),
    "barrier": ("", ""),
    "traffic_cone": ("", ""),
}


def attribute_name(detection_name: str, speed: float) -> str:
    """The attribute the devkit scores, from the class and the speed (m/s), as mmdet3d's nuScenes dataset
    assigns it (BEVDet, BEVFusion)."""
    moving, still = ATTRIBUTE_RULE[detection_name]
    return moving if speed > MOVING_SPEED else still


def _quaternion_multiply(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Hamilton product a * b of (w, x, y, z) quaternions: the rotation b, then a."""
    aw, ax, ay, az = a
    bw, bx, by, bz = b
    return [
        aw * bw - ax * bx - ay * by - az * bz,
        aw * bx + ax * bw + ay * bz - az * by,
        aw * by - ax * bz + ay * bw + az * bx,
        aw * bz + ax * by - ay * bx + az * bw,
    ]


def _sample_boxes(token: str, boxes, scores, labels, ego_rotation, ego_translation) -> list[dict]:
    """One sample's ego-frame boxes -> its devkit result boxes (global frame), the top-scored 500."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, len(BOX_FIELDS))
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    labels = np.asarray(labels).reshape(-1)
    if not len(boxes) == len(scores) == len(labels):
        raise ValueError(
            f"sample {token}: {len(boxes)} boxes, {len(scores)} scores and {len(labels)} labels: give one score and "
            f"one label per box"
        )
    if not (np.isfinite(boxes).all() and np.isfinite(scores).all()):
        raise ValueError(f"sample {token}: boxes or scores hold NaN or inf: the devkit scores finite boxes only")
    if (boxes[:, 3:6] <= 0).any():
        raise ValueError(f"sample {token}: a box has a size (w, l, h) <= 0: the devkit needs positive sizes")
    if len(labels) and (labels.min() < 0 or labels.max() >= len(DETECTION_CLASSES)):
        raise ValueError(
            f"sample {token}: labels must index DETECTION_CLASSES (0..{len(DETECTION_CLASSES) - 1}), "
            f"got {sorted(set(labels.tolist()))}"
        )
    q_ego = np.asarray(ego_rotation, dtype=np.float64).reshape(4)
    q_ego = q_ego / np.linalg.norm(q_ego)
    rot, trans = quaternion_to_matrix(q_ego), np.asarray(ego_translation, dtype=np.float64).reshape(3)
    keep = np.argsort(-scores, kind="stable")[:MAX_BOXES]
    centres = boxes[keep, :3] @ rot.T + trans
    velocities = np.concatenate([boxes[keep, 7:9], np.zeros((len(keep), 1))], axis=1) @ rot.T
    out = []
    for i, k in enumerate(keep):
        x, y, z, w, l, h, yaw, vx, vy = boxes[k]
        name = DETECTION_CLASSES[int(labels[k])]
        out.append(
            {
                "sample_token": token,
                "translation": centres[i].tolist(),
                "size": [w, l, h],
                "rotation": _quaternion_multiply(q_ego, yaw_to_quaternion(yaw)),
                "velocity": velocities[i, :2].tolist(),
                "detection_name": name,
                "detection_score": float(scores[k]),
                "attribute_name": attribute_name(name, math.hypot(vx, vy)),
            }
        )
    return out


def to_results(
    sample_tokens: Sequence[str],
    boxes: Sequence,
    scores: Sequence,
    labels: Sequence,
    ego_rotations: Sequence,
    ego_translations: Sequence,
) -> dict[str, list[dict]]:
    """Per sample: boxes (K, 9) as BOX_FIELDS in the ego frame of its LIDAR_TOP, scores (K,), labels (K,)
    into DETECTION_CLASSES, and that ego pose (rotation (w, x, y, z), translation (3,)) -> {token: [devkit
    result box, ...]} in the global frame, the 500 best-scored boxes of each sample (an empty list if none)."""
    columns = (boxes, scores, labels, ego_rotations, ego_translations)
    if any(len(c) != len(sample_tokens) for c in columns):
        raise ValueError(
            f"to_results takes one entry per sample: {len(sample_tokens)} tokens but "
            f"{[len(c) for c in columns]} boxes / scores / labels / ego_rotations / ego_translations"
        )
    if len(set(sample_tokens)) != len(sample_tokens):
        raise ValueError("to_results: a sample token is given twice: give each sample's boxes once")
    return {
        str(t): _sample_boxes(str(t), *(np.asarray(_numpy(c[i])) for c in columns)) for i, t in enumerate(sample_tokens)
    }


def _numpy(x: Any) -> Any:
    """A torch tensor (any device) -> numpy; anything else as it is (no torch import here)."""
    return x.detach().cpu().numpy() if hasattr(x, "detach") else x


def _check_results(
    results: Mapping[str, Sequence[Mapping]], split_tokens: Sequence[str], split: str = "", source: str = ""
) -> int:
    """Refuse what the devkit would refuse (or score wrongly), every field of every box; returns the number of
    boxes. `source` ("results file <path>: ") starts the messages."""
    if not isinstance(results, Mapping):
        raise ValueError(
            f"{source}results must be a mapping {{sample_token: [box, ...]}}, got {type(results).__name__}"
        )
    where = f"the split {split!r}" if split else "the split"
    wanted, given = set(split_tokens), set(results)
    missing, unknown = sorted(wanted - given), sorted(given - wanted, key=str)
    if missing:
        raise ValueError(
            f"{source}the results miss {len(missing)} of the {len(wanted)} samples of {where} (e.g. {missing[:3]}): the "
            f"devkit needs every sample of the split; give an empty list for a sample without boxes"
        )
    if unknown:
        raise ValueError(
            f"{source}the results hold {len(unknown)} samples that are not in {where} (e.g. {unknown[:3]}): score them on "
            f"the split they belong to, or drop them"
        )
    n = 0
    for token, boxes in results.items():
        if not isinstance(boxes, list):
            raise ValueError(
                f"{source}sample {token}: its boxes must be a list of box objects, got {type(boxes).__name__} "
                f"({_shown(boxes)}); give an empty list for a sample without boxes"
            )
        if len(boxes) > MAX_BOXES:
            raise ValueError(
                f"{source}sample {token} has {len(boxes)} boxes: the devkit takes at most {MAX_BOXES} per "
                f"sample; keep the best-scored (to_results does)"
            )
        for i, box in enumerate(boxes):
            _check_box(box, token, i, source)
        n += len(boxes)
    return n


# --- the fields of a result box: each checked before the devkit sees it (its asserts vanish under python -O) ---

REQUIRED_FIELDS = (
    "sample_token",
    "translation",
    "size",
    "rotation",
    "velocity",
    "detection_name",
    "detection_score",
    "attribute_name",
)
MAX_ABS_TRANSLATION = 1e7  # m: global coordinates (nuScenes maps are a few km; UTM-like frames stay below this)
MAX_SIZE = 1e3  # m: no object is a kilometre long
MAX_SPEED = 1e3  # m/s
# field -> (length, limit of |value|, whether the values must be > 0)
VECTOR_FIELDS = {
    "translation": (3, MAX_ABS_TRANSLATION, False),
    "size": (3, MAX_SIZE, True),
    "rotation": (4, 1e6, False),
    "velocity": (2, MAX_SPEED, False),
    "ego_translation": (3, MAX_ABS_TRANSLATION, False),  # optional: the devkit fills it in
}


def _shown(value: Any) -> str:
    """A short repr of a value from a results file, for a message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _finite(value: Any) -> bool:
    """A real number (not a bool, not a string) that float() keeps finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int too big for a float
        return False


def _vector_rule(value: Any, length: int, limit: float, positive: bool) -> str | None:
    """Why `value` is not a list of `length` finite numbers within +-limit (and > 0), or None."""
    if not isinstance(value, list) or len(value) != length:
        return f"must be a list of {length} numbers"
    if not all(_finite(v) for v in value):
        return "must hold finite numbers (no NaN, inf, strings or null)"
    if any(abs(float(v)) > limit for v in value):
        return f"must stay within +-{limit:g}"
    if positive and any(float(v) <= 0 for v in value):
        return "must be > 0 (width, length, height in m)"
    return None


@functools.cache
def _attribute_names() -> tuple[str, ...]:
    from nuscenes.eval.detection.constants import ATTRIBUTE_NAMES

    return tuple(ATTRIBUTE_NAMES)


def _box_rule(box: Any) -> tuple[str, str] | None:
    """(field, rule it breaks) for the first bad field of a result box, or None."""
    if not isinstance(box, Mapping):
        return "the box", f"must be an object {{field: value}}, got {type(box).__name__}"
    missing = [f for f in REQUIRED_FIELDS if f not in box]
    if missing:
        return missing[0], f"is missing (a box has {', '.join(REQUIRED_FIELDS)})"
    for field, spec in VECTOR_FIELDS.items():
        rule = _vector_rule(box[field], *spec) if field in box else None
        if rule:
            return field, rule
    if math.hypot(*map(float, box["rotation"])) < 1e-6:
        return "rotation", "must be a unit quaternion (w, x, y, z), not zero"
    if box["detection_name"] not in DETECTION_CLASSES:
        return "detection_name", f"is an unknown class name; the devkit scores {', '.join(DETECTION_CLASSES)}"
    if not _finite(box["detection_score"]):
        return "detection_score", "must be a finite number"
    if box["attribute_name"] != "" and box["attribute_name"] not in _attribute_names():
        return "attribute_name", f"is an unknown attribute; the devkit knows '' and {', '.join(_attribute_names())}"
    if "num_pts" in box and not (isinstance(box["num_pts"], int) and not isinstance(box["num_pts"], bool)):
        return "num_pts", "must be a whole number when given"
    return None


def _check_box(box: Any, token: str, i: int, source: str = "") -> None:
    """One ValueError naming the sample, the box index, the field and the rule for a bad result box."""
    found = _box_rule(box)
    if found is None:
        if box["sample_token"] != token:
            raise ValueError(f"{source}a box listed under sample {token} names sample {_shown(box['sample_token'])}")
        return
    field, rule = found
    value = box.get(field) if isinstance(box, Mapping) else box
    unknown_class = field == "detection_name"
    got = f"unknown class name {_shown(value)}" if unknown_class else f"got {_shown(value)}"
    raise ValueError(f"{source}sample {token}, box {i}: {field} {rule} ({got})")


def _check_meta(meta: Mapping[str, Any], source: str = "") -> dict[str, bool]:
    if not isinstance(meta, Mapping) or set(meta) != set(CAMERA_META):
        keys = sorted(meta, key=str) if isinstance(meta, Mapping) else type(meta).__name__
        raise ValueError(
            f"{source}results meta must have exactly the keys {sorted(CAMERA_META)} (booleans), got {_shown(keys)}"
        )
    return {k: bool(meta[k]) for k in CAMERA_META}


def write_results(
    path: str | os.PathLike,
    results: Mapping[str, Sequence[Mapping]],
    split_tokens: Sequence[str],
    meta: Mapping[str, Any] | None = None,
) -> Path:
    """Write the devkit's results file {"meta", "results"} atomically; `results` must hold exactly the
    samples of the split (empty lists for samples without boxes) and only DETECTION_CLASSES names."""
    _check_results(results, split_tokens)
    body = {
        "meta": _check_meta(CAMERA_META if meta is None else meta),
        "results": {t: list(results[t]) for t in split_tokens},
    }
    return atomic_write(path, json.dumps(body))


# --- splits ------------------------------------------------------------------------------------------------


def _version_fits(split: str, version: str) -> bool:
    """Whether the devkit's load_gt accepts this predefined split with this dataset version."""
    if split.startswith("mini_"):
        return version.endswith("mini")
    if split == "test":
        return version.endswith("test")
    return version.endswith("trainval")


def dataset_splits(nusc) -> dict[str, list[str]]:
    """The splits this dataset has -> their scene names present in it: the devkit's own splits that fit the
    dataset's version and hold at least one of its scenes, then the custom ones of <version>/splits.json."""
    from nuscenes.utils.splits import create_splits_scenes

    present = {s["name"] for s in nusc.scene}
    predefined = create_splits_scenes()
    splits = {
        name: [s for s in scenes if s in present]
        for name, scenes in predefined.items()
        if _version_fits(name, nusc.version) and present.intersection(scenes)
    }
    custom_file = Path(nusc.dataroot) / nusc.version / "splits.json"
    if custom_file.is_file():
        try:
            custom = json.loads(custom_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{custom_file} is not valid JSON ({e}): it must map split names to scene names") from None
        if not isinstance(custom, dict) or not all(isinstance(v, list) for v in custom.values()):
            raise ValueError(f"{custom_file} must map split names to lists of scene names")
        clash = sorted(set(custom) & set(predefined))
        if clash:
            raise ValueError(
                f"{custom_file} names {clash}, which the devkit reserves for nuScenes' own splits (it would use its "
                f"own scene lists): rename them"
            )
        splits.update({name: [s for s in scenes if s in present] for name, scenes in custom.items()})
    return splits


def split_sample_tokens(nusc, split: str) -> list[str]:
    """Sample tokens of a split of this dataset, in the dataset's order; one clear error for a split it lacks."""
    splits = dataset_splits(nusc)
    if not splits.get(split):
        has = ", ".join(f"{k} ({len(v)} scenes)" for k, v in splits.items() if v) or "none"
        raise ValueError(
            f"eval split {split!r} is not a split of the dataset {nusc.version} at {nusc.dataroot}; it has: {has}. "
            f"For a dataset with its own scene names, list them in {Path(nusc.dataroot) / nusc.version}/splits.json "
            f'as {{"<split>": ["<scene name>", ...]}} (nuscenes-devkit >= 1.2.0)'
        )
    scenes = set(splits[split])
    scene_of = {s["token"]: s["name"] for s in nusc.scene}
    return [s["token"] for s in nusc.sample if scene_of[s["scene_token"]] in scenes]


# --- evaluation --------------------------------------------------------------------------------------------


MAX_RESULTS_BYTES = 2 << 30  # a full trainval results file (6019 samples x 500 boxes) is about 1.2 GB


def _load_results_file(path: Path, max_bytes: int = MAX_RESULTS_BYTES) -> tuple[dict, dict]:
    """The results and meta of a results file, with one clear error for a missing, oversized, binary or
    malformed file (checked before it is read whole)."""
    if path.is_dir():
        raise IsADirectoryError(f"results file {path} is a folder: pass the results JSON file (e.g. {RESULTS_FILE})")
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise FileNotFoundError(f"results file {path} does not exist: write it with write_results") from None
    if size > max_bytes:
        raise ValueError(
            f"results file {path} is {size:,} bytes, over the {max_bytes:,} a results file may take "
            f"(500 boxes for every sample of trainval is about 1.2 GB); pass max_bytes= to evaluate to raise it"
        )
    data = _parse_json(path, path.read_bytes())
    if not isinstance(data, dict) or "results" not in data or "meta" not in data:
        raise ValueError(f'results file {path} must hold {{"meta": {{...}}, "results": {{sample_token: [box, ...]}}}}')
    return data["results"], data["meta"]


def _parse_json(path: Path, raw: bytes) -> Any:
    """JSON from UTF-8 bytes; binary or UTF-16 text, malformed or too deeply nested JSON get one clear error."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        utf16 = raw[:2] in (b"\xff\xfe", b"\xfe\xff")
        kind = "UTF-16 text" if utf16 else "binary (not UTF-8 text)"
        raise ValueError(f"results file {path} is {kind}: the devkit reads UTF-8 JSON; save it as UTF-8") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"results file {path} nests JSON too deeply: a results file is 4 levels deep") from None
    except ValueError as e:  # JSONDecodeError, or an integer of thousands of digits
        raise ValueError(f"results file {path} is not valid JSON ({_shown(str(e))})") from None


def _empty_metrics() -> dict[str, float]:
    """What the devkit gives a results set without a single box: AP 0, every scored TP error 1."""
    out: dict[str, float] = {"mAP": 0.0, "NDS": 0.0, **{m: 1.0 for m in TP_ERRORS.values()}}
    out.update({f"AP/{c}": 0.0 for c in DEVKIT_CLASS_ORDER})
    for c in DEVKIT_CLASS_ORDER:
        out.update({f"{e}/{c}": math.nan if e in UNSCORED.get(c, ()) else 1.0 for e in TP_ERRORS})
    return out


def _flat_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """The devkit's metrics_summary -> {"mAP", "NDS", "mATE".., "AP/<class>", "<tp error>/<class>"}."""
    out = {"mAP": float(summary["mean_ap"]), "NDS": float(summary["nd_score"])}
    out.update({TP_ERRORS[k]: float(v) for k, v in summary["tp_errors"].items()})
    for c, ap in summary["mean_dist_aps"].items():
        out[f"AP/{c}"] = float(ap)
    for c, errors in summary["label_tp_errors"].items():
        out.update({f"{e}/{c}": float(v) for e, v in errors.items()})
    return out


def evaluate(
    results: str | os.PathLike | Mapping,
    dataroot: str | os.PathLike,
    version: str,
    eval_split: str,
    output_dir: str | os.PathLike,
    verbose: bool = False,
    nusc=None,
    max_bytes: int = MAX_RESULTS_BYTES,
    ranges: Sequence[tuple[float, float]] = (),
) -> dict[str, float]:
    """Score a results file (or a {sample_token: [box, ...]} dict, written to output_dir/results_nusc.json
    with camera-only meta) on `eval_split` with DetectionEval; returns {"mAP", "NDS", "mATE", "mASE", "mAOE",
    "mAVE", "mAAE", "AP/<class>" (mean over the distance thresholds), "<tp error>/<class>"} and writes the
    devkit's metrics_summary.json to output_dir. `nusc`: an already loaded NuScenes of that dataroot and
    version (loading trainval takes ~30 s, so a caller scoring often keeps one). ranges: bands (m) whose mAP is
    added, "mAP_<lo>-<hi>m" (over the classes with ground truth there) and "AP_<lo>-<hi>m/<class>" (range_aps)."""
    from nuscenes import NuScenes

    if nusc is None:
        nusc = NuScenes(version=version, dataroot=str(dataroot), verbose=verbose)
    tokens = split_sample_tokens(nusc, eval_split)
    output_dir = Path(output_dir)
    if isinstance(results, Mapping):
        path = write_results(output_dir / RESULTS_FILE, results, tokens)
        n_boxes = sum(len(b) for b in results.values())
    else:
        path = Path(results)
        boxes, meta = _load_results_file(path, max_bytes)
        _check_meta(meta, f"results file {path}: ")
        n_boxes = _check_results(boxes, tokens, eval_split, f"results file {path}: ")
    if n_boxes == 0:
        return {**_empty_metrics(), **{f"mAP_{_band_name(b)}": 0.0 for b in ranges}}
    summary, by_range = _run_devkit(nusc, path, eval_split, output_dir, verbose, ranges)
    atomic_write(output_dir / SUMMARY_FILE, json.dumps(summary, indent=2))
    return {**_flat_metrics(summary), **by_range}


def _band_name(band: tuple[float, float]) -> str:
    return f"{band[0]:g}-{band[1]:g}m"


def range_aps(evaluator, ranges: Sequence[tuple[float, float]]) -> dict[str, float]:
    """AP per class and mAP per band of ego distance: the boxes (ground truth and predictions alike, after
    DetectionEval's class ranges) whose centres are in [lo, hi) m, scored by the devkit's accumulate and calc_ap at
    its four distance thresholds. Classes without ground truth in a band are left out of that band's mean."""
    from nuscenes.eval.detection.algo import accumulate, calc_ap

    cfg, out = evaluator.cfg, {}
    for band in ranges:
        gt, pred = (_in_band(boxes, *band) for boxes in (evaluator.gt_boxes, evaluator.pred_boxes))
        present = {b.detection_name for b in gt.all}
        aps = {}
        for c in (c for c in cfg.class_names if c in present):
            curves = [accumulate(gt, pred, c, cfg.dist_fcn_callable, th) for th in cfg.dist_ths]
            aps[c] = float(np.mean([calc_ap(md, cfg.min_recall, cfg.min_precision) for md in curves]))
        name = _band_name(band)
        out[f"mAP_{name}"] = float(np.mean(list(aps.values()))) if aps else math.nan
        out.update({f"AP_{name}/{c}": ap for c, ap in aps.items()})
    return out


def _in_band(boxes, lo: float, hi: float):
    from nuscenes.eval.common.data_classes import EvalBoxes

    out = EvalBoxes()
    for token in boxes.sample_tokens:
        out.add_boxes(token, [b for b in boxes[token] if lo <= b.ego_dist < hi])
    return out


def _run_devkit(
    nusc, path: Path, eval_split: str, output_dir: Path, verbose: bool, ranges: Sequence[tuple[float, float]] = ()
) -> tuple[dict, dict[str, float]]:
    from nuscenes.eval.common.config import config_factory
    from nuscenes.eval.detection.evaluate import DetectionEval

    # Quiet unless verbose: the devkit's loaders draw progress bars on stderr whatever it is told.
    quiet = contextlib.nullcontext() if verbose else contextlib.redirect_stderr(io.StringIO())
    with quiet:
        evaluator = DetectionEval(
            nusc, config_factory(DETECTION_CONFIG), str(path), eval_split, output_dir=str(output_dir), verbose=verbose
        )
        metrics, _ = evaluator.evaluate()  # not main(): its PR-curve plots take longer than the scoring
    return metrics.serialize(), range_aps(evaluator, ranges)


def format_table(metrics: Mapping[str, float]) -> str:
    """mAP, the five mean TP errors, NDS and the per-class table (AP, ATE, ASE, AOE, AVE, AAE), as the devkit
    prints them."""
    lines = [f"mAP: {metrics['mAP']:.4f}"]
    lines += [f"{name}: {metrics[name]:.4f}" for name in TP_ERRORS.values()]
    lines += [f"NDS: {metrics['NDS']:.4f}", "", "Per-class results:"]
    lines.append(f"{'Object Class':<20}\t" + "\t".join(f"{h:<6}" for h in ("AP", "ATE", "ASE", "AOE", "AVE", "AAE")))
    for c in DEVKIT_CLASS_ORDER:
        values = [metrics[f"AP/{c}"]] + [metrics[f"{e}/{c}"] for e in TP_ERRORS]
        lines.append(f"{c:<20}\t" + "\t".join(f"{v:<6.3f}" for v in values))
    bands = [k.removeprefix("mAP_") for k in metrics if k.startswith("mAP_")]
    if bands:
        lines += ["", "mAP by distance from the ego (classes with ground truth in the band):"]
        lines.append("  ".join(f"{b}: {metrics[f'mAP_{b}']:.4f}" for b in bands))
    return "\n".join(lines)
