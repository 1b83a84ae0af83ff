"""LR schedules and the one way their length changes (a time budget shortens a run; a resumed run
with more epochs lengthens it)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LRScheduler


def _cos_anneal(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)


class OneCycle(LRScheduler):
    """The one-cycle policy (Smith & Topin), as torch's OneCycleLR with cosine annealing: the LR rises
    from max_lr/div_factor to max_lr over the first pct_start of the steps, then falls to
    max_lr/div_factor/final_div_factor, while the momentum (or Adam's beta1) moves the other way
    between max_momentum and base_momentum. Unlike OneCycleLR, its length can change mid-run
    (`end_at`), so a run shortened or lengthened after it started still ends on the final LR."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_lr: float,
        total_steps: int,
        pct_start: float = 0.3,
        div_factor: float = 25.0,
        final_div_factor: float = 1e4,
        cycle_momentum: bool = True,
        base_momentum: float = 0.85,
        max_momentum: float = 0.95,
        last_epoch: int = -1,
    ):
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"OneCycle needs a positive integer total_steps, got {total_steps!r}")
        if not 0.0 < pct_start < 1.0:
            raise ValueError(f"OneCycle pct_start must be in (0, 1), got {pct_start}")
        if cycle_momentum and not {"momentum", "betas"} & set(optimizer.defaults):
            raise ValueError(f"{type(optimizer).__name__} has no momentum or betas: set cycle_momentum=false")
        self.total_steps = total_steps
        self.peak_step = float(pct_start * total_steps) - 1  # where the LR is max_lr
        self.lrs = (max_lr / div_factor, max_lr, max_lr / div_factor / final_div_factor)
        self.momenta = (max_momentum, base_momentum, max_momentum) if cycle_momentum else None
        super().__init__(optimizer, last_epoch)

    def end_at(self, total_steps: int, pivot: int) -> None:
        """End the schedule at `total_steps`: its remaining part after step `pivot` is resampled to the
        new length (pivot = the current step keeps the steps taken; -1 rescales it all)."""
        if total_steps - 1 <= pivot:
            raise ValueError(f"cannot end a schedule at step {total_steps} from step {pivot}: it needs one more step")
        if self.total_steps - 1 > pivot:  # else it had ended: the rest stays on the final LR
            scale = (total_steps - 1 - pivot) / (self.total_steps - 1 - pivot)
            self.peak_step = pivot + (self.peak_step - pivot) * scale
        self.total_steps = int(total_steps)

    def _position(self) -> tuple[int, float]:
        """(phase, fraction of it done) at the current step; past the end it stays on the final LR."""
        step = min(self.last_epoch, self.total_steps - 1)
        if step <= self.peak_step and self.peak_step > 0:
            return 0, step / self.peak_step
        return 1, (step - self.peak_step) / (self.total_steps - 1 - self.peak_step)

    def get_lr(self) -> list[float]:
        phase, pct = self._position()
        if self.momenta is not None:
            momentum = _cos_anneal(self.momenta[phase], self.momenta[phase + 1], pct)
            for group in self.optimizer.param_groups:
                if "betas" in group:
                    group["betas"] = (momentum, *group["betas"][1:])
                else:
                    group["momentum"] = momentum
        lr = _cos_anneal(self.lrs[phase], self.lrs[phase + 1], pct)
        return [lr for _ in self.optimizer.param_groups]


def schedule_length(sched: Any) -> int | None:
    """The number of steps a schedule whose length can change runs for (OneCycle, CosineAnnealingLR), else None."""
    if isinstance(sched, OneCycle):
        return sched.total_steps
    if isinstance(sched, CosineAnnealingLR):
        return int(sched.T_max)
    return None


def end_schedule_at(sched: Any, total_steps: int, pivot: int) -> bool:
    """Make a schedule end at `total_steps` (see OneCycle.end_at); False for one whose length is fixed.
    CosineAnnealingLR's recursive form continues from the current LR to eta_min at the new T_max."""
    if isinstance(sched, OneCycle):
        sched.end_at(total_steps, pivot)
        return True
    if isinstance(sched, CosineAnnealingLR):
        sched.T_max = int(total_steps)
        return True
    return False


def step_schedulers(trainer) -> list[Any]:
    """The trainer's per-step LR schedulers."""
    return [c.scheduler for c in trainer.lr_scheduler_configs if c.interval == "step"]


def run_length(trainer) -> int:
    """The optimiser steps this run will train: the configured ones, or fewer where a callback (the
    time budget) set a `step_limit`."""
    limits = [getattr(c, "step_limit", None) for c in trainer.callbacks]
    return min([int(trainer.estimated_stepping_batches)] + [int(n) for n in limits if n is not None])
