"""Interrupts, end to end in real processes (subprocesses: signals go to them, not to pytest): Ctrl-C (SIGINT) and
SIGTERM mid-epoch stop bev-train after the step under way, with that step in last.ckpt and one line saying how to
resume, and a second bev-train resumes it to the planned end; a bev-train into a run directory another one is
training in is refused in one line, leaving that run's files alone. Each process runs under a time limit."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.cli import TINY, default_signals

LIMIT_S = 240  # per bev-train process: a hang fails the test instead of the suite
TESTS = Path(__file__).resolve().parent
# 3 training samples, batch 1: 3 steps an epoch, 6 in all; the probe says each step and waits a second.
ARGS = [
    *TINY,
    "data.batch_size=1",
    "trainer.max_epochs=2",
    "trainer.check_val_every_n_epoch=2",
    "callbacks.bev_png.every_n_steps=0",
    "+callbacks.step_probe._target_=helpers.step_probe.StepProbe",
]


def _start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-m", "bev.train", *ARGS, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: a signal to the group reaches it as a terminal's Ctrl-C does
        preexec_fn=default_signals,
    )


def _wait_for_line(proc: subprocess.Popen, line: str) -> None:
    """Read proc's stdout up to `line` (the probe's); fail if the process ends first."""
    for got in proc.stdout:
        if got.strip() == line:
            return
    raise AssertionError(f"the run ended (status {proc.wait()}) before printing {line!r}: {proc.stderr.read()[-2000:]}")


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"bev-train did not end within {LIMIT_S} s")
    return proc.returncode, err


def _step_of(ckpt: Path) -> int:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]


def _send(proc: subprocess.Popen, sig: str) -> None:
    """Ctrl-C as a terminal sends it, to the whole process group (the loader process too); SIGTERM as `kill PID`,
    a container stop or a scheduler's signal to the job's process."""
    if sig == "SIGINT":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)


@pytest.mark.e2e
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_interrupt_mid_epoch_saves_the_last_step_and_a_second_bev_train_resumes_it(sig, synthetic_root, tmp_path):
    run = tmp_path / "run"
    common = [f"data.dataroot={synthetic_root}", f"hydra.run.dir={run}"]
    # A loader process started anew each epoch, after training began: it shares the training process's handlers.
    proc = _start([*common, "data.num_workers=1", "data.persistent_workers=false"])
    try:
        _wait_for_line(proc, "step 4")  # mid-epoch: step 1 of the second epoch's 3
        _send(proc, sig)
    finally:
        code, err = _finish(proc)
    last = run / "checkpoints" / "last.ckpt"
    assert code == 128 + getattr(signal, sig), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("bev-train: stopped by")]
    assert said == [
        f"bev-train: stopped by {sig} after step 4 (epoch 1); resume with the same command and ckpt_path={last}"
    ]
    assert _step_of(last) == 4
    assert err.count("bev-train: SIGINT: stopping after the current step") == (sig == "SIGINT")  # said once

    resumed = _start([*common, f"ckpt_path={last}"])
    code, err = _finish(resumed)
    assert code == 0, err[-3000:]
    assert _step_of(last) == 6 and not (run / "checkpoints" / "last-v1.ckpt").exists()


@pytest.mark.e2e
def test_a_second_bev_train_into_a_run_directory_in_use_is_refused_in_one_line(synthetic_root, tmp_path):
    run = tmp_path / "run"
    common = [f"data.dataroot={synthetic_root}", f"hydra.run.dir={run}"]
    first = _start([*common, "+callbacks.step_probe.pause_s=120"])  # busy at step 1 until signalled
    try:
        _wait_for_line(first, "step 1")
        overrides = (run / ".hydra" / "overrides.yaml").read_text()
        second = _start([*common, "seed=7"])
        code, err = _finish(second)
        assert code == 1 and "Traceback" not in err, err[-3000:]
        assert err.strip().splitlines() == [
            f"bev-train: error: run directory {str(run)!r} is in use by bev-train pid {first.pid}: wait for that run "
            "to end, or train into another directory (hydra.run.dir=...)"
        ]
        assert (run / ".hydra" / "overrides.yaml").read_text() == overrides  # the first run's files are left alone
        assert first.poll() is None  # and it trains on
    finally:
        first.send_signal(signal.SIGTERM)
        code, err = _finish(first)
    assert code == 128 + signal.SIGTERM, err[-3000:]
