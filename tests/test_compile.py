"""model.compile: the modes it takes, the network compiled whole (fullgraph=True: no graph break at the
voxel-pooling op or anywhere else), and the compiled step's loss and gradients equal to eager's.

Tolerances: inductor fuses and reorders float32 reductions (BatchNorm statistics, the splat's
depth x feature products, the loss mean), so values differ from eager by rounding only:
loss to rtol 1e-5, gradients to rtol 1e-3 / atol 1e-5 of a gradient of magnitude ~1e-2.
The CUDA tests (skipped without a GPU; scripts/gpu_check.sh runs them) hold the whole step
(forward, loss, backward, optimiser step) to no host synchronisation.
"""

from __future__ import annotations

import functools

import pytest
import torch

from bev.geometry import Grid
from bev.lit import BEVLitModule
from bev.utils.speed import COMPILE_MODES, compile_mode
from helpers.models import GRID, SIZE, TINY_NET, lss_net, model_inputs

LOSS_RTOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-3, 1e-5


def tiny_lit(seed: int = 0, compile=False, downsample: int = 16, **kwargs) -> BEVLitModule:
    torch.manual_seed(seed)
    net = lss_net(GRID, SIZE, downsample=downsample, **TINY_NET)
    adam = functools.partial(torch.optim.Adam, lr=1e-3)
    segmentation = {"object_classes": ("vehicle",), **kwargs.pop("segmentation", {})}
    return BEVLitModule(net, adam, compile=compile, segmentation=segmentation, **kwargs)


def tiny_batch(B: int = 2, grid: Grid = GRID) -> dict:
    images, *cams = model_inputs(B)
    keys = ("intrinsics", "rots", "trans", "post_rots", "post_trans")
    g = torch.Generator().manual_seed(1)
    return {
        "images": images,
        **dict(zip(keys, cams)),
        "bev": (torch.rand(B, 1, *grid.bev_shape, generator=g) < 0.1).float(),
    }


@pytest.mark.parametrize(
    "value, mode",
    [(False, None), (None, None), ("off", None), ("false", None), (True, "default"), ("true", "default")]
    + [(m, m) for m in COMPILE_MODES],
)
def test_compile_takes_off_true_and_the_torch_compile_modes(value, mode):
    assert compile_mode(value) == mode


@pytest.mark.parametrize("value", ["fast", "max_autotune", 1, 0.5])
def test_an_unknown_compile_value_names_the_choices(value):
    with pytest.raises(ValueError, match=r"model.compile must be .*reduce-overhead, max-autotune"):
        tiny_lit(compile=value)


@pytest.mark.parametrize("value, mode", [(True, "default"), ("reduce-overhead", "reduce-overhead"), (False, None)])
def test_setup_compiles_the_network_whole_in_the_chosen_mode(monkeypatch, value, mode):
    lit = tiny_lit(compile=value)
    calls = []
    monkeypatch.setattr(lit.net, "compile", lambda **kw: calls.append(kw))
    lit.setup("validate")
    assert calls == []  # evaluation runs stay eager (no compile time for one pass)
    lit.setup("fit")
    assert calls == ([{"mode": mode, "fullgraph": True}] if mode else [])


@pytest.mark.parametrize("loss", ["bce", "focal"])
def test_the_loss_compiles_whole_and_matches_eager(fresh_compile_caches, loss):
    lit = tiny_lit(segmentation=dict(loss=loss, pos_weight=2.13, class_weight=None if loss == "bce" else 1.0))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 1, 24, 24, generator=g)
    target = (torch.rand(2, 1, 24, 24, generator=g) < 0.2).float()
    compiled = torch.compile(lit.task_modules.segmentation.loss_fn, fullgraph=True)
    got, want = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    out, expected = compiled(got, target), lit.task_modules.segmentation.loss_fn(want, target)
    out.backward(), expected.backward()
    torch.testing.assert_close(out, expected, rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(got.grad, want.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)


def compiled_and_eager_step(downsample: int) -> tuple:
    """One training step (forward, loss, backward) of the tiny LSS compiled by setup("fit") and of its eager twin."""
    compiled, eager = tiny_lit(compile=True, downsample=downsample), tiny_lit(downsample=downsample)
    eager.load_state_dict(compiled.state_dict())
    compiled.setup("fit")  # net.compile(mode="default", fullgraph=True): a graph break would raise
    batch = tiny_batch()
    losses = []
    for lit in (compiled, eager):
        lit.train()
        loss = lit.losses(lit(batch), batch)[0]
        loss.backward()
        losses.append(loss.detach())
    return compiled, eager, losses


@pytest.mark.slow  # inductor compiles the forward and backward graphs: ~1-2 min on 2 shared cores
@pytest.mark.parametrize("downsample", [16, 8])
def test_compiled_lss_step_matches_eager(fresh_compile_caches, downsample):
    compiled, eager, (loss, expected) = compiled_and_eager_step(downsample)
    torch.testing.assert_close(loss, expected, rtol=LOSS_RTOL, atol=0)
    grads = dict(eager.named_parameters())
    for name, p in compiled.named_parameters():
        assert p.grad is not None, f"{name} got no gradient in the compiled step"
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)
    # The plain model's keys: a compiled run's checkpoints load into an eager model.
    assert compiled.state_dict().keys() == eager.state_dict().keys()


# --------------------------------------------------------------------------- CUDA: no host sync in the step


def _native_cuda() -> bool:
    from bev import ops

    return ops.native_available("cuda")


requires_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and _native_cuda()), reason="needs a CUDA device and the native CUDA kernels"
)


def cuda_step(lit: BEVLitModule, opt: torch.optim.Optimizer, batch: dict, captured: bool = False) -> torch.Tensor:
    """The region a compiled or captured step holds: forward, loss, backward, optimiser step."""
    loss = lit.losses(lit(batch), batch)[0]
    loss.backward()
    opt.step()
    # Captured by hand: zeroed in place, so that the gradients keep their addresses in the graph. Compiled
    # with CUDA graphs (reduce-overhead) as Lightning does: set to None, since a gradient kept would be the
    # last step's graph output, which the next replay overwrites.
    opt.zero_grad(set_to_none=not captured)
    return loss.detach()


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("mode", [None, *COMPILE_MODES[:2]])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_cuda_step_never_synchronises(fresh_compile_caches, mode, precision):
    lit = tiny_lit(compile=mode or False).cuda()
    lit.setup("fit")
    opt = torch.optim.Adam(lit.parameters(), lr=1e-3, fused=True)
    batch = {k: v.cuda() for k, v in tiny_batch().items()}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    for _ in range(3):  # compilation, cuDNN handles, the optimiser's state, the CUDA graph's recording
        with autocast:
            cuda_step(lit, opt, batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with autocast:
            for _ in range(2):
                loss = cuda_step(lit, opt, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()


@pytest.mark.cuda
@requires_cuda
def test_the_whole_eager_step_is_captured_in_one_cuda_graph():
    """The proof that nothing in the step needs the host: torch.cuda.graph refuses any sync while capturing
    ("operation not permitted when stream is capturing"). Its replays train as the eager step does."""
    batch = {k: v.cuda() for k, v in tiny_batch().items()}
    runs = []
    for captured in (True, False):
        lit = tiny_lit().cuda().train()
        opt = torch.optim.Adam(lit.parameters(), lr=1e-3, capturable=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph asks
            losses = [cuda_step(lit, opt, batch, captured=True) for _ in range(3)]
        torch.cuda.current_stream().wait_stream(side)
        if captured:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                loss = cuda_step(lit, opt, batch, captured=True)
            for _ in range(3):
                graph.replay()
                losses.append(loss.clone())
        else:
            losses += [cuda_step(lit, opt, batch, captured=True) for _ in range(3)]
        runs.append(torch.stack(losses).cpu())
    # cuDNN may pick other (TF32) convolution algorithms inside a capture: the losses agree to ~1e-3.
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-2, atol=1e-3)
    assert runs[0][-1] < runs[0][0]


@pytest.mark.cuda
@requires_cuda
def test_the_embedded_step_compiled_never_synchronises(fresh_compile_caches):
    """The embedded experiment's step compiled with channels_last + bf16, plain and with CUDA graphs (what
    gpu_check.sh times with scripts/bench_train.py): no sync in the step once compiled."""
    pytest.importorskip("hydra", reason="composing the configs needs hydra-core (gpu_check.sh: carry .whl/)")
    from helpers.train_step import TrainStep, compose_train

    cfg = compose_train(["experiment=synthetic_cpu"])
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        step = TrainStep(cfg, "cuda", channels_last=True, bf16=True, compile=mode)
        for _ in range(3):  # compilation, the CUDA graphs' recording
            step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.isfinite(loss).item(), mode
