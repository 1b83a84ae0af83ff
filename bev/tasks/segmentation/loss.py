"""The static segmentation loss: BCE with logits or sigmoid focal loss on the BEV target channels (object classes,
then HD-map classes), per-class positive weights and an optional weight per channel's mean."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

LOSSES = ("bce", "focal")


def per_class_weights(spec, names: tuple[str, ...], what: str = "pos_weight") -> torch.Tensor:
    """A per-class config (pos_weight, class_weight) -> (K,) tensor: a number for all, a list per
    channel, or {class: weight} (others 1.0)."""
    if isinstance(spec, Mapping):
        unknown = [k for k in spec if k not in names]
        if unknown:
            raise ValueError(f"{what} names unknown class(es) {unknown}; classes: {list(names)}")
        values = [float(spec.get(n, 1.0)) for n in names]
    elif isinstance(spec, (int, float)):
        values = [float(spec)] * len(names)
    else:
        values = [float(v) for v in spec]
    if len(values) != len(names):
        raise ValueError(f"{what} has {len(values)} values for {len(names)} classes {list(names)}")
    if any(v < 0 for v in values) or not sum(values) > 0:
        raise ValueError(f"{what} must be >= 0 and not all 0, got {dict(zip(names, values))}")
    return torch.tensor(values)


class SegmentationLoss(nn.Module):
    """(logits (B, K, X, Y), target (B, K, X, Y) in {0, 1}) -> the loss, a scalar.

    loss: "bce" (BCE with logits) or "focal" (sigmoid focal loss, focal_gamma; as BEVFusion's map head;
    pos_weight multiplies the positive term). pos_weight: a number for every channel, a list (one per channel)
    or a {class name: weight} mapping (unlisted classes 1.0). class_weight: the weight of each channel's mean loss
    in the total (same forms; None = every cell alike). Its weights are non-persistent buffers: they follow the
    module's device but are not in checkpoints (the config rebuilds them).
    """

    def __init__(
        self,
        class_names: Sequence[str],
        loss: str = "bce",
        focal_gamma: float = 2.0,
        pos_weight: float | Sequence[float] | Mapping[str, float] = 2.13,
        class_weight: float | Sequence[float] | Mapping[str, float] | None = None,
    ):
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"unknown model.segmentation.loss {loss!r}; choose one of {', '.join(LOSSES)}")
        names = tuple(class_names)
        self.loss_name, self.focal_gamma = loss, float(focal_gamma)
        self.register_buffer("pos_weight", per_class_weights(pos_weight, names).view(-1, 1, 1), persistent=False)
        w = None if class_weight is None else per_class_weights(class_weight, names, "class_weight")
        self.register_buffer("class_weight", None if w is None else w / w.sum(), persistent=False)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits, target = logits.float(), target.float()
        if self.loss_name == "bce":
            if self.class_weight is None:
                return F.binary_cross_entropy_with_logits(logits, target, pos_weight=self.pos_weight)
            per_cell = F.binary_cross_entropy_with_logits(logits, target, pos_weight=self.pos_weight, reduction="none")
        else:  # sigmoid focal loss (Lin et al.): BCE scaled by (1 - p_t)^gamma
            ce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
            p = logits.sigmoid()
            p_t = p * target + (1 - p) * (1 - target)
            per_cell = (1 + (self.pos_weight - 1) * target) * ce * (1 - p_t) ** self.focal_gamma
            if self.class_weight is None:
                return per_cell.mean()
        return (per_cell.mean((0, 2, 3)) * self.class_weight).sum()  # class_weight sums to 1
