"""Losses of the temporal model (FIERY's, configurable), each over the present and the F future frames.

Shapes: predictions (B, T, C, X, Y) with T = F + 1 (index 0 the present frame); targets as the data
gives them: segmentation (B, T, X, Y) int64 0/1, centerness (B, T, 1, X, Y), offset and flow
(B, T, 2, X, Y). IGNORE (bev.tasks.motion, 255 as in FIERY) marks cells without a label; they never count.
Frame t's loss is weighted by future_discount ** t. A term with no labelled cell is 0 (still part of
the graph), not the NaN of a mean over nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from bev.losses import UncertaintyWeights
from bev.tasks.motion import IGNORE

TERMS = ("segmentation", "centerness", "offset", "flow")


def discounts(frames: int, future_discount: float, device=None) -> torch.Tensor:
    """(T,) weights future_discount ** t, t = 0 (present) .. T - 1."""
    return future_discount ** torch.arange(frames, dtype=torch.float32, device=device)


def _masked_mean(per_cell: torch.Tensor, valid: torch.Tensor, future_discount: float) -> torch.Tensor:
    """Mean over valid cells of (B, T, ...) losses, frame t weighted by future_discount ** t."""
    per_frame = (per_cell * valid).flatten(2).sum((0, 2))  # (T,): one pass over the cells, then T weights
    w = discounts(per_frame.shape[0], future_discount, per_frame.device)
    return (per_frame * w).sum() / valid.sum().clamp(min=1)  # no labelled cell: 0, and no host sync


def segmentation_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    pos_weight: float = 2.0,
    top_k: float | None = None,
    future_discount: float = 0.95,
) -> torch.Tensor:
    """BCE of (B, T, 1, X, Y) logits against (B, T, X, Y) 0/1 labels, positives weighted by pos_weight.

    top_k in (0, 1]: FIERY's bootstrapping: per sample and frame only the top_k fraction of cells
    with the largest loss count (FIERY keeps 25 %, with weights 1 and 2 on its two classes).
    """
    logits = logits.float().squeeze(2)
    valid = target != IGNORE
    y = torch.where(valid, target, torch.zeros_like(target)).float()
    per_cell = F.binary_cross_entropy_with_logits(
        logits, y, pos_weight=logits.new_tensor(float(pos_weight)), reduction="none"
    )
    if top_k is None or top_k >= 1:
        return _masked_mean(per_cell, valid, future_discount)
    if not 0 < top_k:
        raise ValueError(f"segmentation top_k must be in (0, 1], got {top_k}")
    w = discounts(per_cell.shape[1], future_discount, per_cell.device).view(1, -1, 1)
    flat = (per_cell * valid).flatten(2) * w  # ignored cells have loss 0, so they fall out of the top k
    k = max(1, math.ceil(top_k * flat.shape[-1]))
    return flat.topk(k, dim=-1).values.mean()


def regression_loss(
    pred: torch.Tensor, target: torch.Tensor, norm: int = 1, future_discount: float = 0.95
) -> torch.Tensor:
    """L1 (norm=1) or squared L2 (norm=2) of (B, T, C, X, Y) vectors, summed over C, mean over labelled cells
    (a cell is labelled when no channel is IGNORE)."""
    valid = (target != IGNORE).all(dim=2, keepdim=True)
    # Mixed-precision subtraction (a bf16 prediction is read as is, the result is fp32): half the passes of
    # a .float() copy first. Finite at ignored cells too (IGNORE - x), where valid zeroes it.
    diff = pred - target.float()
    per_cell = diff.abs() if norm == 1 else diff.square()
    return _masked_mean(per_cell, valid, future_discount)


def gaussian_kl(
    mu_q: torch.Tensor, log_var_q: torch.Tensor, mu_p: torch.Tensor, log_var_p: torch.Tensor
) -> torch.Tensor:
    """KL(q || p) of diagonal Gaussians (B, L), summed over L, mean over B (FIERY: q the future, p the present)."""
    kl = 0.5 * (log_var_p - log_var_q + (log_var_q.exp() + (mu_q - mu_p) ** 2) / log_var_p.exp() - 1)
    return kl.sum(-1).mean()


class TemporalLoss(nn.Module):
    """The future heads' losses -> (total, {term: value}).

    weights: a fixed multiplier per term (segmentation, centerness, offset, flow, and "bev" when the
    caller adds the static head's loss, "kl" for the probabilistic model); uncertainty: learned
    weighting on top (UncertaintyWeights, started as uncertainty_init says; the KL term keeps its
    fixed weight, as FIERY's).
    """

    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        uncertainty: bool = True,
        future_discount: float = 0.95,
        seg_pos_weight: float = 2.0,
        seg_top_k: float | None = None,
        extra_terms: tuple[str, ...] = ("bev",),
        uncertainty_init: str = "zero",
    ):
        super().__init__()
        names = TERMS + tuple(extra_terms)
        self.weights = {n: 1.0 for n in (*names, "kl")}
        unknown = [k for k in (weights or {}) if k not in self.weights]
        if unknown:
            raise ValueError(f"model.motion.loss.weights names unknown term(s) {unknown}; terms: {list(self.weights)}")
        for k, v in (weights or {}).items():
            _check_number(f"weights.{k}", v, "a finite number >= 0 (0 leaves the term out)", lambda x: x >= 0)
        self.weights.update({k: float(v) for k, v in (weights or {}).items()})
        _check_number("future_discount", future_discount, "in (0, 1] (frame t weighs discount^t)", lambda g: 0 < g <= 1)
        _check_number("seg_pos_weight", seg_pos_weight, "a finite number >= 0", lambda w: w >= 0)
        if seg_top_k is not None:
            _check_number(
                "seg_top_k", seg_top_k, "in (0, 1] (the fraction of cells kept), or null", lambda k: 0 < k <= 1
            )
        if not isinstance(uncertainty, bool):  # "maybe" would read as true
            raise ValueError(f"model.motion.loss.uncertainty must be true or false, got {uncertainty!r}")
        self.future_discount, self.seg_pos_weight, self.seg_top_k = (
            float(future_discount),
            float(seg_pos_weight),
            seg_top_k,
        )
        self.uncertainty = UncertaintyWeights(names, uncertainty_init) if uncertainty else None

    def terms(self, out: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each future head's unweighted loss."""
        g = self.future_discount
        return {
            "segmentation": segmentation_loss(
                out["segmentation"], batch["segmentation"], self.seg_pos_weight, self.seg_top_k, g
            ),
            "centerness": regression_loss(out["centerness"], batch["centerness"], 2, g),
            "offset": regression_loss(out["offset"], batch["offset"], 1, g),
            "flow": regression_loss(out["flow"], batch["flow"], 1, g),
        }

    def forward(
        self,
        out: Mapping[str, torch.Tensor],
        batch: Mapping[str, torch.Tensor],
        extra: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        terms = {**self.terms(out, batch), **dict(extra or {})}
        kl = None
        if "future_mu" in out:
            kl = gaussian_kl(out["future_mu"], out["future_log_var"], out["present_mu"], out["present_log_var"])
        weighted = {k: self.weights[k] * v for k, v in terms.items() if self.weights[k]}
        total = self.uncertainty(weighted) if self.uncertainty is not None else sum(weighted.values())
        if kl is not None:
            terms["kl"] = kl
            total = total + self.weights["kl"] * kl
        return total, terms


def _check_number(key: str, value, want: str, ok) -> None:
    """model.motion.loss.<key> is a finite number for which ok(value) holds, else a ValueError naming it."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (number and ok(value)):
        raise ValueError(f"model.motion.loss.{key} must be {want}, got {value!r}")
