"""Shared fixtures."""

from __future__ import annotations

import functools
import gc
import inspect
import os
import re
from pathlib import Path

import pytest


def _hypothesis_profiles() -> None:
    """`make test` draws the same examples each run (a red CI names a change, not a lucky draw);
    BEV_HYPOTHESIS=explore draws new ones each run, to look for what the fixed draw misses."""
    from hypothesis import settings

    settings.register_profile("fixed", derandomize=True)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("BEV_HYPOTHESIS", "fixed"))


_hypothesis_profiles()


def pytest_configure(config):
    """Set up each process that runs tests. The pytest-xdist controller (make test: -n auto) runs none
    and imports neither torch nor Lightning (seconds each)."""
    if getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput"):
        return
    # Lightning gives its logger a StreamHandler on sys.stderr when first imported. Imported first
    # inside a capsys test, that handler would keep the test's stream, closed afterwards, and every
    # later Lightning log line would print a "Logging error" traceback into other tests' stderr.
    # The cyclic garbage collector is paused while these imports make their million objects, which are
    # then frozen out of its reach: the collections the tests trigger skip them.
    gc.disable()
    import lightning.pytorch  # noqa: F401
    import torch

    import bev.data  # noqa: F401 (registers the data/ config schemas every composed config names)

    gc.freeze()
    gc.enable()

    # Under pytest-xdist the workers share the CPUs: each takes its share of intra-op threads instead
    # of all of them, so that two workers on two cores do not oversubscribe.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


def pytest_unconfigure(config):
    """Skip the interpreter's last full collection of everything imported (seconds per process)."""
    gc.freeze()


def _once_per_run(tmp_path_factory, name: str, make) -> Path:
    """make(folder) -> path, run once per test run: under pytest-xdist the first worker to ask makes it
    under a file lock in the run's shared temporary folder, and the others wait for it and reuse it."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return make(tmp_path_factory.mktemp(name))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # the workers' base folders sit side by side in it
    done = shared / f"{name}.done"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            folder = shared / name
            folder.mkdir()
            done.write_text(str(make(folder)))
    return Path(done.read_text())


@pytest.fixture(scope="session")
def synthetic_root(tmp_path_factory) -> Path:
    """A small synthetic nuScenes-format dataroot, written once per test run.

    2 scenes x 3 key frames, seed 0, ray-cast at 400x225 (tests/helpers/synthetic.py): scene-0061 (mini_train)
    and scene-0103 (mini_val).
    Load it with NuScenes("v1.0-mini", dataroot=synthetic_root). Treat it as read-only.
    """
    from bev.synthetic.writer import make_synthetic
    from helpers.synthetic import RENDER_SCALE, SAMPLES, SCENES, SEED

    def make(folder: Path) -> Path:
        return make_synthetic(
            folder / "nuscenes",
            scenes=SCENES,
            samples_per_scene=SAMPLES,
            seed=SEED,
            render_scale=RENDER_SCALE,
            progress=False,
        )

    return _once_per_run(tmp_path_factory, "synthetic", make)


@pytest.fixture(scope="session")
def tiny_run(synthetic_root, tmp_path_factory) -> Path:
    """A 1-step bev-train run of the tiny model (1 epoch of one batch of 2, a picture every step) on
    `synthetic_root`: checkpoints epoch_000.ckpt and last.ckpt, metrics, logs and pictures.

    Shared by the tests of what a trained run serves (load_model, bev-predict, bev-export): read-only.
    Tests that use it run an entry point: mark them `e2e`.
    """
    import json

    from helpers.cli import TINY, train_cli

    def train(run: Path) -> Path:
        mp = pytest.MonkeyPatch()
        try:
            args = [
                *TINY,
                "callbacks.bev_png.every_n_steps=1",
                f"data.dataroot={synthetic_root}",
                f"hydra.run.dir={run}",
            ]
            assert train_cli(args, mp) == 0
        finally:
            mp.undo()
        assert json.loads((run / "metrics.json").read_text())["global_step"] == 1
        return run

    return _once_per_run(tmp_path_factory, "run", train)


@pytest.fixture(scope="module")
def nusc(synthetic_root):
    """The devkit's NuScenes tables of `synthetic_root`, one per test module. Treat it as read-only."""
    from nuscenes.nuscenes import NuScenes

    from bev.synthetic.writer import VERSION

    return NuScenes(version=VERSION, dataroot=str(synthetic_root), verbose=False)


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory) -> Path:
    """A hand-written nuScenes dataroot of 2 key frames with a map (tests/helpers/tiny_nuscenes.py), one per
    test module."""
    from helpers.tiny_nuscenes import write_tiny

    return write_tiny(tmp_path_factory.mktemp("tiny") / "nuscenes", samples=2)


@pytest.fixture(scope="session")
def emu(request):
    """The CUDA kernels of bev.ops compiled for the CPU under the SIMT emulation (skips without a C++ compiler)."""
    from helpers.cuda_emulation import load_emulation

    return load_emulation(request.config)


@pytest.fixture
def fresh_compile_caches():
    """torch.compile from scratch: Dynamo reset, and no on-disk graphs traced against an older op schema."""
    import contextlib

    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    # The configs' own patch(): monkeypatch's undo deletes an attribute it found unset, which hides a torch
    # config for good (ConfigModule.__delattr__), and the next compile fails on the missing name.
    with contextlib.ExitStack() as stack:
        for config, name in ((inductor_config, "fx_graph_cache"), (functorch_config, "enable_autograd_cache")):
            if hasattr(config, name):
                stack.enter_context(config.patch(name, False))
        yield


_ENTRY_POINT_CALLS = re.compile(
    r"\b(run_cli|train_cli|eval_cli|native_check_in_subprocess)\(|main\(\s*\[|\b(subprocess\.\w+|Popen)\(\s*\[\s*(sys\.executable|\"bash\")"
)


@functools.cache  # fixtures are shared by many tests, and getsource is slow
def _runs_an_entry_point(fn) -> bool:
    try:
        return bool(_ENTRY_POINT_CALLS.search(inspect.getsource(fn)))
    except (OSError, TypeError):
        return False


def pytest_collection_modifyitems(config, items):
    """Every test that runs an entry point (bev-train, bev-eval, ... through helpers.cli, or a command's
    main([...])) or starts a Python or bash process (a script, a fresh interpreter), itself or through one
    of its fixtures, is marked e2e:
    `-m "not e2e"` (make test-unit) leaves them all out."""
    for item in items:
        fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        fns = [getattr(item, "function", None)] + [d.func for defs in fixtures.values() for d in defs]
        if any(fn is not None and _runs_an_entry_point(fn) for fn in fns):
            item.add_marker(pytest.mark.e2e)
