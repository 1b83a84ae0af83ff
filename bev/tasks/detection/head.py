"""CenterPoint-style detection head on BEV features (CenterHead of CenterPoint, BEVDet, BEVFusion).

A shared 3x3 conv-BN-ReLU, then per class group six independent branches (heatmap of the group's
classes, reg 2, height 1, dim 3, rot 2, vel 2), each a 3x3 conv-BN-ReLU and a 3x3 conv. The 36 branches
run as one wide conv and one grouped conv: each branch sees only its own channels, so this is the same
function as separate modules, in 4 kernels instead of ~150 (the GPU step is host-bound).
head_channels=0 is the light head for CPUs: every output a 1x1 conv of the shared features (the 36
branches' 3x3 convs cost several times the whole small BEV encoder at full grid size).

Outputs (tensors only, static shapes, so the head exports to ONNX):
- heatmap (B, C, X, Y): logits of DETECTION_CLASSES, in that order (the groups are contiguous runs).
- regression (B, G, 10, X, Y): per group the REGRESSION_FIELDS of bev.tasks.detection.targets.
"""

from __future__ import annotations

import torch
from torch import nn

from bev.classes import DETECTION_GROUPS
from bev.tasks.detection.targets import REGRESSION_FIELDS, class_to_group

# Branch outputs per group, in the order their channels make REGRESSION_FIELDS.
REGRESSION_BRANCHES = (("reg", 2), ("height", 1), ("dim", 3), ("rot", 2), ("vel", 2))
HEATMAP_INIT_BIAS = -2.19  # sigmoid = 0.1: the focal loss starts from a low prior (CenterNet)


class CenterHead(nn.Module):
    """(B, in_channels, X, Y) BEV features -> {"heatmap": (B, C, X, Y), "regression": (B, G, 10, X, Y)}."""

    def __init__(
        self,
        in_channels: int,
        shared_channels: int = 64,
        head_channels: int = 64,
        groups: tuple[tuple[str, ...], ...] = DETECTION_GROUPS,
    ):
        super().__init__()
        class_to_group(groups)  # validates the groups
        self.groups = tuple(tuple(g) for g in groups)
        branch_out = [[len(g)] + [n for _, n in REGRESSION_BRANCHES] for g in self.groups]
        n_branches = sum(len(b) for b in branch_out)
        width = max(max(b) for b in branch_out)  # every branch's last conv gives `width` channels, some unused
        self.shared = nn.Sequential(
            nn.Conv2d(in_channels, shared_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(shared_channels),
            nn.ReLU(inplace=True),
        )
        if head_channels:
            self.hidden = nn.Sequential(
                nn.Conv2d(shared_channels, n_branches * head_channels, 3, padding=1, bias=False),
                nn.BatchNorm2d(n_branches * head_channels),
                nn.ReLU(inplace=True),
            )
            self.out = nn.Conv2d(n_branches * head_channels, n_branches * width, 3, padding=1, groups=n_branches)
        else:
            self.hidden = nn.Identity()
            self.out = nn.Conv2d(shared_channels, n_branches * width, 1)
        heat, reg = self._channel_maps(branch_out, width)
        self.register_buffer("heatmap_channels", torch.tensor(heat), persistent=False)
        self.register_buffer("regression_channels", torch.tensor(reg), persistent=False)
        with torch.no_grad():
            self.out.bias.zero_()
            self.out.bias[self.heatmap_channels] = HEATMAP_INIT_BIAS

    @staticmethod
    def _channel_maps(branch_out: list[list[int]], width: int) -> tuple[list[int], list[int]]:
        """Indices into the grouped conv's output of the heatmap channels (class order) and of the
        regression channels (group-major, REGRESSION_FIELDS order)."""
        heat, reg, branch = [], [], 0
        for outs in branch_out:  # branches of a group: its heatmap, then reg, height, dim, rot, vel
            for k, n in enumerate(outs):
                (heat if k == 0 else reg).extend(branch * width + c for c in range(n))
                branch += 1
        assert len(reg) == len(branch_out) * len(REGRESSION_FIELDS)
        return heat, reg

    def forward(self, features: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.out(self.hidden(self.shared(features)))
        b, _, x, w = y.shape
        heatmap = y.index_select(1, self.heatmap_channels)
        regression = y.index_select(1, self.regression_channels).view(b, len(self.groups), len(REGRESSION_FIELDS), x, w)
        return {"heatmap": heatmap, "regression": regression}


def build(in_channels: int, grid=None, **options) -> CenterHead:
    """The detection head on `in_channels` BEV features (model.net.heads.detection: CenterHead's options)."""
    return CenterHead(in_channels, **options)
