"""Running the entry points in-process, as a user's command line would, and reading what they wrote."""

import csv
import signal
import sys
from pathlib import Path

from bev import eval as bev_eval
from bev import train as bev_train

# A tiny model on a coarse grid: seconds per run on 2 CPU cores.
TINY = [
    "experiment=synthetic_cpu",
    "grid.xbound=[-24,24,2.0]",
    "grid.ybound=[-24,24,2.0]",
    "grid.dbound=[4,44,8.0]",
    "data.final_dim=[32,96]",
    "data.batch_size=2",
    "data.num_workers=0",
    "model.net.camera.context_channels=8",
    "model.net.camera.widths=[8,8,16,16,16]",
    "model.net.camera.mid_channels=16",
    "model.net.decoder.widths=[8,16,16]",
    "trainer.max_epochs=1",
    "trainer.check_val_every_n_epoch=1",
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
]


def run_cli(main, args, monkeypatch) -> int:
    """Run a hydra.main entry point in-process with `args` as its command line; returns the exit status."""
    monkeypatch.setattr(sys, "argv", ["bev", *map(str, args)])
    try:
        main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def train_cli(args, monkeypatch):
    return run_cli(bev_train._hydra_main, args, monkeypatch)


def eval_cli(args, monkeypatch):
    return run_cli(bev_eval._hydra_main, args, monkeypatch)


def read_csv_metric(run: Path, key: str) -> list[float]:
    (f,) = run.glob("csv/version_*/metrics.csv")
    return [float(r[key]) for r in csv.DictReader(open(f)) if r.get(key)]


def assert_one_paragraph(err: str, *needles: str):
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) <= 8, err
    for n in needles:
        assert n in err, err


def default_signals() -> None:
    """A child process's preexec_fn: Ctrl-C and SIGTERM at their defaults, as from a terminal. A test run started in
    the background (nohup, `&`, some CI runners) passes an ignored SIGINT on, which our commands rightly keep
    ignored, so a test of what Ctrl-C does must restore it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
