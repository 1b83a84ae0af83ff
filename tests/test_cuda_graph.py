"""model.cuda_graph (bev.cuda_graph) on the CPU: the captured step's plumbing, with an eager stand-in for
torch.cuda's graph calls. A stand-in replay reruns the captured step function on the captured batch, so a
batch that was not copied in, numbers a schedule changed but the graph cannot see, or an update run twice
show up as a run that differs from the eager one. The capture itself runs in tests/test_train_cuda.py."""
from __future__ import annotations

import functools
import json

import pytest
import torch

from bev import cuda_graph
from bev.cuda_graph import GraphOptimizer, StepGraph, graph_optimizer_kwargs
from helpers.cli import TINY, read_csv_metric, train_cli


class EagerStandIn:
    """torch.cuda's stream and graph calls, eagerly: the capture runs the step once (as the replay right after a
    real capture does) and keeps its outputs; each later replay reruns it and writes into those outputs."""

    capturable = False  # CPU optimisers have no capturable step
    check = staticmethod(lambda device: None)

    def __init__(self):
        self.calls, self.fn, self.outputs, self.fresh = [], None, None, False

    def eager(self, fn):
        self.calls.append("eager")
        return fn()

    def capture(self, fn):
        self.calls.append("capture")
        self.fn, self.outputs, self.fresh = fn, fn(), True
        return self.outputs

    def replay(self):
        if self.fresh:  # the capture's own run stands for this replay
            self.fresh = False
            return
        self.calls.append("replay")
        for mine, new in zip(self.outputs, self.fn()):
            if mine is not None:
                mine.copy_(new)


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(cuda_graph, "BACKEND", EagerStandIn)


def toy(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=20)


def batches(n, size=3):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(size, 4, generator=g), "y": torch.randn(size, 1, generator=g), "tag": "any"} for _ in range(n)]


def step_fn(model, opt):
    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        return (loss.detach(),)
    return step


def test_step_graph_trains_as_the_eager_loop_with_the_schedule_and_an_odd_batch(stand_in):
    data = batches(8)
    data[6] = batches(1, size=2)[0]  # another shape after the capture: run eagerly
    model, opt, sched = toy()
    eager_losses = []
    for b in data:
        eager_losses.append(float(step_fn(model, opt)(b)[0]))
        sched.step()
    g_model, g_opt, g_sched = toy()
    gopt = GraphOptimizer(g_opt)
    gopt.prepare()
    graph = StepGraph(step_fn(g_model, g_opt))
    losses = []
    for b in data:
        gopt.sync()
        losses.append(float(graph(b)[0]))
        g_sched.step()
    assert graph.backend.calls == ["eager"] * 3 + ["capture"] + ["replay"] * 3
    assert graph.replays == 3 and graph.eager_after_capture == 1  # batches 4, 5 and 7; 6 is the odd one
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    for p, q in zip(model.parameters(), g_model.parameters()):
        torch.testing.assert_close(p, q)
    assert torch.equal(graph.static["x"], data[7]["x"]) and graph.static["tag"] == "any"


def test_schedule_numbers_reach_the_tensors_the_graph_reads(stand_in):
    model, opt, sched = toy()
    gopt = GraphOptimizer(opt)
    gopt.prepare()
    group = opt.param_groups[0]
    lr, betas = group["lr"], group["betas"]
    assert torch.is_tensor(lr) and all(torch.is_tensor(b) for b in betas)
    for _ in range(3):
        sched.step()  # OneCycleLR writes lr in place and replaces betas by numbers (cycle_momentum)
        wrote = group["betas"][0]
        assert not torch.is_tensor(wrote)
        gopt.sync()
        assert group["lr"] is lr and group["betas"][0] is betas[0] and float(betas[0]) == pytest.approx(wrote)
    assert float(lr) == pytest.approx(sched.get_last_lr()[0]) and float(lr) > 1e-2 / 25  # rising from max_lr / 25
    assert float(betas[0]) < 0.95  # falling from max_momentum


def test_a_changed_number_the_graph_cannot_see_is_refused(stand_in):
    _, opt, _ = toy()
    gopt = GraphOptimizer(opt)
    gopt.prepare()
    opt.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(RuntimeError, match="weight_decay 0.1 -> 0.5.*model.cuda_graph=false"):
        gopt.sync()


def test_a_momentum_schedule_on_rmsprop_is_refused(stand_in):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-2, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)  # cycles momentum
    gopt = GraphOptimizer(opt)
    gopt.prepare()
    sched.step()
    with pytest.raises(RuntimeError, match="momentum 0.95 -> 0.9"):
        gopt.sync()


def test_checkpoint_state_is_plain_and_the_live_optimiser_untouched(stand_in):
    model, opt, _ = toy()
    gopt = GraphOptimizer(opt)
    gopt.prepare()
    step_fn(model, opt)(batches(1)[0])
    live_step = next(iter(opt.state.values()))["step"]
    state = opt.state_dict()
    gopt.plain(state)
    group = state["param_groups"][0]
    assert isinstance(group["lr"], float) and all(isinstance(b, float) for b in group["betas"])
    assert group["foreach"] is None and not group["capturable"]  # as the config built it
    assert next(iter(opt.state.values()))["step"] is live_step and torch.is_tensor(opt.param_groups[0]["lr"])
    fresh_model, fresh, _ = toy()
    fresh.load_state_dict(state)
    step_fn(fresh_model, fresh)(batches(1)[0])  # resumes in an eager run


def test_graph_optimizer_kwargs():
    assert graph_optimizer_kwargs(functools.partial(torch.optim.Adam, lr=1e-3)) == {"foreach": True}
    assert graph_optimizer_kwargs(functools.partial(torch.optim.AdamW, fused=True)) == {}  # the config chose
    with pytest.raises(ValueError, match="capturable step.*SGD"):
        graph_optimizer_kwargs(functools.partial(torch.optim.SGD, lr=1e-3))


GRAPH_RUN = [*TINY, "data.batch_size=1", "trainer.max_epochs=3", "trainer.precision=32-true"]


def run_losses(args, synthetic_root, run, monkeypatch) -> tuple[list[float], dict]:
    assert train_cli([*args, f"data.dataroot={synthetic_root}", f"hydra.run.dir={run}"], monkeypatch) == 0
    return read_csv_metric(run, "train/loss_step"), json.loads((run / "metrics.json").read_text())


def test_bev_train_graphed_trains_as_eager_and_resumes_either_way(stand_in, synthetic_root, tmp_path, monkeypatch):
    eager, rec = run_losses(GRAPH_RUN, synthetic_root, tmp_path / "eager", monkeypatch)
    graphed, grec = run_losses([*GRAPH_RUN, "model.cuda_graph=true"], synthetic_root, tmp_path / "graph", monkeypatch)
    assert len(graphed) == len(eager) == grec["global_step"] == rec["global_step"] == 9  # 3 warm-up, capture, 5 replays
    assert graphed == pytest.approx(eager, rel=1e-4)
    assert grec["metrics"]["val/iou"] == pytest.approx(rec["metrics"]["val/iou"], abs=0.01)
    last = tmp_path / "graph" / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    group, (sched,) = ckpt["optimizer_states"][0]["param_groups"][0], ckpt["lr_schedulers"]
    assert ckpt["global_step"] == 9 and isinstance(group["lr"], float) and isinstance(group["betas"][0], float)
    assert all(isinstance(x, float) for x in sched["_last_lr"]) and group["foreach"] is True  # as configured for graphs
    for flag in ("false", "true"):  # 6 more steps: graphed, 3 warm-up, the capture and 2 replays again
        more, r = run_losses([*GRAPH_RUN, "trainer.max_epochs=5", f"model.cuda_graph={flag}", f"ckpt_path={last}"],
                             synthetic_root, tmp_path / f"resume_{flag}", monkeypatch)
        assert r["global_step"] == 15 and len(more) == 6 and all(x == x for x in more)


def test_bev_train_graphed_under_bf16_autocast(stand_in, synthetic_root, tmp_path, monkeypatch, capsys):
    args = [*GRAPH_RUN, "trainer.precision=bf16-mixed", "trainer.max_epochs=2"]
    eager, _ = run_losses(args, synthetic_root, tmp_path / "eager", monkeypatch)
    graphed, _ = run_losses([*args, "model.cuda_graph=true"], synthetic_root, tmp_path / "graph", monkeypatch)
    assert len(graphed) == 6 and graphed == pytest.approx(eager, rel=1e-3)
    assert "captured as one CUDA graph at step 3 (after 3 eager steps)" in capsys.readouterr().out


def test_bev_train_graphed_refuses_a_cpu_and_gradient_accumulation(synthetic_root, tmp_path, monkeypatch, capsys):
    args = [*TINY, "debug=fdr", "model.cuda_graph=true", f"data.dataroot={synthetic_root}", f"hydra.run.dir={tmp_path}"]
    assert train_cli(args, monkeypatch) != 0
    assert "model.cuda_graph=true needs a CUDA device" in capsys.readouterr().err
    monkeypatch.setattr(cuda_graph, "BACKEND", EagerStandIn)
    assert train_cli([*args, "trainer.accumulate_grad_batches=2"], monkeypatch) != 0
    assert "accumulate_grad_batches" in capsys.readouterr().err


def test_bench_train_graph_variant_trains_as_the_eager_one(stand_in, monkeypatch):
    """scripts/bench_train.py's "graph" variant runs bev.cuda_graph as bev-train does (GPU-only at its command line)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_train

    cfg = bench_train.compose_config([*bench_train.CONFIGS["embedded"], "data.final_dim=[64,176]"])
    batch = bench_train.real_rig_batch(cfg, 1)
    eager, graphed = bench_train.Variant(cfg, "fp32", batch), bench_train.Variant(cfg, "graph", batch)
    for _ in range(graphed.graph.warmup + 3):  # warm-up, the capture, two replays
        eager.step()
        graphed.step()
    assert graphed.graph.replays == 2 and len(graphed.graph_losses) == 2
    with torch.no_grad():
        after = [float(v.lit.loss(v.lit(batch), batch["bev"])) for v in (eager, graphed)]
    assert after[1] == pytest.approx(after[0], rel=1e-4)
    assert float(graphed.graph_losses[1]) < float(graphed.graph_losses[0])


def test_what_a_captured_step_cannot_do_is_named(stand_in):
    from types import SimpleNamespace

    from bev.lit import BEVLitModule

    net = torch.nn.Linear(1, 1)
    net.num_classes = 1
    lit = BEVLitModule(net, functools.partial(torch.optim.Adam, lr=1e-3), cuda_graph=True, compile=True)
    lit._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), precision="16-mixed",
                                   accumulate_grad_batches=4, world_size=2)
    with pytest.raises(ValueError) as e:
        lit._check_graph_trainer()
    for named in ("16-mixed", "accumulate_grad_batches", "2 processes", "model.compile", "model.cuda_graph=false"):
        assert named in str(e.value)
