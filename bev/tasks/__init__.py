"""The tasks a model is trained and scored for, and what each names: its headline metric and what it adds to a
batch. A LightningModule declares its tasks (`model.tasks`); bev-train, bev-eval, bev-predict, bev-export and
bev.load_model ask it, instead of probing the network for heads.

  segmentation  BEV maps of object and HD-map classes: val/iou (the first object class), val/miou_map
  motion        FIERY's present and future instances: val/future_iou_long, val/vpq_long, ...
  detection     3D boxes scored by the nuScenes devkit's DetectionEval: val/NDS, val/mAP, ...
  occupancy     Occ3D's 18 classes per voxel: val/occ_miou (Occ3D's mIoU with the camera mask)

Each task's code (targets, loss, metric, decoding, pictures) is its package here, bev.tasks.<name>.

The experiment's one headline metric (the config's `headline`, a val/ key of one of its tasks) is what the best
checkpoint is chosen by, what sweeps optimise (as <headline>_best) and what bev-train's last line reports.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Task:
    """name: as in model.tasks; headline: its own headline metric (a val/ key); batch_keys: what it trains on."""

    name: str
    headline: str
    batch_keys: tuple[str, ...]


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("segmentation", "val/iou", ("bev", "visibility")),
        Task("motion", "val/future_iou_long", ("segmentation", "instance", "centerness", "offset", "flow")),
        Task("detection", "val/NDS", ("det_heatmap", "det_index", "det_target", "det_mask")),
        Task("occupancy", "val/occ_miou", ("occ_semantics", "occ_mask_camera", "occ_mask_lidar")),
    )
}


def check_tasks(tasks: Sequence[str] | str, allowed: Sequence[str], key: str = "model.tasks") -> tuple[str, ...]:
    """tasks as a tuple of names, each one of `allowed` (what the module can train), at least one; else one line
    naming the key."""
    tasks = tuple(str(t) for t in ([tasks] if isinstance(tasks, str) else tasks))
    unknown = [t for t in tasks if t not in allowed]
    if unknown or not tasks or len(set(tasks)) != len(tasks):
        raise ValueError(f"{key}={list(tasks)}: choose one or more of {list(allowed)}, each once")
    return tasks


def build_head(task: str, in_channels: int, grid, options: Mapping[str, Any] | None):
    """The head of `task` (its package's head.build) on `in_channels` decoder features; model.net.heads.<task>
    holds its options."""
    if task not in TASKS:
        raise ValueError(f"model.net.heads has {task!r}: choose heads among {list(TASKS)}")
    build = importlib.import_module(f"bev.tasks.{task}.head").build
    options = dict(options or {})
    known = _keywords(build)
    unknown = sorted(set(options) - known) if known is not None else []
    if unknown:
        raise ValueError(f"unknown model.net.heads.{task} key(s) {unknown}; known: {', '.join(sorted(known))}")
    return build(in_channels, grid, **options)


def _keywords(fn) -> set[str] | None:
    """The option names `fn` takes after (in_channels, grid), following one **options to the class it builds;
    None when they cannot be told."""
    params = list(inspect.signature(fn).parameters.values())[2:]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        target = inspect.signature(fn).return_annotation
        target = getattr(inspect.getmodule(fn), target, None) if isinstance(target, str) else target
        if not isinstance(target, type):
            return None
        params = list(inspect.signature(target).parameters.values())[1:]
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def task_class(name: str) -> type:
    """The bev.tasks.task.Task subclass of the task `name` (its package's task module): what bev-export and bev-eval
    ask of a task by its head or before a checkpoint is loaded, where no task module is built."""
    from bev.tasks.task import Task as TaskModule

    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: choose among {list(TASKS)}")
    module = importlib.import_module(f"bev.tasks.{name}.task")
    found = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, TaskModule) and c.name == name]
    return found[0]


def task_classes(names: Sequence[str] = tuple(TASKS)) -> list[type]:
    """The Task classes of `names` (default: every task), in TASKS order."""
    return [task_class(t) for t in TASKS if t in names]
