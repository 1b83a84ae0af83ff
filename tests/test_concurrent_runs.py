"""Two bev-train started at once into one run directory: the directory is locked before Hydra writes anything there
(bev.utils.errors.RunDirCheck), so the one refused writes nothing (no .hydra/ over the running run's, no error.txt),
and the running run keeps the lock it took until it ends."""

import os
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from bev.utils.errors import RunDirCheck
from bev.utils.io import LOCK_NAME, run_dir_lock
from helpers.cli import TINY, assert_one_paragraph, train_cli


def _hydra_config(run: Path, task: str = "train"):
    """What RunDirCheck reads of Hydra's config at the start of a run."""
    hydra = {"run": {"dir": str(run)}, "output_subdir": ".hydra", "job": {"name": task}}
    return OmegaConf.create({"task_name": task, "hydra": hydra})


def _lock_is_free(run: Path) -> bool:
    """Whether another process could take the run directory's lock now (a lock on a file opened anew conflicts with
    this process's own locks too)."""
    import fcntl

    with open(run / LOCK_NAME) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
    return True


def test_the_run_directory_is_locked_from_the_start_of_the_run_until_its_end(tmp_path):
    run, check = tmp_path / "run", RunDirCheck()
    check.on_run_start(_hydra_config(run))
    assert not _lock_is_free(run)  # taken before Hydra writes .hydra/ and the log, not when training starts
    with run_dir_lock(run):  # the run's own lock takes the claim over ...
        assert not _lock_is_free(run)
    assert _lock_is_free(run)  # ... and drops it when the run ends
    check.on_run_end(_hydra_config(run))  # nothing left to drop
    assert _lock_is_free(run)


def test_a_claim_no_run_took_over_ends_with_the_run(tmp_path):
    run, check = tmp_path / "run", RunDirCheck()
    check.on_run_start(_hydra_config(run))
    check.on_run_end(_hydra_config(run))
    assert _lock_is_free(run)


def test_other_commands_lock_nothing(tmp_path):
    run = tmp_path / "eval"
    RunDirCheck().on_run_start(_hydra_config(run, "eval"))
    assert not (run / LOCK_NAME).exists()


# A process that has passed RunDirCheck.on_run_start into RUN and had Hydra write its config, as the first of two
# bev-train started at once into one new directory, then waits.
_FIRST = """
import sys
from pathlib import Path
from omegaconf import OmegaConf
from bev.utils.errors import RunDirCheck
run = Path(sys.argv[1])
hydra = {"run": {"dir": str(run)}, "output_subdir": ".hydra", "job": {"name": "train"}}
RunDirCheck().on_run_start(OmegaConf.create({"task_name": "train", "hydra": hydra}))
(run / ".hydra").mkdir()
(run / ".hydra" / "config.yaml").write_text("seed: 222\\n")
(run / ".hydra" / "overrides.yaml").write_text("- seed=222\\n")
print("started", flush=True)
input()
"""


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_of_two_runs_started_at_once_the_refused_one_writes_nothing(synthetic_root, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-c", _FIRST, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert first.stdout.readline().strip() == "started"
        before = _files(run)
        args = [*TINY, "seed=111", "+trainer.fast_dev_run=true", f"data.dataroot={synthetic_root}"]
        assert train_cli([*args, f"hydra.run.dir={run}"], monkeypatch) == 1
        assert_one_paragraph(
            capsys.readouterr().err,
            f"bev-train: error: run directory {str(run)!r} is in use by bev-train pid {first.pid}",
        )
        assert _files(run) == before  # the first run's .hydra/ still says seed=222; no error.txt, no log
        assert sorted(os.listdir(run)) == [".bev-train.lock", ".hydra"]
    finally:
        first.kill()
        first.wait()
