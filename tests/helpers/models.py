"""Small models and their inputs, shared by the model, inference and export tests."""

from __future__ import annotations

import torch

from bev.classes import class_names
from bev.geometry import Grid
from bev.inference import ring_rig

# A tiny LiftSplatShoot on a 24 x 24 grid (pass TINY_NET as its keyword arguments).
GRID = Grid(xbound=(-24, 24, 2.0), ybound=(-24, 24, 2.0), zbound=(-10, 10, 20), dbound=(4, 44, 8.0))
SIZE = (32, 96)
TINY_NET = {
    "context_channels": 8,
    "camera": {"backbone": "small", "widths": (8, 8, 16, 16, 16), "mid_channels": 16},
    "bev": {"widths": (8, 16, 16), "blocks": 1},
}

# What a run of helpers.cli.TINY (the embedded experiment=synthetic_cpu) predicts: vehicles and
# BEVFusion's six map classes.
CLASSES = list(class_names(["vehicle."], "bevfusion"))


def rig(B: int, N: int = 6, size=SIZE):
    """Six cameras at 1.5 m looking outwards every 60 degrees (camera: x right, y down, z forward)."""
    return ring_rig(N, size, B)


def model_inputs(B=2, seed=0):
    """LiftSplatShoot's positional inputs: random images of SIZE from the 6-camera ring rig."""
    g = torch.Generator().manual_seed(seed)
    cams = rig(B)
    return (
        torch.randn(B, 6, 3, *SIZE, generator=g),
        cams["intrinsics"],
        cams["rots"],
        cams["trans"],
        cams["post_rots"],
        cams["post_trans"],
    )


def val_batch(dataroot, model, n=2):
    """The first `n` mini_val samples of `dataroot`, collated as the trained `model`'s run loaded them."""
    from bev.data import NuScenesBEVDataset

    cfg = model.run_config["data"]
    ds = NuScenesBEVDataset(dataroot, split="mini_val", grid=cfg["grid"], final_dim=cfg["final_dim"], verbose=False)
    return torch.utils.data.default_collate([ds[i] for i in range(n)])


def lss_net(grid, image_size=(128, 352), kind: str = "static", **settings):
    """A bev.models.BEVNet built from the flat settings of the networks before it (context_channels, camera, bev,
    num_classes, detection, past_frames, ...), through the same translation stored configs take
    (bev.utils.legacy.upgrade_net_config)."""
    from bev.models import BEVNet
    from bev.utils.legacy import LEGACY_NETS, upgrade_net_config

    target = next(t for t, k in LEGACY_NETS.items() if k == kind)
    cfg = upgrade_net_config({"_target_": target, "grid": grid, "image_size": image_size, **settings})
    cfg.pop("_target_")
    return BEVNet(**cfg)


def stand_in_net(in_channels: int, num_classes: int, kernel: int = 1):
    """A one-conv stand-in for a BEVNet where a test needs only what the LightningModule reads of its network:
    the segmentation channels, its heads, grid and (no) past frames."""
    from torch import nn

    net = nn.Conv2d(in_channels, num_classes, kernel)
    net.num_classes, net.heads, net.grid, net.past_frames, net.temporal = (
        num_classes,
        ("segmentation",),
        Grid(),
        None,
        None,
    )
    return net
