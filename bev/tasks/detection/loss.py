"""Losses of the CenterPoint-style head: Gaussian focal loss on the heatmaps and weighted L1 on the
regression at the boxes' cells, each normalised per class group and summed over groups (as CenterPoint's
CenterHead computes one loss per task).

No host synchronisation anywhere (no .item(), nonzero or boolean indexing: masks multiply, counts are
clamped tensors) and no tensor made from Python data per call (the class -> group tables and code weights
are DetectionLoss's buffers), so a training step with this loss can be compiled or captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bev.classes import DETECTION_GROUPS
from bev.tasks.detection.targets import (
    REGRESSION_FIELDS,
    VELOCITY_SLICE,
    check_velocity_frame,
    class_to_group,
    gather_regression,
    rotate_velocity,
)

# L1 weight per REGRESSION_FIELDS channel: 1, and 0.2 for the velocity (CenterPoint's code_weights).
CODE_WEIGHTS = (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.2, 0.2)
TARGET_KEYS = ("det_heatmap", "det_index", "det_label", "det_mask", "det_target", "det_vel_mask")


def gaussian_focal_loss(
    logits: torch.Tensor, target: torch.Tensor, group_matrix: torch.Tensor, alpha: float = 2.0, gamma: float = 4.0
) -> torch.Tensor:
    """CenterNet's focal loss on (B, C, X, Y) logits against Gaussian heatmaps (peaks exactly 1), summed
    over groups of (group's loss / max(1, group's number of peaks)); group_matrix (G, C) one-hot."""
    x, t = logits.float(), target.float()
    p = torch.sigmoid(x)
    positive = (t == 1).float()
    # log-sigmoids instead of log(p): exact and finite for any logit.
    pos = -F.logsigmoid(x) * (1 - p).pow(alpha) * positive
    neg = -F.logsigmoid(-x) * p.pow(alpha) * (1 - t).pow(gamma) * (1 - positive)
    per_class = (pos + neg).sum((0, 2, 3))
    peaks = positive.sum((0, 2, 3))
    return ((group_matrix @ per_class) / (group_matrix @ peaks).clamp(min=1)).sum()


def regression_l1_loss(
    regression: torch.Tensor,
    targets: Mapping[str, torch.Tensor],
    class_group: torch.Tensor,
    group_matrix: torch.Tensor,
    code_weights: torch.Tensor,
    velocity_channels: torch.Tensor,
    velocity_frame: str = "ego",
) -> torch.Tensor:
    """Weighted L1 of the gathered regression vs det_target, velocity only where det_vel_mask, summed over
    groups of (group's loss / max(1, group's number of boxes)). code_weights and velocity_channels (0/1)
    are (R,) per REGRESSION_FIELDS; velocity_frame "box": the velocity target turned into the true box's frame."""
    pred = gather_regression(regression.float(), targets["det_index"], targets["det_label"], class_group)
    target = targets["det_target"].float()
    if velocity_frame == "box":
        box_v = rotate_velocity(target[..., VELOCITY_SLICE], target[..., 6], target[..., 7], inverse=True)
        target = torch.cat([target[..., :8], box_v], -1)
    mask = targets["det_mask"].float()
    has_velocity = targets["det_vel_mask"].float()[..., None]  # (B, N, 1)
    weights = code_weights * (1 - velocity_channels + velocity_channels * has_velocity)  # (B, N, R)
    per_box = ((pred - target).abs() * weights).sum(-1) * mask  # (B, N)
    # (B, N, C) by comparison: F.one_hot checks its input's range, a host sync on a GPU.
    classes = torch.arange(group_matrix.shape[1], device=mask.device)
    onehot = (targets["det_label"][..., None] == classes).float() * mask[..., None]
    per_group = group_matrix @ (onehot * per_box[..., None]).sum((0, 1))
    boxes = group_matrix @ onehot.sum((0, 1))
    return (per_group / boxes.clamp(min=1)).sum()


class DetectionLoss(nn.Module):
    """The head's outputs ({"heatmap", "regression"}) against a batch of encode_targets' arrays (collated,
    as tensors) -> {"loss": heatmap + regression_weight * regression, "heatmap", "regression"}."""

    def __init__(
        self,
        groups: tuple[tuple[str, ...], ...] = DETECTION_GROUPS,
        regression_weight: float = 0.25,
        code_weights: Sequence[float] = CODE_WEIGHTS,
        alpha: float = 2.0,
        gamma: float = 4.0,
        velocity_frame: str = "ego",
    ):
        super().__init__()
        self.velocity_frame = check_velocity_frame(velocity_frame)
        if len(code_weights) != len(REGRESSION_FIELDS):
            raise ValueError(
                f"code_weights needs one weight per regression field {REGRESSION_FIELDS}, got {list(code_weights)}"
            )
        class_group = torch.tensor(class_to_group(groups))
        velocity = torch.zeros(len(REGRESSION_FIELDS))
        velocity[VELOCITY_SLICE] = 1
        self.register_buffer("class_group", class_group, persistent=False)
        self.register_buffer("group_matrix", F.one_hot(class_group, len(groups)).T.float(), persistent=False)
        self.register_buffer("code_weights", torch.tensor(code_weights, dtype=torch.float32), persistent=False)
        self.register_buffer("velocity_channels", velocity, persistent=False)
        self.regression_weight, self.alpha, self.gamma = float(regression_weight), float(alpha), float(gamma)

    def forward(
        self, outputs: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        missing = [k for k in TARGET_KEYS if k not in targets]
        if missing:
            raise KeyError(
                f"detection targets lack {missing}: batches need bev.tasks.detection.targets.encode_targets' keys"
            )
        if outputs["regression"].shape[2] != len(REGRESSION_FIELDS):
            raise ValueError(
                f"regression must be (B, G, {len(REGRESSION_FIELDS)}, X, Y), got {tuple(outputs['regression'].shape)}"
            )
        heat = gaussian_focal_loss(
            outputs["heatmap"], targets["det_heatmap"], self.group_matrix, self.alpha, self.gamma
        )
        reg = regression_l1_loss(
            outputs["regression"],
            targets,
            self.class_group,
            self.group_matrix,
            self.code_weights,
            self.velocity_channels,
            self.velocity_frame,
        )
        return {"loss": heat + self.regression_weight * reg, "heatmap": heat, "regression": reg}
