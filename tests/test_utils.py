"""bev.utils: the one atomic-write helper."""

from __future__ import annotations

import os

import pytest

from bev.utils.io import atomic_open, atomic_write


def test_atomic_write_text_and_bytes(tmp_path):
    p = tmp_path / "sub" / "a.json"
    atomic_write(p, "hello")
    assert p.read_text() == "hello"
    atomic_write(p, b"\x00\x01")
    assert p.read_bytes() == b"\x00\x01"
    assert [q.name for q in p.parent.iterdir()] == ["a.json"]  # no temporary file left


def test_failed_write_keeps_the_old_file(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_open(p, "w") as f:
            f.write("half")
            raise RuntimeError("crash mid-write")
    assert p.read_text() == "old"
    assert [q.name for q in tmp_path.iterdir()] == ["a.txt"]


def test_atomic_open_rejects_append(tmp_path):
    with pytest.raises(ValueError, match="whole files"):
        with atomic_open(tmp_path / "a", "a"):
            pass


def test_tune_malloc_in_process_keeps_freed_buffers_mapped():
    # In a fresh process: glibc returns a freed 64 MB buffer to the OS at once (it was mmap'd),
    # unless the allocator is tuned to keep it. Resident pages, not page faults of the next
    # allocation: where glibc places that one depends on thread timing (a fault count flaked).
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from bev.utils.malloc import tune_malloc_in_process\n"
        "applied = tune_malloc_in_process() if sys.argv[1] == 'tuned' else {}\n"
        "def resident():\n"
        "    return int(open('/proc/self/statm').read().split()[1])\n"
        "buf = torch.ones(1 << 24)\n"  # 64 MB, every page touched
        "held = resident()\n"
        "del buf\n"
        "print(len(applied), held - resident())\n"  # pages the free returned to the OS
    )
    results = {}
    for mode in ("plain", "tuned"):
        out = subprocess.run(
            [sys.executable, "-c", code, mode],
            capture_output=True,
            text=True,
            timeout=120,
            env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")},
        )
        assert out.returncode == 0, out.stderr
        results[mode] = [int(v) for v in out.stdout.split()]
    pages = (1 << 26) // os.sysconf("SC_PAGE_SIZE")
    assert results["tuned"][0] == 3
    assert results["plain"][1] >= 0.9 * pages, results  # munmap'd by the free
    assert results["tuned"][1] <= 0.02 * pages, results  # kept mapped for the next buffer


@pytest.fixture
def four_cpus(monkeypatch):
    import bev.utils.threads as threads

    monkeypatch.setattr(threads, "available_cpus", lambda: 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return threads


def test_threads_auto_leaves_a_core_per_loader_worker(four_cpus):
    assert four_cpus.resolve_threads("auto", 1)[0] == 3
    assert four_cpus.resolve_threads("auto", 0)[0] == 4
    assert four_cpus.resolve_threads("auto", 8)[0] == 1  # never below one thread
    assert four_cpus.resolve_threads("auto", 1, devices=2)[0] == 1  # two DDP processes share the 4 CPUs


def test_threads_auto_respects_omp_num_threads_and_gpus(four_cpus, monkeypatch):
    assert four_cpus.resolve_threads("auto", 1, "gpu")[0] is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    n, reason = four_cpus.resolve_threads("auto", 1)
    assert n is None and "OMP_NUM_THREADS" in reason


def test_threads_explicit_and_invalid(four_cpus):
    assert four_cpus.resolve_threads(2, 1) == (2, "as configured")
    assert four_cpus.resolve_threads(None, 1)[0] is None
    for bad in (0, -1, "many"):
        with pytest.raises(ValueError, match="threads must be a positive integer, auto or null"):
            four_cpus.resolve_threads(bad, 1)


def test_apply_threads_sets_torch_threads(four_cpus):
    import torch

    before = torch.get_num_threads()
    try:
        assert four_cpus.apply_threads("auto", 1) == (3, "threads: 3 (4 CPUs less 1 loader worker(s))")
        assert torch.get_num_threads() == 3
        assert four_cpus.apply_threads(None, 1) == (None, None) and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_threads_give_way_to_other_processes():
    from bev.utils.threads import threads_for_load

    assert [threads_for_load(2, busy) for busy in (None, 0.0, 0.4, 0.6, 1.0, 3.0)] == [2, 2, 2, 1, 1, 1]
    assert [threads_for_load(8, busy) for busy in (0.3, 2.2, 7.9)] == [8, 6, 1]


def test_other_load_counts_other_processes_only(monkeypatch):
    from bev.utils import threads

    ticks = {"busy": 1000, "own": 500}
    monkeypatch.setattr(threads, "_busy_ticks", lambda cpus: ticks["busy"])
    monkeypatch.setattr(threads, "_own_ticks", lambda: ticks["own"])
    now = [100.0]
    monkeypatch.setattr(threads.time, "monotonic", lambda: now[0])
    load = threads.OtherLoad(cpus={0, 1})
    load.hz = 100
    now[0] += 2.0
    ticks["busy"] += 300  # 3 CPU-seconds busy on our CPUs in 2 s, of which 1 s was ours
    ticks["own"] += 100
    assert load.cpus_busy() == pytest.approx(1.0)
    monkeypatch.setattr(threads, "_own_ticks", lambda: None)  # /proc unreadable: no opinion
    assert load.cpus_busy() is None


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux /proc only")
def test_proc_readers_see_this_process():
    from bev.utils import threads

    cpus = os.sched_getaffinity(0)
    assert threads._busy_ticks(cpus) > 0 and threads._own_ticks() > 0
    assert threads.OtherLoad().cpus_busy() >= 0.0
