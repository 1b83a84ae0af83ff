"""Speed settings: precision "auto", channels_last encoders, and the time budget (fake clock)."""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bev.callbacks import TimeBudget, parse_deadline, parse_duration
from bev.lit import fused_default, rescale_schedule
from bev.models import BevEncoder, CameraEncoder
from bev.utils import precision as P


# ----------------------------------------------------------------------------- precision
@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"avx2", "avx512f", "avx512_bf16"}, ("bf16-mixed", "AVX512-BF16")),
        ({"avx512_bf16", "amx_bf16", "amx_tile"}, ("bf16-mixed", "AMX-BF16")),
        ({"fp", "asimd", "bf16"}, ("bf16-mixed", "Arm BF16")),
        ({"avx", "avx2", "fma"}, ("32-true", "no native bf16")),
        (set(), ("32-true", "no native bf16")),
    ],
)
def test_auto_precision_on_cpu(flags, expected, monkeypatch):
    monkeypatch.setattr(P, "_cpu_flags", lambda: flags)
    precision, reason = P.resolve_precision("auto", "cpu")
    assert precision == expected[0] and expected[1] in reason


@pytest.mark.parametrize("bf16, expected", [(True, "bf16-mixed"), (False, "16-mixed")])
def test_auto_precision_on_gpu(bf16, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some GPU")
    assert P.resolve_precision("auto", "gpu")[0] == expected
    assert P.resolve_precision("auto", "auto")[0] == expected


def test_explicit_precision_is_kept(monkeypatch):
    monkeypatch.setattr(P, "_cpu_flags", lambda: {"avx512_bf16"})
    assert P.resolve_precision("32-true", "cpu") == ("32-true", "as configured")
    assert P.resolve_precision("bf16-mixed", "cpu")[0] == "bf16-mixed"


def test_cpu_flags_are_read_from_proc_cpuinfo(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu avx2 avx512_bf16\n"
    )
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(info if p == "/proc/cpuinfo" else p, *a, **k))
    assert P._cpu_flags() == {"fpu", "avx2", "avx512_bf16"}
    assert P.cpu_bf16_support() == "AVX512-BF16"


# ----------------------------------------------------------------------------- channels_last
@pytest.mark.parametrize(
    "flags, cuda, expected",
    [
        ({"avx512_bf16"}, False, True),
        ({"amx_bf16"}, False, True),
        ({"avx2"}, False, False),
        (set(), True, True),
    ],
)
def test_auto_channels_last_follows_the_hardware(flags, cuda, expected, monkeypatch):
    monkeypatch.setattr(P, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert P.resolve_channels_last("auto") is expected
    assert P.resolve_channels_last(False) is False and P.resolve_channels_last(True) is True
    enc = BevEncoder(8, 2, widths=(16, 16, 32), blocks=1, channels_last="auto")
    assert enc.channels_last is expected
    assert enc.stem[0].weight.is_contiguous(memory_format=torch.channels_last) is expected
    with pytest.raises(ValueError, match="true, false or auto"):
        P.resolve_channels_last("yes")


@pytest.mark.filterwarnings("error")  # no hazard warning for the models that are fine
def test_auto_channels_last_keeps_nchw_for_narrow_strided_1x1_convolutions(monkeypatch):
    # oneDNN's NHWC weight gradient of a 1x1 stride-2 convolution with < 16 input channels crashes
    # or is wrong on x86 CPUs (uxlfoundation/oneDNN#6035): such encoders keep NCHW under "auto".
    monkeypatch.setattr(P, "_cpu_flags", lambda: {"avx512_bf16"})
    assert BevEncoder(8, 2, widths=(16, 16, 32), blocks=1, channels_last="auto").channels_last is True
    assert CameraEncoder(
        5, 7, backbone="small", widths=(16, 32, 48, 64, 96), mid_channels=16, channels_last="auto"
    ).channels_last
    with pytest.warns(UserWarning, match="keeps NCHW.*oneDNN#6035") as record:
        narrow = CameraEncoder(5, 7, backbone="small", widths=(8, 8, 16, 16, 16), mid_channels=16, channels_last="auto")
    assert narrow.channels_last is False and not narrow.trunk.stem[0].weight.is_contiguous(
        memory_format=torch.channels_last
    )
    assert "trunk." in str(record[0].message)  # names the layer
    assert P.nhwc_hazards(BevEncoder(8, 2, widths=(8, 8, 16), blocks=1)) == [
        "layer2.0.downsample.0",
        "layer3.0.downsample.0",
    ]
    with pytest.warns(
        UserWarning, match="channels_last=true as configured"
    ):  # an explicit choice is kept, with the warning
        assert BevEncoder(8, 2, widths=(8, 8, 16), blocks=1, channels_last=True).channels_last is True


def test_channels_last_encoders_compute_the_same_function():
    torch.manual_seed(0)
    images, bev = torch.randn(2, 3, 64, 96), torch.randn(1, 8, 24, 24)
    outs = {}
    for cl in (False, True):
        torch.manual_seed(1)
        cam = CameraEncoder(5, 7, backbone="small", widths=(8, 8, 16, 16, 16), mid_channels=16, channels_last=cl).eval()
        torch.manual_seed(2)
        enc = BevEncoder(8, 2, widths=(8, 8, 16), blocks=1, channels_last=cl).eval()
        outs[cl] = (cam(images), enc(bev))
        if cl:
            assert cam.head.weight.is_contiguous(memory_format=torch.channels_last)
    for a, b in zip(outs[False], outs[True]):
        assert b.is_contiguous()  # callers see the default layout
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # Same parameter names and shapes: checkpoints load either way.
    sd = {k: v.shape for k, v in CameraEncoder(5, 7, backbone="small", channels_last=True).state_dict().items()}
    assert sd == {k: v.shape for k, v in CameraEncoder(5, 7, backbone="small").state_dict().items()}


# ----------------------------------------------------------------------------- optimiser
@pytest.mark.parametrize(
    "factory, device, expected",
    [
        (partial(torch.optim.Adam, lr=1e-3), "cuda", {"fused": True}),
        (partial(torch.optim.AdamW, lr=1e-3, weight_decay=1e-2), "cuda", {"fused": True}),
        (partial(torch.optim.Adam, lr=1e-3), "cpu", {}),  # CPU runs stay as measured (fused: 1.00-1.04x there)
        (partial(torch.optim.Adam, lr=1e-3, fused=False), "cuda", {}),  # the config's choice wins
        (partial(torch.optim.Adam, lr=1e-3, foreach=True), "cuda", {}),
        (partial(torch.optim.LBFGS, lr=1.0), "cuda", {}),  # no fused kernel
        (partial(torch.optim.Adagrad, lr=0.1), "cuda", {}),  # its fused kernel is CPU-only
        (lambda params: torch.optim.SGD(params, lr=0.1), "cuda", {}),  # not a class: its keywords are unknown
    ],
)
def test_optimizers_on_cuda_are_fused_unless_configured(factory, device, expected):
    assert fused_default(factory, device) == expected
    assert fused_default(factory, device, "bf16-mixed") == expected
    assert fused_default(factory, device, "16-mixed") == {}  # fp16's scaled gradients could not be clipped


def test_configure_optimizers_builds_the_configured_optimizer_on_cpu():
    from bev.lit import BEVLitModule

    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 1, 1))
    net.num_classes = 1
    opt = BEVLitModule(
        net, optimizer=partial(torch.optim.Adam, lr=2e-3), object_classes=["vehicle"]
    ).configure_optimizers()
    assert isinstance(opt, torch.optim.Adam) and opt.param_groups[0]["lr"] == 2e-3
    assert not opt.param_groups[0]["fused"] and len(opt.param_groups[0]["params"]) == 4


# ----------------------------------------------------------------------------- time budget
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
        self, clock: FakeClock, step_s: float = 1.0, val_s: float = 0.25, first_epoch_step_s: float | None = None
    ):
        super().__init__()
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

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=1e-2, total_steps=int(self.trainer.estimated_stepping_batches), pct_start=0.1
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loaders():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(80, 4, generator=g)
    ds = TensorDataset(x, x.sum(1, keepdim=True))
    return DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)), DataLoader(
        ds, batch_size=8
    )


def fit(budget=None, epochs=5, step_s=1.0, ckpt_path=None, callback=None, val_every=1, first_epoch_step_s=None, **kw):
    """20 steps per epoch, 10 validation batches; returns (module, trainer, callback)."""
    L.seed_everything(0, verbose=False)
    clock = FakeClock()
    model = Tiny(clock, step_s, first_epoch_step_s=first_epoch_step_s)
    callbacks = []
    if budget is not None:
        callback = TimeBudget(budget, measure_steps=10, skip_steps=2, **kw)
    if callback is not None:
        callback.clock = clock
        callbacks.append(callback)
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        check_val_every_n_epoch=val_every,
    )
    train, val = loaders()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 4-wide linear layer: more threads only wait on each other
    try:
        trainer.fit(model, train, val, ckpt_path=ckpt_path)
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
    assert f"of {s['planned_steps']} planned steps" in s["message"] and "compressed" in s["message"]


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


def test_skipped_epochs_that_alone_overrun_are_planned_early():
    # The first epoch at 8 s/step would take 160 s of a 140 s budget: waiting for the second epoch
    # to measure would end on the hard stop with the schedule unfinished. Planned at the first
    # epoch's pace instead, the run is shortened with the schedule compressed.
    model, trainer, cb = fit(budget=140, margin=0.0, first_epoch_step_s=8.0, skip_epochs=1)
    s = cb.summary()
    assert s["shortened"] and not s["stopped_on_budget"] and cb.limit < 20 and s["used_s"] <= 140
    assert model.lrs[-1] == pytest.approx(1e-2 / 25 / 1e4, rel=1e-6)


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


def test_rescale_schedule_keeps_the_past_and_ends_on_the_final_lr():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=200, pct_start=0.1)
    lrs = []
    for _ in range(50):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    before = sched.get_last_lr()[0]
    assert rescale_schedule(sched, 120, pivot=sched.last_epoch)
    assert sched.get_lr()[0] == pytest.approx(before)  # recomputing the current step: no jump
    for _ in range(69):  # the LR of step 119, the last of 120
        opt.step()
        sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(0.1 / 25 / 1e4)
    assert not rescale_schedule(torch.optim.lr_scheduler.StepLR(opt, 10), 100, pivot=0)


@pytest.mark.e2e
def test_bev_train_records_precision_and_the_time_budget(synthetic_root, tmp_path, monkeypatch, capsys):
    import json

    from helpers.cli import TINY, train_cli

    args = [
        *TINY,
        "trainer.max_epochs=3",
        "callbacks.time_budget.budget=0.001",
        "callbacks.bev_png.every_n_steps=0",
        f"data.dataroot={synthetic_root}",
        f"hydra.run.dir={tmp_path}",
    ]
    assert train_cli(args, monkeypatch) == 0
    rec = json.loads((tmp_path / "metrics.json").read_text())
    assert rec["precision"] in ("32-true", "bf16-mixed")  # "auto", resolved for this CPU
    assert f"precision: {rec['precision']}" in capsys.readouterr().out
    tb = rec["time_budget"]
    assert tb["budget_s"] == 0.001 and tb["planned_steps"] == 3 and tb["stopped_on_budget"]
    assert rec["global_step"] == 1 and "spent at step 1 of 3" in tb["message"]
