"""bev-train's checks of the settings that are otherwise read only when the model is built or trains its first
batch, made on the composed config before the data is indexed. They read the signatures of the modules that take
each key, so this module sits above them all (with the entry points)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig

# Option mappings under model.* that a module passes on as keyword arguments, and what takes them: their keys'
# types are checked against its signature, as a `_target_` node's are against its target's.
MODEL_OPTIONS = {
    "net.camera": ("bev.models.lift.LiftSplat", "bev.models.camera.CameraEncoder"),
    "segmentation": "bev.tasks.segmentation.task.SegmentationTask",
    "net.heads.detection": "bev.tasks.detection.head.CenterHead",
    "net.heads.motion": "bev.tasks.motion.head.MotionHead",
    "net.temporal": "bev.models.temporal.Temporal",
    "occupancy.loss": "bev.tasks.occupancy.loss.OccupancyLoss",
    "motion.loss": "bev.tasks.motion.loss.TemporalLoss",
    "detection.loss": "bev.tasks.detection.loss.DetectionLoss",
    "detection.decoding": "bev.tasks.detection.decode.decode",
}
# Weight-named keys that hold a name as a whole: a mode, pretrained weights, a preset.
NAMED_WEIGHTS = ("model.task_weights", "model.net.camera.weights", "model.occupancy.loss.class_weight")
_WEIGHT_KEY = re.compile(r"(^|_)weights?$")


def check_settings(cfg: DictConfig) -> None:
    """bev-train's checks of what is otherwise read only when the model is built or trains its first batch, made
    on the composed config before the data is indexed; each error names its key and the fix."""
    from omegaconf import OmegaConf

    from bev.data.config import check_training

    data = OmegaConf.select(cfg, "data")
    if data is not None:
        check_training(data)
    check_model(cfg)
    _check_cameras(cfg)
    check_headline(cfg)


def _check_cameras(cfg: DictConfig) -> None:
    """A network with a camera branch reads the items' images: data.cameras=false would leave it none."""
    from omegaconf import OmegaConf

    net = OmegaConf.select(cfg, "model.net")
    # BEVNet: a null camera is no camera branch only beside a LiDAR branch
    has_camera = net is not None and (net.get("camera") is not None or net.get("lidar") is None)
    if OmegaConf.select(cfg, "data.cameras", default=True) is False and has_camera:
        raise ValueError(
            "data.cameras=false leaves the items without images, and the network has a camera branch: set "
            "data.cameras=true (or model.net.camera=null with a LiDAR branch, a LiDAR-only network)"
        )


def check_headline(cfg: DictConfig) -> None:
    """headline: a val/ metric of one of the model's tasks (bev.tasks): its own headline, or another val/ key."""
    from bev.tasks import TASKS

    head, model = cfg.get("headline"), cfg.get("model") or {}
    tasks = list(model.get("tasks") or ["segmentation"])
    if not isinstance(head, str) or not head.startswith("val/"):
        raise ValueError(f"headline={head!r} must be a val/ metric, e.g. {TASKS[tasks[0]].headline}")
    occupancy_metric = head.startswith("val/occ_")
    if occupancy_metric != (tasks == ["occupancy"]):
        raise ValueError(
            f"headline={head} is not a metric of this model's tasks {tasks}: e.g. headline={TASKS[tasks[0]].headline}"
        )


def check_model(cfg: DictConfig) -> None:
    """model.*: every number finite; weights (keys named *weight, *_weights and what they hold) numbers >= 0;
    booleans, numbers and whole numbers where the module that reads a key declares one (its signature); the
    per-class weights, the losses and the network's input size as the modules will check them."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, "model")
    if node is None:
        return
    model = OmegaConf.to_container(node, resolve=True)
    _check_moved(model)
    _check_values(model, "model")
    _check_arguments(model, "model")
    for path, targets in MODEL_OPTIONS.items():
        options = _select(model, path)
        for target in (targets,) if isinstance(targets, str) else targets:
            if isinstance(options, Mapping):
                _check_keys(options, f"model.{path}", _locate(target))
    decoder = _select(model, "net.decoder")
    if isinstance(decoder, Mapping):
        kind = "VoxelDecoder3d" if decoder.get("kind") == "voxel3d" else "BevDecoder"
        _check_keys(decoder, "model.net.decoder", _locate(f"bev.models.decoder.{kind}"))
    _check_per_class(model)
    _build_losses(model)
    _check_image_size(model, OmegaConf.select(cfg, "data.final_dim"))


def _check_moved(model: Mapping) -> None:
    """A segmentation setting given at the top of model.* (its place before model.segmentation): say where it went."""
    from bev.utils.legacy import moved_segmentation_key

    key = moved_segmentation_key(model)
    if key and "BEVLitModule" in str(model.get("_target_")):
        raise ValueError(
            f"model.{key} is now model.segmentation.{key} (each task's settings sit under model.<task>): "
            f"write model.segmentation.{key}=... instead"
        )


def _check_values(value: Any, path: str, weight: bool = False) -> None:
    """Finite numbers everywhere; under a weight key, numbers >= 0 (a name only where NAMED_WEIGHTS allows)."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not str(k).startswith("_"):
                _check_values(v, f"{path}.{k}", weight or bool(_WEIGHT_KEY.search(str(k))))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_values(v, f"{path}[{i}]", weight)
    elif isinstance(value, float) and not math.isfinite(value):
        why = f" (a {value} weight trains on NaN losses to the end)" if weight else ""
        raise ValueError(f"{path}={value} is not a finite number: pass a finite one{why}")
    elif weight and value is not None:
        _check_weight(value, path)


def _check_weight(value: Any, path: str) -> None:
    if isinstance(value, str) and path in NAMED_WEIGHTS:
        return  # the module checks the name
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{path}={value!r} is not a number: a weight is a finite number >= 0")
    if value < 0:
        raise ValueError(f"{path}={value}: a weight must be >= 0 (a negative one maximises its loss)")


def _check_arguments(value: Any, path: str) -> None:
    """Each `_target_` node's keys against its target's signature, all the way down."""
    if not isinstance(value, Mapping):
        return
    target = value.get("_target_")
    if isinstance(target, str):
        fn = _locate(target)
        if fn is not None:
            _check_keys(value, path, fn)
    for k, v in value.items():
        _check_arguments(v, f"{path}.{k}")


def _check_keys(options: Mapping, path: str, fn) -> None:
    """Refuse a value of the wrong kind for a parameter of `fn` declared bool, float or int (null is left to the
    module: a default, or filled in, as a scheduler's total_steps)."""
    wants = _parameter_kinds(fn) if fn is not None else {}
    for k, v in options.items():
        if k not in wants or v is None:
            continue
        kind = wants[k]
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if kind == "flag" and not isinstance(v, bool):
            raise ValueError(f"{path}.{k}={v!r} must be true or false")
        if kind == "number" and not number:
            raise ValueError(f"{path}.{k}={v!r} must be a number")
        if kind == "whole" and not (number and isinstance(v, int)):
            raise ValueError(f"{path}.{k}={v!r} must be a whole number")


# A parameter's declared type (without None) -> what a config value for it must be.
_KINDS = {
    frozenset({"bool"}): "flag",
    frozenset({"float"}): "number",
    frozenset({"float", "int"}): "number",
    frozenset({"int"}): "whole",
}


def _parameter_kinds(fn) -> dict[str, str]:
    """{parameter: flag | number | whole} of fn's parameters declared bool, float or int (optional or not)."""
    kinds = {}
    for name, p in _parameters(fn).items():
        kind = _KINDS.get(frozenset(_annotation_types(p.annotation) - {"None"}))
        if kind:
            kinds[name] = kind
    return kinds


def _parameters(fn) -> dict:
    """fn's keyword parameters: a class's __init__'s, and its bases' where it passes **kwargs on."""
    import inspect

    funcs = [c.__init__ for c in fn.__mro__ if "__init__" in vars(c)] if isinstance(fn, type) else [fn]
    out: dict = {}
    for f in funcs:
        try:
            params = inspect.signature(f).parameters
        except (TypeError, ValueError):
            break
        for name, p in params.items():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                out.setdefault(name, p)
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    return out


def _annotation_types(annotation: Any) -> set[str]:
    """The type names of an annotation (a type, a union, or its text): {"bool", "None"} for `bool | None`."""
    if isinstance(annotation, type):
        return {annotation.__name__}
    text = str(annotation).replace("typing.", "").replace(" ", "")
    if text.startswith("Optional[") and text.endswith("]"):
        text = text[len("Optional[") : -1] + "|None"
    elif text.startswith("Union[") and text.endswith("]"):
        text = text[len("Union[") : -1].replace(",", "|")
    return {t.removeprefix("<class'").removesuffix("'>").replace("NoneType", "None") for t in text.split("|")}


def _locate(path: str):
    """The object at a dotted path module.name, or None where it cannot be imported (Hydra reports that later)."""
    import importlib

    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:
        return None


def _select(tree: Mapping, path: str) -> Any:
    for k in path.split("."):
        if not isinstance(tree, Mapping):
            return None
        tree = tree.get(k)
    return tree


def _check_per_class(model: Mapping) -> None:
    """model.segmentation.pos_weight and class_weight against the segmentation channels."""
    from bev.tasks.segmentation.loss import per_class_weights

    seg = model.get("segmentation")
    if "segmentation" not in (model.get("tasks") or ["segmentation"]) or not isinstance(seg, Mapping):
        return
    names = seg.get("object_classes")
    if not isinstance(names, list):
        return  # channels named by the network alone
    names = tuple(str(n) for n in names + list(seg.get("map_classes") or []))
    for key in ("pos_weight", "class_weight"):
        if seg.get(key) is not None:  # numbers, checked by _check_values
            try:
                per_class_weights(seg[key], names, f"model.segmentation.{key}")
            except (TypeError, ValueError) as e:
                raise ValueError(_named(f"model.segmentation.{key}", e)) from None


def _build_losses(model: Mapping) -> None:
    """Build the tasks' losses now (cheap, no data): their own checks name model.occupancy.loss.*,
    model.motion.loss.*, model.detection.loss.* before the data is indexed."""
    tasks = model.get("tasks") or ()
    builds = []
    for task, build in _LOSS_BUILDERS.items():
        options = model.get(task)
        if task in tasks and isinstance(options, Mapping):
            builds.append((f"model.{task}.loss", build(), options.get("loss")))
    for key, build, options in builds:
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"{key}={options!r} must be a mapping of its options")
        try:
            build(dict(options or {}))
        except (TypeError, ValueError) as e:
            raise ValueError(_named(key, e)) from None


def _occupancy_loss():
    from bev.tasks.occupancy.loss import OccupancyLoss, check_loss_options

    return lambda o: OccupancyLoss(**check_loss_options(o))


def _motion_loss():
    from bev.tasks.motion.loss import TemporalLoss

    return lambda o: TemporalLoss(**o)


def _detection_loss():
    from bev.tasks.detection.loss import DetectionLoss

    return lambda o: DetectionLoss(**o)


_LOSS_BUILDERS = {"occupancy": _occupancy_loss, "motion": _motion_loss, "detection": _detection_loss}


def _named(key: str, error: Exception) -> str:
    """An error's first line, prefixed with the key it is about unless it names a model.* key already."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return text if "model." in text else f"{key}: {text}"


def _check_image_size(model: Mapping, final_dim: Any) -> None:
    """The network's input size is the data's (a different one fails at the first step) and a multiple of the
    camera encoder's stride (else it fails when the model is built, after the data is indexed)."""
    net = model.get("net")
    size = net.get("image_size") if isinstance(net, Mapping) else None
    if not _whole_pair(size):
        return  # none, or one the network refuses itself
    size = [int(s) for s in size]
    final = [int(s) for s in final_dim] if _whole_pair(final_dim) else None
    if final is not None and size != final:
        raise ValueError(
            f"model.net.image_size={size} differs from data.final_dim={final}: the network takes the data's images. "
            f"Leave model.net.image_size to follow data.final_dim (its default), or pass data.final_dim={size}"
        )
    camera = net.get("camera")
    stride = camera.get("downsample") if isinstance(camera, Mapping) else None
    if isinstance(stride, int) and not isinstance(stride, bool) and stride > 0 and any(s % stride for s in size):
        key = "data.final_dim" if final is not None else "model.net.image_size"
        fit = [max(stride, round(s / stride) * stride) for s in size]
        raise ValueError(
            f"{key}={size} is not a multiple of model.net.camera.downsample={stride} (the camera encoder's stride) in "
            f"height and width: pass e.g. {key}={fit}"
        )


def _whole_pair(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) == 2
        and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in value)
    )
