"""Collective helpers for metrics kept outside torchmetrics: one process (rank 0) scores what every
process saw and shares the numbers. Without an initialised process group they are the identity."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when there is none."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(obj: Any) -> list[Any]:
    """Every process's `obj` (picklable), in rank order, on every process."""
    rank, size = world()
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj)
    return out


def on_rank_zero(fn: Callable[[], T]) -> T:
    """fn() run on rank 0 only, its result given to every process. An exception on rank 0 is raised there and
    named on the others (they would otherwise wait forever for a result)."""
    rank, size = world()
    if size == 1:
        return fn()
    box: list[Any] = [None]
    error = None
    if rank == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as e:  # shared before raising, so the other processes stop too
            error, box[0] = e, ("error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    status, value = box[0]
    if status == "error":
        raise RuntimeError(f"rank 0 failed while scoring for every process: {value}")
    return value
