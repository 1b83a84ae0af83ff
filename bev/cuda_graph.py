"""The whole training step as one CUDA graph (`model.cuda_graph=true`; scripts/bench_train.py's graph variants).

At a small batch a GPU step is bound by the host launching its ~1500 kernels one by one, not by
the GPU. Captured once, the step's forward, loss, backward, clipping and optimiser update replay
with one launch. What a captured step must keep to:
- the same input shapes every step: each batch is copied into the captured one (the train loader
  drops its last partial batch); a batch of another shape runs eagerly, into the same gradients;
- no value read back by the host and no tensor made from host data anywhere in the step
  (tests/test_models.py checks the model, forward to backward);
- a capturable optimiser whose numbers a schedule changes are GPU tensors, filled in place: a
  number in a param group is frozen into the graph when it is captured, so the learning rate
  (and Adam's betas, which OneCycleLR cycles) become tensors, and any other number that changes
  afterwards is refused with an error instead of being silently ignored;
- no bf16 weight cast made before the capture and reused inside it (it would stay stale on every
  replay): Lightning enters autocast afresh for each training step, whose cache starts empty, and
  the capturing step runs no forward before the capture, so the graph records every cast.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

GRAPH_WARMUP = 3  # eager steps on the side stream before the capture: cuDNN autotuning, optimiser state
TENSOR_HYPERPARAMS = ("lr", "betas")  # what the schedules in the configs change (OneCycleLR: lr, beta1)
FLAGS = ("capturable", "foreach", "fused", "differentiable", "maximize", "amsgrad", "decoupled_weight_decay")


class CudaGraphBackend:
    """torch.cuda's side stream and graph calls (tests put an eager stand-in in their place on the CPU)."""

    capturable = True  # the optimiser's step runs on the GPU's own counters (the stand-in's CPU has none)

    @staticmethod
    def check(device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"model.cuda_graph=true needs a CUDA device, but the model is on {device.type}: "
                             f"train on a GPU (trainer=gpu) or set model.cuda_graph=false")

    def __init__(self):
        self.side = torch.cuda.Stream()  # warm-up and capture share it: its library workspaces exist before the capture
        self.graph = None

    def eager(self, fn: Callable[[], Any]) -> Any:
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            out = fn()
        torch.cuda.current_stream().wait_stream(self.side)
        return out

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.graph = torch.cuda.CUDAGraph()
        self.side.wait_stream(torch.cuda.current_stream())  # the batch was copied on the current stream
        # thread_local: the data loader's pin-memory thread allocates pinned buffers during the capture,
        # which the default ("global") mode would turn into a failed capture and a dead loader.
        with torch.cuda.graph(self.graph, stream=self.side, capture_error_mode="thread_local"):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


BACKEND = CudaGraphBackend  # tests put an eager stand-in here, to run the trainer's graphed path on the CPU


def _fits(static: dict, batch: dict) -> bool:
    """Whether every tensor of batch has the key, shape and dtype of the captured one."""
    tensors = {k for k, v in batch.items() if torch.is_tensor(v)}
    return tensors == {k for k, v in static.items() if torch.is_tensor(v)} and all(
        static[k].shape == batch[k].shape and static[k].dtype == batch[k].dtype for k in tensors)


class StepGraph:
    """Runs `step_fn(batch)` (a whole training step returning tensors) eagerly for `warmup` steps, captures it
    once as a graph on a copy of that step's batch, then replays it after copying each new batch into that copy;
    a batch of another shape runs eagerly. Returns step_fn's outputs (on replays the captured ones, which the
    next replay overwrites).

    step_fn must set the gradients to None before its backward: the capture then allocates the gradients
    that replays write, and an eager step writes fresh ones instead of adding to them."""

    def __init__(self, step_fn: Callable[[dict], Any], warmup: int = GRAPH_WARMUP, backend: Any = None):
        self.step_fn, self.warmup = step_fn, int(warmup)
        self.backend = backend if backend is not None else BACKEND()
        self.static: dict | None = None
        self.outputs: Any = None
        self.eager_steps = self.replays = self.eager_after_capture = 0

    @property
    def captured(self) -> bool:
        return self.static is not None

    def __call__(self, batch: dict) -> Any:
        if self.captured:
            if _fits(self.static, batch):
                for k, v in batch.items():
                    if torch.is_tensor(v):
                        self.static[k].copy_(v, non_blocking=True)
                self.backend.replay()
                self.replays += 1
                return self.outputs
            self.eager_after_capture += 1
            return self.step_fn(batch)
        if self.eager_steps < self.warmup:
            self.eager_steps += 1
            return self.backend.eager(lambda: self.step_fn(batch))
        self.static = {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}
        self.outputs = self.backend.capture(lambda: self.step_fn(self.static))
        self.backend.replay()  # capturing records the work and runs none of it
        return self.outputs


def graph_optimizer_kwargs(factory: Callable[..., torch.optim.Optimizer]) -> dict:
    """Constructor arguments for an optimiser whose step a graph can capture: its multi-tensor step (the fused
    one keeps Adam's betas as numbers) unless the config chose; refused for optimisers with no capturable step."""
    cls = getattr(factory, "func", factory)
    given = getattr(factory, "keywords", {})
    try:
        capturable = "capturable" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        capturable = False
    if not capturable:
        raise ValueError(f"model.cuda_graph=true needs an optimiser with a capturable step (Adam, AdamW, ...); "
                         f"{getattr(cls, '__name__', cls)} has none: change model.optimizer or set model.cuda_graph=false")
    return {} if "fused" in given or "foreach" in given else {"foreach": True}


def _number(v: Any) -> Any:
    """A one-element tensor (or a tuple or list of them) as Python numbers."""
    if torch.is_tensor(v) and v.numel() == 1:
        return float(v)
    if isinstance(v, (tuple, list)):
        return type(v)(_number(x) for x in v)
    return v


def _shown(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, (int, float)) else repr(v)


def plain_scheduler_state(state: dict) -> None:
    """A checkpoint's LR scheduler state with numbers for the tensor lrs it recorded (its `_last_lr`)."""
    for k, v in state.items():
        if isinstance(v, list) and any(torch.is_tensor(x) for x in v):
            state[k] = _number(v)


class GraphOptimizer:
    """Makes an optimiser's step capturable and keeps the numbers a graph reads in GPU tensors.

    prepare(): capturable on (off: the single-tensor step, for a CPU stand-in), step counters on the
    parameters' device, lr (and betas, unless fused) as tensors. sync(), before every step: a number a
    schedule wrote into a param group goes into its tensor; any other number the step reads that changed
    since prepare() is refused. plain(state): a checkpoint's optimiser state written as an eager run
    writes it (numbers, the config's flags), so that it resumes anywhere, with or without a graph."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.opt = optimizer
        self.tensors: list[dict[str, Any]] = []
        self.frozen: list[dict[str, Any]] = []
        self.flags: list[dict[str, Any]] = []

    def prepare(self, capturable: bool | None = None) -> None:
        capturable = BACKEND.capturable if capturable is None else capturable
        for group in self.opt.param_groups:
            device = group["params"][0].device
            self.flags.append({k: group[k] for k in FLAGS if k in group})
            group["capturable"] = capturable
            if not capturable:
                group["foreach"] = False  # the multi-tensor step takes tensor numbers only when capturable
            owned = {"lr": torch.tensor(float(group["lr"]), device=device)}
            if "betas" in group and not group.get("fused"):
                owned["betas"] = tuple(torch.tensor(float(b), device=device) for b in group["betas"])
            group.update(owned)
            self.tensors.append(owned)
            self.frozen.append({k: group[k] for k in self.opt.defaults
                                if k not in owned and k not in FLAGS and isinstance(group.get(k), (int, float))})
        for p, state in self.opt.state.items():
            if torch.is_tensor(state.get("step")) and state["step"].device != p.device:
                state["step"] = state["step"].to(p.device, torch.float32)

    def sync(self) -> None:
        for group, owned, frozen in zip(self.opt.param_groups, self.tensors, self.frozen):
            for key, mine in owned.items():
                now = group[key]
                for t, v in zip(mine, now) if isinstance(mine, tuple) else [(mine, now)]:
                    if v is not t:
                        t.fill_(float(v))
                group[key] = mine
            changed = {k: (v, group.get(k)) for k, v in frozen.items() if group.get(k) != v}
            if changed:
                what = ", ".join(f"{k} {a:.6g} -> {_shown(b)}" for k, (a, b) in changed.items())
                raise RuntimeError(f"model.cuda_graph: the optimiser's {what} changed after its step was captured, "
                                   f"and the graph would keep the old value; only {' and '.join(TENSOR_HYPERPARAMS)} may "
                                   f"change (e.g. OneCycleLR's cycle_momentum on RMSprop changes momentum): "
                                   f"change the schedule or set model.cuda_graph=false")

    def plain(self, state: dict) -> None:
        for group, flags in zip(state["param_groups"], self.flags):
            group.update({k: _number(v) for k, v in group.items() if k in TENSOR_HYPERPARAMS})
            group.update(flags)
        if not all(f.get("capturable") for f in self.flags):  # as an eager step keeps them: on the CPU
            # New dicts: state_dict() shares each parameter's state dict with the optimiser itself.
            state["state"] = {k: {n: v.detach().to("cpu", torch.float32) if n == "step" and torch.is_tensor(v) else v
                                  for n, v in s.items()} for k, s in state["state"].items()}
