"""A training step of a composed experiment, as bev-train builds and runs it, for the CUDA tests that hold
the step to no host synchronisation (tests/test_train_cuda.py, tests/test_compile.py).

The model comes from the Hydra config (compose + instantiate, `model.compile` applied by the module's own
setup), its inputs from `bev.inference.example_inputs` (random images, a ring rig); one step is forward +
loss under autocast, backward, gradient clipping, optimiser step, gradients set to None (as Lightning).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from bev.inference import example_inputs
from bev.lit import CAMERA_KEYS


def compose_train(overrides: list[str]):
    """The `train` config with `overrides`, composed as bev-train composes it (${hydra:...} resolved)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    import bev.data  # noqa: F401 (registers the data config schemas that configs/data names)
    from bev.utils.config import CONFIG_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, "hydra.run.dir=/tmp/bev_test_step"], return_hydra_config=True)
    HydraConfig().set_config(cfg)
    return cfg


def step_batch(lit, cfg, batch_size: int, device: str, seed: int = 0) -> dict:
    """Random camera inputs of the model's image size and sparse BEV targets of cfg's classes and grid."""
    from bev.geometry import Grid

    inputs = example_inputs(lit.net, num_cameras=6, batch_size=batch_size, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    X, Y = Grid.from_any(cfg.grid).bev_shape
    bev = (torch.rand(batch_size, int(cfg.model.net.heads.segmentation.num_classes), X, Y, generator=g) < 0.05).float()
    det = detection_targets(Grid.from_any(cfg.grid), batch_size, seed) if cfg.data.get("detection") else {}
    return {k: v.to(device) for k, v in {**dict(zip(CAMERA_KEYS, inputs)), "bev": bev, **det}.items()}


def detection_targets(grid, batch_size: int, seed: int, boxes: int = 20) -> dict:
    """CenterPoint targets of random car-sized boxes of every class, as data.detection=true items carry them."""
    import numpy as np

    from bev.classes import DETECTION_CLASSES
    from bev.tasks.detection.targets import encode_targets

    rng, samples = np.random.default_rng(seed), []
    for _ in range(batch_size):
        b = np.zeros((boxes, 9), np.float32)
        b[:, 0] = rng.uniform(grid.xbound[0], grid.xbound[1], boxes)
        b[:, 1] = rng.uniform(grid.ybound[0], grid.ybound[1], boxes)
        b[:, 3:6], b[:, 6] = (1.9, 4.5, 1.6), rng.uniform(-np.pi, np.pi, boxes)
        samples.append(encode_targets(b, np.arange(boxes) % len(DETECTION_CLASSES), grid))
    return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}


class TrainStep:
    """cfg's LightningModule in the given layout, precision and compile mode, its optimiser (fused on CUDA,
    as bev-train builds it) and a batch; calling it runs one training step and returns the loss (not synced)."""

    def __init__(self, cfg, device: str, channels_last=False, bf16=False, compile=False, batch_size=2, seed=0):
        from hydra.utils import instantiate

        torch.manual_seed(seed)
        model_cfg = cfg.model.copy()
        model_cfg.net.camera.channels_last = channels_last
        model_cfg.net.decoder.channels_last = channels_last
        model_cfg.compile = compile
        self.lit = instantiate(model_cfg).to(device).train()
        self.lit.setup("fit")  # compiles the network in place when model.compile asks (bev.lit)
        self.opt = self.lit.make_optimizer()
        self.clip = cfg.trainer.get("gradient_clip_val")
        self.batch = step_batch(self.lit, cfg, batch_size, device, seed)
        self.autocast = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if bf16 else nullcontext

    def __call__(self) -> torch.Tensor:
        with self.autocast():
            loss = self.lit.losses(self.lit(self.batch), self.batch)[0]  # the segmentation (and detection) loss
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.lit.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()
