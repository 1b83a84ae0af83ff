"""Fit training into a wall-clock budget by shortening it, with the LR schedule completing."""

from __future__ import annotations

import datetime
import logging
import math
import os
import time
from typing import Any

import lightning as L

from bev.schedule import end_schedule_at, step_schedulers

log = logging.getLogger(__name__)


def parse_duration(value: Any, name: str = "time_budget") -> float | None:
    """Seconds from "HH:MM:SS" / "DD:HH:MM:SS" / "MM:SS" or a number of seconds; None stays None."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        try:
            parts = [float(p) for p in str(value).strip().split(":")]
            if not 1 <= len(parts) <= 4:
                raise ValueError
            seconds = sum(p * m for p, m in zip(reversed(parts), (1, 60, 3600, 86400)))
        except ValueError:
            raise ValueError(
                f'{name} must be a duration like "00:16:00" (HH:MM:SS), "DD:HH:MM:SS" or seconds, got {value!r}'
            ) from None
    if seconds <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return seconds


def parse_deadline(value: Any) -> float | None:
    """A wall-clock time as Unix seconds, from a number of seconds since the epoch or an ISO 8601
    date and time ("2026-11-25T18:00:00", local time unless it names a zone); None stays None."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = datetime.datetime.fromisoformat(str(value).strip()).timestamp()
        except ValueError:
            raise ValueError(
                f"deadline must be Unix seconds (e.g. $(date -d '+15 min' +%s)) or an ISO date and "
                f'time like "2026-11-25T18:00:00", got {value!r}'
            ) from None
    if seconds < 1e9:  # before 2001: a duration passed where a time was meant
        raise ValueError(
            f"deadline must be a wall-clock time (Unix seconds), got {value!r}; for a duration use "
            f"callbacks.time_budget.budget"
        )
    return seconds


class TimeBudget(L.Callback):
    """Fit training into a wall-clock budget by training fewer steps, with the LR schedule completing.

    The rule: after `skip_steps` steps (workers start, kernels warm up; with `skip_epochs`, the first
    steps of that many epochs: an input memo that fills in the first epoch makes it slower) it times
    `measure_steps` steps and projects the run from that pace plus the validations it will run. If
    the projection overruns the budget (less `margin`), it sets `step_limit` to the steps that fit,
    makes the LR schedule end there (bev.schedule.end_schedule_at) and stops there with a final
    validation and checkpoint. After each validation the projection is redone with its measured
    time, and the limit moves if it is off by more than 1 % (never past the configured run). When the
    budget does not bind, nothing changes. As a last resort (the machine slowed down a lot) training
    stops when the budget is spent, before the schedule ends.

    `deadline` (a wall-clock time) sets the budget when training starts to the time left until then,
    so start-up counts; with `budget` too, the smaller wins. `reserve_validations` keeps that many
    measured validations' time free at the end, for an evaluation that follows training (`make
    train`), and `reserve_startup` this process's measured start-up (process start to the first
    step: an evaluation process starts up alike). `min_train_s` is guaranteed from the session's
    first training step, past the budget if need be (a slow start-up cannot leave an untrained
    model); a line at the first step says when that makes the run end past its deadline. The time
    used, the plan and the limit are saved in checkpoints: a resumed run spends what is left, and
    with a new deadline (a new session's own time) a run resumed at its step limit trains on
    towards the planned steps.
    """

    def __init__(
        self,
        budget: Any = None,
        measure_steps: int = 40,
        skip_steps: int = 5,
        margin: float = 0.03,
        val_cost_guess: float = 0.9,
        skip_epochs: int = 0,
        deadline: Any = None,
        reserve_validations: float = 0.0,
        min_train_s: float = 0.0,
        reserve_startup: bool = False,
    ):
        self.budget = self.configured_budget = parse_duration(budget)
        self.deadline = parse_deadline(deadline)
        self.measure_steps, self.skip_steps = int(measure_steps), int(skip_steps)
        if int(skip_epochs) < 0:
            raise ValueError(f"skip_epochs must be >= 0, got {skip_epochs}")
        self.skip_epochs = int(skip_epochs)
        if float(reserve_validations) < 0:
            raise ValueError(f"reserve_validations must be >= 0, got {reserve_validations}")
        self.reserve_validations = float(reserve_validations)
        if float(min_train_s) < 0:
            raise ValueError(f"min_train_s must be >= 0, got {min_train_s}")
        self.min_train_s, self.reserve_startup = float(min_train_s), bool(reserve_startup)
        self.process_start = _process_start()  # wall clock; None where unknown (replaced in tests)
        self.startup_s: float | None = None  # process start -> this session's first step
        self._floor: float | None = None  # elapsed() before which training does not end (first step + min_train_s)
        self.margin = float(margin)
        # A validation batch costs about this many training steps until one is measured (its images
        # are decoded the first time).
        self.val_cost_guess = float(val_cost_guess)
        self.clock = time.monotonic  # replaced by a fake clock in tests
        self.wall_clock = time.time  # for the deadline only (the budget is measured on the monotonic clock)
        self.elapsed_before = 0.0  # training seconds of earlier sessions (resume)
        self.planned_steps: int | None = None  # the run as configured
        self.limit: int | None = None  # the shortened step limit, once the budget binds
        self.stopped_on_budget = False
        self.s_per_step: float | None = None
        self.s_per_val: float | None = None
        self.steps_done = 0  # the global step reached (summary)
        self.late_s = 0.0  # how far past the budget the minimum training time takes the run, at least
        self.message = ""

    @property
    def step_limit(self) -> int | None:
        """The step this run stops at when the budget shortened it (bev.schedule.run_length reads it)."""
        return self.limit if self.budget is not None or self.deadline is not None else None

    # ------------------------------------------------------------------ state across resumes
    def state_dict(self) -> dict[str, Any]:
        return {
            "elapsed": self.elapsed(),
            "planned_steps": self.planned_steps,
            "limit": self.limit,
            "stopped_on_budget": self.stopped_on_budget,
            "message": self.message,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.elapsed_before = float(state.get("elapsed", 0.0))
        self.planned_steps, self.limit = state.get("planned_steps"), state.get("limit")
        self.stopped_on_budget = bool(state.get("stopped_on_budget", False))
        self.message = state.get("message", "")

    def elapsed(self) -> float:
        start = getattr(self, "_start", None)
        return self.elapsed_before + (self.clock() - start if start is not None else 0.0)

    def summary(self) -> dict[str, Any] | None:
        """The record bev.train writes to metrics.json (None without a budget)."""
        if self.budget is None:
            return None
        deadline = {"deadline": _clock_time(self.deadline)} if self.deadline is not None else {}
        return {
            "budget_s": round(self.budget, 3),
            **deadline,
            "reserved_after_s": round(self._reserve(), 1),
            "used_s": round(self.elapsed(), 1),
            "planned_steps": self.planned_steps,
            "steps": self.steps_done,
            "step_limit": self.limit,
            "shortened": self.limit is not None and self.limit < (self.planned_steps or 0),
            "stopped_on_budget": self.stopped_on_budget,
            "s_per_step": self.s_per_step and round(self.s_per_step, 4),
            "s_per_validation": self.s_per_val and round(self.s_per_val, 2),
            "min_train_s": self.min_train_s,
            "startup_s": self.startup_s and round(self.startup_s, 1),
            "late_s": round(self.late_s, 1),
            "message": self.message,
        }

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer, pl_module) -> None:
        if self.deadline is not None:
            self._budget_from_deadline()
        if self.budget is None:
            return
        self._start = self.clock()
        self._session_step0, self._session_epoch0 = trainer.global_step, trainer.current_epoch
        self._mark = None  # (time, validation seconds so far, step) once the unmeasured steps are done
        self._measured = False  # whether the first plan was made (later ones follow validations)
        self._val_s, self._val_n, self._val_start = 0.0, 0, None
        self._floor, self.steps_done = None, trainer.global_step
        if self.planned_steps is None:
            self.planned_steps = int(trainer.estimated_stepping_batches)
        self._cap = self._last_step(trainer)
        if self.limit is not None and trainer.global_step >= self.limit:
            self._resume_at_limit(trainer)
        if trainer.should_stop or self.min_train_s:  # the minimum is trained whatever the time left
            return
        if self.deadline is not None and self.wall_clock() >= self.deadline:
            self._stop(trainer, f"the deadline {_clock_time(self.deadline)} passed before training started")
        elif self.elapsed() >= self.budget:
            self._stop(
                trainer, f"time budget {_fmt(self.budget)} already spent ({_fmt(self.elapsed())} in earlier sessions)"
            )

    def _resume_at_limit(self, trainer) -> None:
        """Resumed at the end of a shortened run: with a deadline (this session's own time) train on towards
        the planned steps, planned afresh (bev.lit stretches the LR schedule to them); else nothing is left."""
        if self.deadline is None or self.limit >= self.planned_steps or self._cap <= trainer.global_step:
            trainer.should_stop = True
            return
        _announce(
            trainer,
            f"resumed at step {trainer.global_step}, where the last session's time ran out: training on towards "
            f"step {self._cap} of the {self.planned_steps} planned until the deadline {_clock_time(self.deadline)}",
        )
        self.limit = self._cap if self._cap < self.planned_steps else None  # bev.lit stretches the schedule to it
        self.stopped_on_budget = False

    def _last_step(self, trainer) -> int:
        """The last step this session can reach: the planned steps, or fewer in a run resumed after a stop
        inside an epoch (Lightning resumes at the next epoch)."""
        epochs = trainer.max_epochs
        if epochs is None or epochs < 0 or not trainer.num_training_batches:
            return self.planned_steps
        per_epoch = math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches)
        return min(self.planned_steps, trainer.global_step + (epochs - trainer.current_epoch) * per_epoch)

    def _budget_from_deadline(self) -> None:
        """The budget becomes what earlier sessions used plus the time left until the deadline
        (the smaller of that and `budget` when both are set): start-up before training counts."""
        until = self.elapsed_before + self.deadline - self.wall_clock()
        self.budget = until if self.configured_budget is None else min(self.configured_budget, until)
        self.budget = max(self.budget, 1e-3)  # a deadline already passed: stopped at once below

    def on_validation_start(self, trainer, pl_module) -> None:
        if self.budget is not None and not trainer.sanity_checking and getattr(self, "_start", None) is not None:
            self._val_start = self.clock()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.budget is None or trainer.sanity_checking or getattr(self, "_val_start", None) is None:
            return
        self._val_s += self.clock() - self._val_start
        self._val_n += 1
        self._val_start = None
        if self._mark is not None and not trainer.should_stop:
            self._plan(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.budget is None or getattr(self, "_start", None) is None or self._floor is not None:
            return
        # The session's first step: start-up is over, the minimum training time counts from here.
        self._floor = self.elapsed() + self.min_train_s
        if self.reserve_startup and self.process_start is not None:
            self.startup_s = max(self.wall_clock() - self.process_start, 0.0)
        left = self.budget - self.elapsed()
        if self.deadline is not None:  # the budget stops at 0 when the deadline has passed: how long ago counts
            left = min(left, self.deadline - self.wall_clock())
        late = self.min_train_s + self._reserve() - left
        if self.min_train_s and late > 0:
            self.late_s = late
            _announce(trainer, self._late_message(max(left, 0.0), late))

    def _late_message(self, left: float, late: float) -> str:
        """What the minimum training time does to the deadline (or budget), and why."""
        until = f"the deadline {_clock_time(self.deadline)}" if self.deadline is not None else "the time budget"
        startup = (
            f" after a start-up of {_fmt(self.startup_s)} (loading and indexing the data)" if self.startup_s else ""
        )
        kept = f" and {_fmt(self._reserve())} kept for after training" if self._reserve() else ""
        return (
            f"{_fmt(left)} are left until {until}{startup}: training gets its minimum of {_fmt(self.min_train_s)} "
            f"from this first step{kept}, so the run ends at least {_fmt(late)} past {until}. "
            f"Give it more time (a later deadline, or a larger budget) or a faster machine"
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.budget is None or getattr(self, "_start", None) is None:
            return
        self.steps_done = trainer.global_step
        if self._mark is None and self._warmed_up(trainer, batch_idx):
            self._mark = (self.clock(), self._val_s, trainer.global_step)
        elif self._mark is not None and not self._measured and self._measured_enough(trainer):
            self._measured = True
            self._plan(trainer)
        if self.limit is not None and trainer.global_step >= self.limit:
            trainer.should_stop = True  # Lightning validates and checkpoints when a run stops early,
            trainer.check_val_every_n_epoch = 1  # also in an epoch check_val_every_n_epoch would skip
        elif trainer.strategy.reduce_boolean_decision(self.elapsed() >= self._end(), all=False):
            self._stop(
                trainer,
                f"time budget {_fmt(self.budget)} spent at step {trainer.global_step} of "
                f"{self.limit or self.planned_steps}: stopped before the LR schedule finished",
            )

    def _warmed_up(self, trainer, batch_idx: int) -> bool:
        """Whether steps from now on are measured (see skip_steps, skip_epochs; when the minimum training time
        binds from the first step, the skipped epochs would outlast it: skip_steps only)."""
        if self.skip_epochs and not self.late_s:
            return trainer.current_epoch - self._session_epoch0 >= self.skip_epochs and batch_idx + 1 >= self.skip_steps
        return trainer.global_step - self._session_step0 >= self.skip_steps

    def _measured_enough(self, trainer) -> bool:
        """Whether to plan now: after measure_steps steps, or when the minimum training time binds (the run ends
        within it), after an eighth of it and 2 steps, so that the LR schedule can still end with the run."""
        t0, _, step0 = self._mark
        steps = trainer.global_step - step0
        if steps >= self.measure_steps:
            return True
        return bool(self.late_s) and steps >= 2 and self.clock() - t0 >= self.min_train_s / 8

    # ------------------------------------------------------------------ planning
    def _measure(self, trainer) -> None:
        t0, val0, step0 = self._mark
        steps = max(trainer.global_step - step0, 1)
        self.s_per_step = max((self.clock() - t0) - (self._val_s - val0), 1e-6) / steps
        if self._val_n:
            self.s_per_val = self._val_s / self._val_n
        else:  # not measured yet: a guess, corrected after the first one
            self.s_per_val = _val_batches(trainer) * self.s_per_step * self.val_cost_guess

    def _steps_between_validations(self, trainer) -> float:
        batches = trainer.num_training_batches
        every = (
            trainer.val_check_batch
            if trainer.val_check_batch and trainer.val_check_batch < batches
            else batches * (trainer.check_val_every_n_epoch or 1)
        )
        return max(float(every) / trainer.accumulate_grad_batches, 1.0)

    def _plan(self, trainer) -> None:
        """Set the step limit to what fits in the budget (never above the plan) when it moves by > 1%."""
        self._measure(trainer)
        step = trainer.global_step
        current = self.limit or self._cap
        left = self._end(self.margin) - self.elapsed()
        per_step = self.s_per_step + self.s_per_val / self._steps_between_validations(trainer)
        # + the last validation; at least 2 more steps: the next step's LR is already set
        fits = min(step + max(int((left - self.s_per_val) / per_step), 2), self._cap)
        fits = trainer.strategy.broadcast(fits, src=0)  # every process must stop at the same step
        if self.limit is None and fits >= current or abs(fits - current) <= max(1, 0.01 * self.planned_steps):
            return
        self.limit = fits
        ended = [end_schedule_at(s, fits, pivot=s.last_epoch) for s in step_schedulers(trainer)]
        sched = (
            "the LR schedule now ends there"
            if ended and all(ended)
            else "the LR schedule's length cannot change (use bev.schedule.OneCycle or CosineAnnealingLR): left as is"
            if ended
            else "no per-step LR schedule"
        )
        self.message = (
            f"{self._what_binds()}: measured {self.s_per_step:.2f} s/step and {self.s_per_val:.0f} s per validation, "
            f"training {fits} of {self.planned_steps} planned steps ({100 * fits / self.planned_steps:.0f}%); {sched}"
        )
        _announce(trainer, self.message)

    def _what_binds(self) -> str:
        """The time limit the plan follows: the budget (less the reserve), or the minimum training time."""
        if (self._floor or 0.0) > self.budget * (1 - self.margin) - self._reserve():
            return f"minimum training time {_fmt(self.min_train_s)} from the first step (the time budget leaves less)"
        until = f" (until the deadline {_clock_time(self.deadline)})" if self.deadline is not None else ""
        if self._reserve():
            until += f", {_fmt(self._reserve())} of it kept for after training"
        return f"time budget {_fmt(self.budget)}{until}"

    def _reserve(self) -> float:
        """Seconds kept free at the end of the budget: reserve_validations measured validations, and with
        reserve_startup the measured start-up."""
        return self.reserve_validations * (self.s_per_val or 0.0) + (self.startup_s or 0.0)

    def _end(self, margin: float = 0.0) -> float:
        """The elapsed() at which training ends: the budget less `margin` of it and the reserve, but not
        before the session's first step + min_train_s."""
        return max(self.budget * (1 - margin) - self._reserve(), self._floor or 0.0)

    def _stop(self, trainer, message: str) -> None:
        trainer.should_stop = True
        self.stopped_on_budget = True
        self.message = message
        _announce(trainer, message)


def _process_start() -> float | None:
    """When this process started (Unix seconds), from Linux's /proc; None elsewhere."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            ticks = float(f.read().rpartition(")")[2].split()[19])  # field 22: start time in clock ticks after boot
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _val_batches(trainer) -> float:
    """Validation batches per validation (within limit_val_batches); before the first validation
    Lightning has not counted them, so the datamodule's val loader is (no worker starts until iterated)."""
    n = trainer.num_val_batches
    n = sum(n) if isinstance(n, list) else n
    if n:
        return float(n)
    try:
        n = len(trainer.datamodule.val_dataloader())
    except (AttributeError, TypeError, NotImplementedError):  # no datamodule, or a loader without a length
        return 0.0
    limit = trainer.limit_val_batches
    return float(min(n, limit) if isinstance(limit, int) else n * limit)


def _clock_time(unix_seconds: float) -> str:
    return datetime.datetime.fromtimestamp(unix_seconds).isoformat(timespec="seconds")


def _fmt(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _announce(trainer, message: str) -> None:
    if trainer.is_global_zero:
        log.warning(message)  # Hydra shows it on the console and keeps it in <run>/train.log
