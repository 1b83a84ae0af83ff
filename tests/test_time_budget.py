"""The time budget (bev.callbacks.TimeBudget) on a tiny model whose steps cost fake seconds."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bev.callbacks import ModelCheckpoint, TimeBudget, parse_deadline, parse_duration
from bev.schedule import OneCycle, end_schedule_at, run_length, schedule_length, step_schedulers


def test_parse_duration():
    assert parse_duration("00:16:00") == 960
    assert parse_duration("00:00:17:00") == 1020
    assert parse_duration("1:30") == 90
    assert parse_duration(45) == 45.0
    assert parse_duration(None) is None
    for bad in ("16 min", "0:0:0", "1:2:3:4:5", -3):
        with pytest.raises(ValueError, match="time_budget"):
            parse_duration(bad)


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Tiny(L.LightningModule):
    """A linear regression whose every training step costs `step_s` and validation batch `val_s` fake seconds."""

    def __init__(
        self,
        clock: FakeClock,
        step_s: float = 1.0,
        val_s: float = 0.25,
        first_epoch_step_s: float | None = None,
        schedule=OneCycle,
    ):
        super().__init__()
        self.schedule = schedule
        self.layer = nn.Linear(4, 1)
        self.clock, self.step_s, self.val_s = clock, step_s, val_s
        self.first_epoch_step_s = step_s if first_epoch_step_s is None else first_epoch_step_s
        self.lrs: list[float] = []
        self.validated_at: list[int] = []  # global step of each validation

    def training_step(self, batch, batch_idx):
        self.clock.t += self.first_epoch_step_s if self.current_epoch == 0 else self.step_s
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        self.clock.t += self.val_s
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self.layer(x), y))

    def on_validation_epoch_end(self):
        self.validated_at.append(self.trainer.global_step)

    def on_train_start(self):
        # As bev.lit: a schedule restored shorter than the run (a time limit's) is stretched to it.
        steps = run_length(self.trainer)
        for sched in step_schedulers(self.trainer):
            if (schedule_length(sched) or steps) < steps:
                end_schedule_at(sched, steps, pivot=-1)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = self.schedule(opt, max_lr=1e-2, total_steps=int(self.trainer.estimated_stepping_batches), pct_start=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Data(L.LightningDataModule):
    """20 training batches of 4 and 10 validation batches of 8, the same every run."""

    def __init__(self):
        super().__init__()
        x = torch.randn(80, 4, generator=torch.Generator().manual_seed(0))
        self.ds = TensorDataset(x, x.sum(1, keepdim=True))

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))

    def val_dataloader(self):
        return DataLoader(self.ds, batch_size=8)


def fit(
    budget=None,
    epochs=5,
    step_s=1.0,
    ckpt_path=None,
    callback=None,
    val_every=1,
    first_epoch_step_s=None,
    schedule=OneCycle,
    checkpoint_dir=None,
    **kw,
):
    """20 steps per epoch, 10 validation batches; returns (module, trainer, callback). checkpoint_dir: the
    project's ModelCheckpoint (best by val/loss + last.ckpt, as configs/callbacks/model_checkpoint.yaml) there."""
    L.seed_everything(0, verbose=False)
    clock = FakeClock()
    model = Tiny(clock, step_s, first_epoch_step_s=first_epoch_step_s, schedule=schedule)
    callbacks = []
    if budget is not None:
        callback = TimeBudget(budget, measure_steps=10, skip_steps=2, **kw)
    if callback is not None:
        callback.clock = clock
        callbacks.append(callback)
    if checkpoint_dir is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=checkpoint_dir,
                filename="step_{step:03d}",
                monitor="val/loss",
                save_last=True,
                auto_insert_metric_name=False,
                save_on_train_epoch_end=False,
            )
        )
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=checkpoint_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        check_val_every_n_epoch=val_every,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 4-wide linear layer: more threads only wait on each other
    try:
        trainer.fit(model, datamodule=Data(), ckpt_path=ckpt_path)
    finally:
        torch.set_num_threads(threads)
    return model, trainer, callback


def test_an_unbound_budget_changes_nothing():
    plain, t0, _ = fit()
    budgeted, t1, cb = fit(budget=10_000)
    assert t0.global_step == t1.global_step == 100
    assert plain.lrs == budgeted.lrs
    for a, b in zip(plain.parameters(), budgeted.parameters()):
        assert torch.equal(a, b)
    assert cb.summary()["shortened"] is False and cb.limit is None


def test_a_binding_budget_shortens_the_run_and_completes_the_schedule():
    # Planned: 100 steps of 1 s + 5 validations of 2.5 s = 112.5 s; the budget is 60 s.
    model, trainer, cb = fit(budget=60, margin=0.0)
    s = cb.summary()
    assert s["shortened"] and not s["stopped_on_budget"] and s["planned_steps"] == 100
    assert trainer.global_step == cb.limit < 100
    assert cb.s_per_step == pytest.approx(1.0)
    assert s["used_s"] <= 60  # training + validations (the last one at the shortened end) fit
    assert s["used_s"] >= 60 - 4  # and most of the budget is used (within a step + a validation)
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.total_steps == cb.limit and sched.last_epoch == cb.limit
    # The schedule completed: the last step ran at OneCycle's final LR, and the LR fell monotonically after the peak.
    assert len(model.lrs) == cb.limit
    assert model.lrs[-1] == pytest.approx(1e-2 / 25 / 1e4, rel=1e-6)
    peak = max(range(len(model.lrs)), key=model.lrs.__getitem__)
    assert all(a >= b for a, b in zip(model.lrs[peak:], model.lrs[peak + 1 :]))
    assert f"of {s['planned_steps']} planned steps" in s["message"] and "schedule now ends there" in s["message"]
    # It stopped through trainer.should_stop, without touching Lightning's loop limits.
    assert trainer.fit_loop.epoch_loop.max_steps == -1 and trainer.fit_loop.min_epochs == 0


def test_a_schedule_whose_length_is_fixed_is_left_as_is_and_said_so():
    model, trainer, cb = fit(budget=60, margin=0.0, schedule=torch.optim.lr_scheduler.OneCycleLR)
    assert trainer.global_step == cb.limit < 100 and "cannot change" in cb.message
    assert trainer.lr_scheduler_configs[0].scheduler.total_steps == 100


def test_a_reserve_of_validations_is_kept_free_at_the_end_of_the_budget():
    # Validations take 2.5 s here: reserving two keeps 5 s of the 60 s for what follows training.
    _, plain, without = fit(budget=60, margin=0.0)
    model, trainer, cb = fit(budget=60, margin=0.0, reserve_validations=2)
    s = cb.summary()
    assert s["reserved_after_s"] == 5.0 and "5 s of it kept for after training" in s["message"]
    assert trainer.global_step == cb.limit < without.limit and 55 - 4 <= s["used_s"] <= 55
    assert model.lrs[-1] == pytest.approx(1e-2 / 25 / 1e4, rel=1e-6)  # the schedule still completes
    with pytest.raises(ValueError, match="reserve_validations"):
        TimeBudget(60, reserve_validations=-1)


def test_a_shortened_run_validates_at_its_end_when_validation_skips_epochs():
    # Validating every 2nd epoch (steps 40, 80): the 60 s budget ends the run inside an epoch
    # that would not validate; the last validation is still at the shortened end.
    model, trainer, cb = fit(budget=60, margin=0.0, val_every=2)
    assert cb.limit % 40 != 0 and model.validated_at[-1] == trainer.global_step == cb.limit
    assert cb.summary()["used_s"] <= 60


@pytest.mark.parametrize("val_every", [1, 2])
def test_a_run_stopped_inside_an_epoch_keeps_its_best_and_last_checkpoints(tmp_path, val_every):
    # The end-of-run validation is the best one here (val/loss falls all along), so the best
    # checkpoint is of the final step, beside last.ckpt of that step.
    model, trainer, cb = fit(budget=60, margin=0.0, val_every=val_every, checkpoint_dir=tmp_path)
    assert cb.limit % 20 != 0 and trainer.global_step == cb.limit
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", f"step_{cb.limit:03d}.ckpt"]
    for name in (f"step_{cb.limit:03d}.ckpt", "last.ckpt"):
        assert torch.load(tmp_path / name, weights_only=True)["global_step"] == cb.limit


def test_the_last_validation_is_reserved_before_any_validation_ran():
    # Validating only every 5th epoch (step 100): the shortened run stops before any validation
    # was measured, so the one at its end (10 batches of 0.25 s) must come from the guess.
    model, trainer, cb = fit(budget=60, margin=0.0, val_every=5)
    assert cb.s_per_val > 0 and model.validated_at == [trainer.global_step]
    assert cb.summary()["used_s"] <= 60


def test_a_slow_first_epoch_is_not_measured_with_skip_epochs():
    # The first epoch at 3 s/step (an input memo filling), the rest at 1 s/step: 20 x 3 + 80 x 1 +
    # 5 validations of 2.5 s = 152.5 s fits a 160 s budget. Measured in the first epoch the run
    # looks like 300 s and would be shortened; measured from the second it runs unchanged.
    plain, _, _ = fit(first_epoch_step_s=3.0)
    _, early, cb = fit(budget=160, margin=0.0, first_epoch_step_s=3.0)
    assert cb.summary()["shortened"] and early.global_step < 100
    skipped, late, cb = fit(budget=160, margin=0.0, first_epoch_step_s=3.0, skip_epochs=1)
    assert not cb.summary()["shortened"] and late.global_step == 100 and cb.s_per_step == pytest.approx(1.0)
    assert skipped.lrs == plain.lrs and cb.summary()["used_s"] == pytest.approx(152.5)
    with pytest.raises(ValueError, match="skip_epochs"):
        TimeBudget(60, skip_epochs=-1)


def test_skipped_epochs_that_alone_overrun_end_on_the_hard_stop():
    # The first epoch at 8 s/step would take 160 s of a 140 s budget: nothing is measured before the
    # second epoch, so the last resort stops the run when the budget is spent.
    _, trainer, cb = fit(budget=140, margin=0.0, first_epoch_step_s=8.0, skip_epochs=1)
    s = cb.summary()
    assert s["stopped_on_budget"] and cb.limit is None and 140 <= s["used_s"] <= 140 + 8
    assert "stopped before the LR schedule finished" in s["message"] and trainer.global_step < 20


def test_a_resumed_run_keeps_its_limit_and_spends_only_what_is_left(tmp_path):
    _, trainer, cb = fit(budget=60, margin=0.0)
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    # Resuming the finished, shortened run trains no further (bev.lit's stretch is not triggered).
    _, again, cb2 = fit(budget=60, margin=0.0, ckpt_path=ckpt)
    assert again.global_step == trainer.global_step == cb2.limit == cb.limit
    assert cb2.elapsed_before == pytest.approx(cb.elapsed(), abs=1e-6)


T0 = 1_800_000_000.0  # a wall-clock time (2027)


def fit_to_deadline(deadline, startup_s, **kw):
    """fit() with a TimeBudget whose wall clock reads T0 + startup_s when training starts."""
    callback = TimeBudget(deadline=deadline, measure_steps=10, skip_steps=2, margin=0.0, **kw)
    callback.wall_clock = lambda: T0 + startup_s
    return fit(callback=callback)


def test_a_deadline_counts_the_time_before_training():
    # 60 s until the deadline with nothing spent before training: the same run as a 60 s budget.
    _, budget_run, by_budget = fit(budget=60, margin=0.0)
    _, deadline_run, cb = fit_to_deadline(T0 + 60, startup_s=0)
    assert deadline_run.global_step == budget_run.global_step == cb.limit == by_budget.limit < 100
    assert cb.summary()["budget_s"] == 60 and cb.summary()["deadline"] and "until the deadline" in cb.message
    # 20 s of start-up leave 40 s: a shorter run that still ends by the deadline, schedule completed.
    model, late_run, late = fit_to_deadline(T0 + 60, startup_s=20)
    assert late.budget == 40 and late_run.global_step == late.limit < cb.limit
    assert late.summary()["used_s"] <= 40 and model.lrs[-1] == pytest.approx(1e-2 / 25 / 1e4, rel=1e-6)
    # With a budget as well, the smaller of the two binds.
    _, _, both = fit_to_deadline(T0 + 60, startup_s=0, budget=30)
    assert both.budget == 30


def test_a_deadline_already_passed_stops_before_the_first_step():
    _, trainer, cb = fit_to_deadline(T0 + 60, startup_s=90)
    assert trainer.global_step == 0 and cb.stopped_on_budget and "passed before training started" in cb.message


def test_parse_deadline():
    assert parse_deadline(None) is None
    assert parse_deadline(T0) == parse_deadline(str(int(T0))) == T0
    assert parse_deadline("2026-11-25T18:00:00+00:00") == 1795629600.0
    with pytest.raises(ValueError, match="for a duration use callbacks.time_budget.budget"):
        parse_deadline(900)  # 15 minutes, not a time
    with pytest.raises(ValueError, match="ISO date"):
        parse_deadline("in 15 minutes")


def test_a_machine_that_slows_down_hits_the_hard_stop():
    # A 2 s/step machine with 30 s: the plan after 12 steps already overruns; a far slower end is caught by the net.
    _, trainer, cb = fit(budget=30, step_s=2.0, margin=0.0)
    assert trainer.global_step < 100 and cb.elapsed() <= 30 + 2 + 2.5 + 1e-6


FINAL_LR = 1e-2 / 25 / 1e4  # OneCycle's last LR in Tiny: the schedule completed


def test_the_minimum_training_time_counts_from_the_first_step(caplog):
    # A slow start: 168 s of start-up (imports, indexing) pass a deadline 60 s after make started.
    # Training still gets its 30 s from its first step, the schedule ending there, and says it ends late.
    with caplog.at_level("WARNING", logger="bev.callbacks.time_budget"):
        model, trainer, cb = fit_to_deadline(T0 + 60, startup_s=168, min_train_s=30, val_cost_guess=0.25)
    s = cb.summary()
    assert 30 - 4 <= s["used_s"] <= 30 and trainer.global_step == cb.limit >= 20
    assert model.lrs[-1] == pytest.approx(FINAL_LR, rel=1e-6) and not s["stopped_on_budget"]
    assert "minimum training time 30 s from the first step" in cb.message
    assert s["late_s"] >= 30 + 108 - 1 and "training gets its minimum of 30 s from this first step" in caplog.text
    with pytest.raises(ValueError, match="min_train_s"):
        TimeBudget(deadline=T0, min_train_s=-1)


def test_a_minimum_inside_the_unmeasured_first_epoch_still_ends_the_schedule():
    # make train leaves the first epoch unmeasured (skip_epochs 1); when the minimum binds from the first step and
    # is shorter than that epoch, the plan comes early enough for the LR schedule to end with the run.
    model, trainer, cb = fit_to_deadline(T0 + 60, startup_s=168, min_train_s=15, val_cost_guess=0.25, skip_epochs=1)
    assert not cb.stopped_on_budget and trainer.global_step == cb.limit < 20 and cb.summary()["used_s"] <= 15
    assert model.lrs[-1] == pytest.approx(FINAL_LR, rel=1e-6) and model.validated_at == [cb.limit]


def test_the_minimum_training_time_changes_nothing_when_the_deadline_leaves_more():
    _, plain, without = fit_to_deadline(T0 + 60, startup_s=0)
    _, trainer, cb = fit_to_deadline(T0 + 60, startup_s=0, min_train_s=30)
    assert trainer.global_step == without.limit == cb.limit and cb.summary()["late_s"] == 0


def test_the_measured_start_up_is_kept_free_for_the_evaluation():
    # The process started 20 s before training (its wall clock reads T0 then): bev-eval starts up alike, so
    # with reserve_startup 20 s of the 100 until the deadline are kept for after training.
    callback = TimeBudget(deadline=T0 + 100, measure_steps=10, skip_steps=2, margin=0.0, reserve_startup=True)
    callback.wall_clock, callback.process_start = (lambda: T0), T0 - 20
    _, trainer, cb = fit(callback=callback)
    s = cb.summary()
    assert s["startup_s"] == 20 and s["reserved_after_s"] == 20 and 80 - 4 <= s["used_s"] <= 80


def test_a_run_resumed_at_its_step_limit_trains_on_with_a_new_deadline(tmp_path):
    # `make train` again: the last session's 60 s ended the run at its limit; the next session's own 60 s train
    # on towards the 100 planned steps, with the schedule ending at the new limit.
    _, first, cb = fit_to_deadline(T0 + 60, startup_s=0)
    trainer_ckpt = tmp_path / "last.ckpt"
    first.save_checkpoint(trainer_ckpt)
    callback = TimeBudget(deadline=T0 + 1060, measure_steps=10, skip_steps=2, margin=0.0)
    callback.wall_clock = lambda: T0 + 1000
    model, again, cb2 = fit(callback=callback, ckpt_path=trainer_ckpt)
    assert cb.limit < again.global_step == cb2.limit < 100 and cb2.summary()["steps"] == again.global_step
    assert model.lrs[-1] == pytest.approx(FINAL_LR, rel=1e-6)


def _make_train_budget():
    """bev.make_train (what `make train` runs before bev-train and at its end)."""
    from bev import make_train

    return make_train


def test_make_train_on_a_slow_machine_trains_its_minimum_and_says_so_at_the_end(tmp_path, capsys):
    # make train's deadline logic with a slow start: the venv and the data took 19.5 of its 20 minutes, and
    # bev-train's start-up 60 s more. Training still gets its minimum (20 s here), and the last lines say the
    # model is undertrained, by how much, and what to do.
    import json
    import time

    script = _make_train_budget()
    make_start = time.time() - 19.5 * 60
    assert script.main(["deadline", "--make-start", str(make_start), "--minutes", "20", "--eval-reserve-s", "45",
                        "--min-train-s", "20"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    deadline = int(out)
    assert deadline == int(make_start + 20 * 60 - 45) and "it cannot end within TRAIN_MINUTES=20" in err
    callback = TimeBudget(deadline=deadline, measure_steps=10, skip_steps=2, margin=0.0, min_train_s=20,
                          val_cost_guess=0.25, reserve_startup=True)  # fmt: skip
    callback.wall_clock, callback.process_start = (lambda: time.time() + 60), time.time()
    _, trainer, cb = fit(callback=callback)
    assert 20 - 4 <= cb.summary()["used_s"] <= 20 and trainer.global_step < 25
    # What bev-train and bev-eval leave in the run directory (bev.train._run_record, bev.eval).
    (tmp_path / "eval").mkdir()
    (tmp_path / "metrics.json").write_text(
        json.dumps({"global_step": trainer.global_step, "time_budget": cb.summary()})
    )
    (tmp_path / "eval" / "metrics.json").write_text(json.dumps({"metrics": {"iou_vehicle": 0.01, "miou_map": 0.09}}))
    assert script.main(["report", str(tmp_path), "--make-start", str(make_start), "--minutes", "20"]) == 0
    last = capsys.readouterr().out
    assert f"undertrained: {trainer.global_step} of its 100 planned steps" in last and "vehicle IoU 0.010" in last
    assert "`make train` again resumes from" in last and "TRAIN_MINUTES=" in last and "GPU" in last


def test_make_train_says_nothing_more_when_most_of_the_schedule_fitted(tmp_path):
    import json

    script = _make_train_budget()
    budget = {"planned_steps": 100, "s_per_step": 1.0}
    (tmp_path / "metrics.json").write_text(json.dumps({"global_step": 80, "time_budget": budget}))
    lines = script.report(tmp_path, make_start=0.0, minutes=20, now=15 * 60)
    assert lines == ["make train: 15.0 min in all (TRAIN_MINUTES=20)"]
    _, plan = script.plan_deadline(now=600, make_start=0, minutes=20, eval_reserve_s=45, min_train_s=120)
    assert len(plan) == 1 and "cannot end" not in plan[0]


def test_make_train_passes_the_minimum_and_the_start_up_reserve_to_bev_train():
    # `make -n train` prints the recipe with make's variables expanded: its time_budget overrides must compose
    # into the experiment and reach TimeBudget, and the report must be make train's last command.
    import shlex
    import shutil
    import subprocess
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    import bev.data  # noqa: F401 (registers the data config schemas that configs/data names)
    from bev.utils.config import CONFIG_DIR

    if shutil.which("make") is None:
        pytest.skip("no make here")
    root = Path(__file__).resolve().parents[1]
    # --no-print-directory: under `make test` this make is a sub-make, which would print directory lines
    make = ["make", "--no-print-directory", "-n", "train"]
    recipe = subprocess.run(make, cwd=root, capture_output=True, text=True, check=True).stdout
    overrides = [a for a in shlex.split(recipe.replace("$deadline", "1800000000")) if "callbacks.time_budget." in a]
    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["experiment=synthetic_cpu", *overrides])
    callback = instantiate(cfg.callbacks.time_budget)
    assert callback.deadline == 1.8e9 and callback.min_train_s == 120 and callback.reserve_startup
    assert recipe.strip().splitlines()[-1].startswith(".venv/bin/python -m bev.make_train report")
