"""bev.schedule: OneCycle against torch's OneCycleLR, and changing a schedule's length mid-run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bev.schedule import OneCycle, end_schedule_at, schedule_length


def _run(sched_cls, opt_cls, steps, **kw):
    """(lr, momentum) of every step of a schedule made as `sched_cls(opt, **kw)`."""
    opt = opt_cls([nn.Parameter(torch.zeros(1))], lr=1e-3, **({"momentum": 0.9} if opt_cls is torch.optim.SGD else {}))
    sched = sched_cls(opt, **kw)
    out = []
    for i in range(steps):
        group = opt.param_groups[0]
        out.append((group["lr"], group["betas"][0] if "betas" in group else group["momentum"]))
        opt.step()
        if i < steps - 1:
            sched.step()
    return out


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
@pytest.mark.parametrize("total, pct", [(3840, 0.1), (37, 0.3), (10, 0.05), (1, 0.1)])
def test_one_cycle_equals_torch_one_cycle_lr(opt_cls, total, pct):
    kw = dict(max_lr=3e-3, total_steps=total, pct_start=pct)
    ours = _run(OneCycle, opt_cls, total, **kw)
    assert ours == _run(torch.optim.lr_scheduler.OneCycleLR, opt_cls, total, **kw)  # exactly, LR and momentum


def test_end_at_keeps_the_past_and_ends_on_the_final_lr():
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = OneCycle(opt, max_lr=0.1, total_steps=200, pct_start=0.1)
    past = []
    for _ in range(50):
        past.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    before = sched.get_last_lr()[0]
    assert end_schedule_at(sched, 120, pivot=sched.last_epoch) and schedule_length(sched) == 120
    assert sched.get_lr()[0] == pytest.approx(before)  # the current step's LR does not jump
    lrs = [before]
    for _ in range(69):  # to the LR of step 119, the last of 120
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    assert lrs[-1] == pytest.approx(0.1 / 25 / 1e4) and all(a >= b for a, b in zip(lrs, lrs[1:]))
    opt.step()
    sched.step()  # past the end it stays on the final LR (torch's OneCycleLR raises)
    assert sched.get_last_lr()[0] == pytest.approx(0.1 / 25 / 1e4)
    with pytest.raises(ValueError, match="needs one more step"):
        sched.end_at(100, pivot=sched.last_epoch)


def test_a_schedule_of_fixed_length_is_reported_not_changed():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, 10)
    assert schedule_length(step_lr) is None and not end_schedule_at(step_lr, 100, pivot=0)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)
    assert end_schedule_at(cosine, 80, pivot=0) and schedule_length(cosine) == 80


def test_bad_one_cycle_settings_are_named():
    opt = torch.optim.Adagrad([nn.Parameter(torch.zeros(1))])
    with pytest.raises(ValueError, match="cycle_momentum=false"):
        OneCycle(opt, max_lr=0.1, total_steps=10)
    with pytest.raises(ValueError, match="positive integer total_steps"):
        OneCycle(torch.optim.AdamW([nn.Parameter(torch.zeros(1))]), max_lr=0.1, total_steps=0)


def test_run_length_is_the_budget_limit_only_while_a_budget_is_set():
    from types import SimpleNamespace

    from bev.callbacks import TimeBudget
    from bev.schedule import run_length

    shortened = TimeBudget(60)
    shortened.load_state_dict({"limit": 40, "planned_steps": 100})  # resumed after the budget bound
    assert run_length(SimpleNamespace(estimated_stepping_batches=100, callbacks=[shortened])) == 40
    # Resumed with budget=null: the run goes on to its configured end, so bev.lit stretches the schedule there.
    released = TimeBudget(None)
    released.load_state_dict({"limit": 40, "planned_steps": 100})
    assert run_length(SimpleNamespace(estimated_stepping_batches=100, callbacks=[released])) == 100
