"""Loss helpers shared by the tasks and the LightningModules: learned task weighting (UncertaintyWeights: the
static module's segmentation + detection, the motion task's terms) and the stop at a non-finite training loss."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


class UncertaintyWeights(nn.Module):
    """Kendall et al.'s task weighting, as FIERY: total = sum_i L_i / (2 exp(s_i)) + s_i / 2, with a
    learned log-variance s_i per term. The total can go negative.

    init "zero": s_i start at 0 (weight 1/2, FIERY). init "loss": at the first training batch each s_i
    is set to log L_i, the optimum of the weighting for that batch, so every term starts out
    contributing alike (~1/2) instead of in proportion to its units (offsets of several cells against
    a BCE of 0.1).
    """

    def __init__(self, names: tuple[str, ...], init: str = "zero"):
        super().__init__()
        if init not in ("zero", "loss"):
            raise ValueError(f"model.motion.loss.uncertainty_init must be 'zero' or 'loss', got {init!r}")
        self.log_vars = nn.ParameterDict({n: nn.Parameter(torch.zeros(())) for n in names})
        self.register_buffer("pending", torch.tensor(init == "loss"))  # saved: a resumed run does not start over
        self._pending_read = False  # the buffer is read from the device once: no host sync in later steps

    def _load_from_state_dict(self, *args, **kwargs):
        self._pending_read = False  # a loaded buffer is read again
        super()._load_from_state_dict(*args, **kwargs)

    def forward(self, terms: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if self.training and not self._pending_read:
            self._pending_read = True
            if bool(self.pending):
                with torch.no_grad():
                    for name, value in terms.items():
                        self.log_vars[name].copy_(value.detach().float().clamp(min=1e-4).log())
                    self.pending.fill_(False)
        total = 0.0
        for name, value in terms.items():
            s = self.log_vars[name]
            total = total + 0.5 * torch.exp(-s) * value + 0.5 * s
        return total


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite."""


def check_finite(loss: torch.Tensor, terms: Mapping[str, torch.Tensor], step: int, epoch: int, batch_idx: int) -> None:
    """Stop training at a NaN or infinite loss, naming the step and the terms that went bad."""
    if bool(torch.isfinite(loss)):
        return
    bad = [k for k, v in terms.items() if not bool(torch.isfinite(v).all())]
    raise NonFiniteLossError(
        f"the training loss is {float(loss.detach())} at step {step} (epoch {epoch}, batch {batch_idx}); non-finite terms: "
        f"{', '.join(bad) if bad else 'none (their weighting overflowed)'}. Start from a static checkpoint "
        f"(model.init_from=<static run>/checkpoints), lower model.optimizer.lr, or keep trainer.gradient_clip_val set."
    )
