"""Losses of the CenterPoint-style head: Gaussian focal loss on the heatmaps and weighted L1 on the
regression at the boxes' cells, each normalised per class group and summed over groups (as CenterPoint's
CenterHead computes one loss per task).

No host synchronisation anywhere (no .item(), nonzero or boolean indexing: masks multiply, counts are
clamped tensors), so a training step with this loss can be compiled or captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from bev.classes import DETECTION_CLASSES, DETECTION_GROUPS
from bev.detection.targets import REGRESSION_FIELDS, VELOCITY_SLICE, class_to_group, gather_regression

# L1 weight per REGRESSION_FIELDS channel: 1, and 0.2 for the velocity (CenterPoint's code_weights).
CODE_WEIGHTS = (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.2, 0.2)
TARGET_KEYS = ("det_heatmap", "det_index", "det_label", "det_mask", "det_target", "det_vel_mask")


def _group_matrix(groups: tuple[tuple[str, ...], ...], device) -> torch.Tensor:
    """(G, C) one-hot: row g sums the classes of group g."""
    of_class = torch.tensor(class_to_group(groups), device=device)
    return F.one_hot(of_class, len(groups)).T.float()


def gaussian_focal_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    groups: tuple[tuple[str, ...], ...] = DETECTION_GROUPS,
    alpha: float = 2.0,
    gamma: float = 4.0,
) -> torch.Tensor:
    """CenterNet's focal loss on (B, C, X, Y) logits against Gaussian heatmaps (peaks exactly 1), summed
    over groups of (group's loss / max(1, group's number of peaks))."""
    x, t = logits.float(), target.float()
    p = torch.sigmoid(x)
    positive = (t == 1).float()
    # log-sigmoids instead of log(p): exact and finite for any logit.
    pos = -F.logsigmoid(x) * (1 - p).pow(alpha) * positive
    neg = -F.logsigmoid(-x) * p.pow(alpha) * (1 - t).pow(gamma) * (1 - positive)
    per_class = (pos + neg).sum((0, 2, 3))
    peaks = positive.sum((0, 2, 3))
    m = _group_matrix(groups, x.device)
    return ((m @ per_class) / (m @ peaks).clamp(min=1)).sum()


def regression_l1_loss(
    regression: torch.Tensor,
    targets: Mapping[str, torch.Tensor],
    groups: tuple[tuple[str, ...], ...] = DETECTION_GROUPS,
    code_weights: Sequence[float] = CODE_WEIGHTS,
) -> torch.Tensor:
    """Weighted L1 of the gathered regression vs det_target, velocity only where det_vel_mask, summed over
    groups of (group's loss / max(1, group's number of boxes))."""
    pred = gather_regression(regression.float(), targets["det_index"], targets["det_label"], groups)
    mask = targets["det_mask"].float()
    is_velocity = torch.zeros(len(REGRESSION_FIELDS), device=pred.device)
    is_velocity[VELOCITY_SLICE] = 1
    has_velocity = targets["det_vel_mask"].float()[..., None]  # (B, N, 1)
    code = torch.tensor(code_weights, dtype=torch.float32, device=pred.device)
    weights = code * (1 - is_velocity + is_velocity * has_velocity)  # (B, N, R): velocity terms only if known
    per_box = ((pred - targets["det_target"].float()).abs() * weights).sum(-1) * mask  # (B, N)
    onehot = F.one_hot(targets["det_label"].clamp(min=0), len(DETECTION_CLASSES)).float() * mask[..., None]
    m = _group_matrix(groups, pred.device)
    per_group = m @ (onehot * per_box[..., None]).sum((0, 1))
    boxes = m @ onehot.sum((0, 1))
    return (per_group / boxes.clamp(min=1)).sum()


def detection_loss(
    outputs: Mapping[str, torch.Tensor],
    targets: Mapping[str, torch.Tensor],
    groups: tuple[tuple[str, ...], ...] = DETECTION_GROUPS,
    regression_weight: float = 0.25,
    code_weights: Sequence[float] = CODE_WEIGHTS,
) -> dict[str, torch.Tensor]:
    """The head's outputs ({"heatmap", "regression"}) against a batch of encode_targets' arrays (collated,
    as tensors). Returns {"loss": heatmap + regression_weight * regression, "heatmap", "regression"}."""
    if len(code_weights) != len(REGRESSION_FIELDS):
        raise ValueError(
            f"code_weights needs one weight per regression field {REGRESSION_FIELDS}, got {list(code_weights)}"
        )
    missing = [k for k in TARGET_KEYS if k not in targets]
    if missing:
        raise KeyError(f"detection targets lack {missing}: batches need bev.detection.targets.encode_targets' keys")
    if outputs["regression"].shape[2] != len(REGRESSION_FIELDS):
        raise ValueError(
            f"regression must be (B, G, {len(REGRESSION_FIELDS)}, X, Y), got {tuple(outputs['regression'].shape)}"
        )
    heat = gaussian_focal_loss(outputs["heatmap"], targets["det_heatmap"], groups)
    reg = regression_l1_loss(outputs["regression"], targets, groups, code_weights)
    return {"loss": heat + regression_weight * reg, "heatmap": heat, "regression": reg}
