"""bev-make-synthetic's worker processes, and the scenes' worlds they share: each world is built once (in forked
processes when there are several) and kept here, where the render workers forked later inherit it."""

from __future__ import annotations

import functools
import gc
import multiprocessing as mp
import signal
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool

import cv2

from bev.synthetic.roads import road_map
from bev.synthetic.world import World, build_world

_WORLDS: dict[tuple, World] = {}  # (seed, scene, samples, location) -> its world, the last WORLDS_KEPT built
WORLDS_KEPT = 16


def _world(seed: int, scene: int, samples: int, location: str) -> World:
    """build_world, cached: the tables, the renders and the annotations all read the same world."""
    key = (seed, scene, samples, location)
    if key not in _WORLDS:
        _keep_world(key, build_world(*key))
    return _WORLDS[key]


def _keep_world(key: tuple, world: World) -> None:
    _WORLDS[key] = world
    while len(_WORLDS) > WORLDS_KEPT:
        del _WORLDS[next(iter(_WORLDS))]  # the oldest


def _build_worlds(keys: list[tuple], workers: int) -> None:
    """Build the worlds of `keys` (_world) in `workers` forked processes when there are several: a scene's
    world takes 1-2 s of one core, and the tables need them all before the renders start."""
    todo = [k for k in dict.fromkeys(keys) if k not in _WORLDS]
    if workers < 2 or len(todo) < 2 or "fork" not in mp.get_all_start_methods():
        for key in todo:
            _world(*key)
        return
    for seed, location in sorted({(k[0], k[3]) for k in todo}):
        road_map(seed, location)  # once, before the fork: every worker (and the render workers later) shares them
    built = dict(_in_workers(_build_world_task, todo, workers))
    for key in todo:  # in the order asked (the cache keeps the last WORLDS_KEPT)
        built[key].road = road_map(key[0], key[3])
        _keep_world(key, built[key])


def _build_world_task(key: tuple) -> tuple[tuple, World]:
    """A world without its road map, which the parent has: one copy per location, as if built there (a copy per
    world would multiply the objects every forked render worker's garbage collections go through)."""
    world = build_world(*key)
    world.road = None
    return key, world


class WorkerError(RuntimeError):
    """A worker process failed or died: the message says which and what to do."""


def _in_workers(fn, jobs: list, workers: int, initializer=None):
    """fn(job) for every job in `workers` processes (forked: they share what this one built; spawned where fork
    does not exist), each result yielded as it comes, in any order. A job's exception is raised here as soon as it
    comes, and a worker that dies (killed, out of memory) raises WorkerError: the other jobs are cancelled and
    the workers stopped, never waited for."""
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    start = functools.partial(_start_worker, initializer)
    pool = ProcessPoolExecutor(min(workers, len(jobs)), mp_context=ctx, initializer=start)
    done = False
    try:
        for future in as_completed([pool.submit(fn, job) for job in jobs]):
            yield future.result()
        done = True
    except BrokenProcessPool:
        raise WorkerError(
            "a bev-make-synthetic worker process died (killed, or out of memory?); run it again, "
            "with fewer --workers if memory is short"
        ) from None
    finally:
        if not done:  # an error, or the caller stopped early: stop the workers now
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.terminate()
        pool.shutdown(wait=True, cancel_futures=True)


def _start_worker(initializer=None) -> None:
    """A worker leaves Ctrl-C to the parent, which stops it: no traceback per worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if initializer is not None:
        initializer()


def _worker_init() -> None:
    """Set up a render worker process."""
    import torch

    torch.set_num_threads(1)  # one process per core; torch threads would only contend
    cv2.setNumThreads(0)  # the same for OpenCV's resize threads (0: none, the caller's thread only)
    # What the parent built (worlds, tables) stays out of this process's garbage collections: they would go
    # through it all again and again, copying each page they touch from the parent.
    gc.freeze()


MAX_WORKERS = 8  # each render process keeps its own ground tiles (up to ~150 MB)


def default_workers() -> int:
    """The CPUs this process may run on, at most MAX_WORKERS (the command line's default --workers)."""
    from bev.utils.threads import available_cpus

    return max(1, min(available_cpus(), MAX_WORKERS))
