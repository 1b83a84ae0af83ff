"""The documented Bayesian search (`hparams_search=optuna`) runs end to end: two trials of the tiny model."""

import pytest

from helpers.cli import TINY, train_cli


@pytest.mark.e2e
def test_two_optuna_trials_write_their_runs_and_the_best(synthetic_root, tmp_path, monkeypatch):
    args = [
        "-m",
        *TINY,
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.n_startup_trials=2",
        "hydra.sweeper.params={model.optimizer.lr: 'interval(0.001, 0.01)'}",
        "callbacks.bev_png.every_n_steps=0",
        f"data.dataroot={synthetic_root}",
        f"hydra.sweep.dir={tmp_path}",
    ]
    assert train_cli(args, monkeypatch) == 0
    runs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and (p / "metrics.json").is_file())
    assert len(runs) == 2
    best = (tmp_path / "optimization_results.yaml").read_text()
    assert "best_params" in best and "model.optimizer.lr" in best
