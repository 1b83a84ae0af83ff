"""FIERY's present and future heads on the decoder's BEV features, time folded into channels (PowerBEV's
deterministic future): for the present and each of the F future frames `segmentation` (B, F+1, 1, X, Y) vehicle
logits, `centerness` (B, F+1, 1, X, Y), `offset` and `flow` (B, F+1, 2, X, Y) in grid cells, channel 0 along x.
With probabilistic=True, FIERY's present / future Gaussian latents condition them (the future distribution sees
the future labels in training; KL between the two): "present_mu", "present_log_var" (and "future_*")."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from bev.tasks.motion import IGNORE

# Outputs and their channels per frame.
FUTURE_HEAD_CHANNELS = {"segmentation": 1, "centerness": 1, "offset": 2, "flow": 2}


def conv_bn_relu(cin: int, cout: int, k: int = 3) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
    )


class GaussianLatent(nn.Module):
    """Features (B, C, X, Y) -> mean and log-variance (B, L) of a diagonal Gaussian (FIERY's distributions,
    pooled globally to stay cheap)."""

    def __init__(self, in_channels: int, latent_dim: int, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(
            conv_bn_relu(in_channels, hidden), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(hidden, 2 * latent_dim)
        )
        self.latent_dim = latent_dim

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, log_var = self.net(x).float().chunk(2, dim=1)
        return mu, log_var.clamp(-10.0, 10.0)


class FutureHeads(nn.Module):
    """BEV features (B, Cf, X, Y) -> per-frame outputs: two branches, segmentation + centerness and offset + flow,
    each an optional 3x3 conv then a 1x1 conv to frames x channels."""

    def __init__(self, in_channels: int, frames: int, hidden: int = 0):
        super().__init__()
        self.frames = frames
        self.groups = {"instance": ("segmentation", "centerness"), "motion": ("offset", "flow")}
        self.branches = nn.ModuleDict()
        for name, heads in self.groups.items():
            out = frames * sum(FUTURE_HEAD_CHANNELS[h] for h in heads)
            pre = [conv_bn_relu(in_channels, hidden)] if hidden else []
            self.branches[name] = nn.Sequential(*pre, nn.Conv2d(hidden or in_channels, out, 1))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        B, _, X, Y = x.shape
        out = {}
        for name, heads in self.groups.items():
            y = self.branches[name](x)
            sizes = [self.frames * FUTURE_HEAD_CHANNELS[h] for h in heads]
            for head, part in zip(heads, y.split(sizes, dim=1)):
                out[head] = part.view(B, self.frames, FUTURE_HEAD_CHANNELS[head], X, Y)
        return out


class MotionHead(nn.Module):
    """(B, Cf, X, Y) features of the present (fused with the past) -> the present and future_frames frames'
    outputs (module doc); future_labels (training, probabilistic) feed the future distribution."""

    takes_labels = True

    def __init__(
        self,
        in_channels: int,
        future_frames: int = 4,
        head_channels: int = 0,
        probabilistic: bool = False,
        latent_dim: int = 16,
    ):
        super().__init__()
        if future_frames < 0:
            raise ValueError(f"model.net.heads.motion.future_frames must be >= 0, got {future_frames}")
        self.future_frames = int(future_frames)
        self.probabilistic, self.latent_dim = bool(probabilistic), int(latent_dim) if probabilistic else 0
        frames = self.future_frames + 1
        if self.probabilistic:
            self.present_dist = GaussianLatent(in_channels, self.latent_dim)
            self.future_dist = GaussianLatent(in_channels + frames * (1 + 2), self.latent_dim)  # + segmentation, flow
        self.future = FutureHeads(in_channels + self.latent_dim, frames, head_channels)

    def forward(self, x: torch.Tensor, future_labels: Mapping[str, torch.Tensor] | None = None) -> dict:
        out: dict[str, torch.Tensor] = {}
        if self.probabilistic:
            x = self._with_latent(x, out, future_labels)
        out.update(self.future(x))
        return out

    def start_from(self, static: nn.Conv2d, object_class: int = 0) -> bool:
        """Every frame's segmentation logits start as the static segmentation conv's of one object class: the
        present copied to every future frame, the baseline the future learns from. False (nothing done) when a
        3x3 conv sits in between (head_channels > 0)."""
        seg = self.future.branches["instance"][-1]
        if seg.in_channels != static.in_channels + self.latent_dim:
            return False
        frames, cf = self.future.frames, static.in_channels
        with torch.no_grad():
            seg.weight[:frames] = 0.0  # the latent's columns too
            seg.weight[:frames, :cf] = static.weight[object_class]
            seg.bias[:frames] = static.bias[object_class]
        return True

    def _with_latent(self, x: torch.Tensor, out: dict, future_labels: Mapping[str, torch.Tensor] | None):
        """FIERY's conditioning: a latent sampled from the future distribution (training, given the future
        labels) or the present one's mean (inference), broadcast as extra channels."""
        out["present_mu"], out["present_log_var"] = self.present_dist(x)
        if future_labels is not None:
            labels = torch.cat(
                [_no_ignore(future_labels["segmentation"]), _no_ignore(future_labels["flow"]).flatten(1, 2)], 1
            )
            mu, log_var = self.future_dist(torch.cat([x, labels.to(x.dtype)], dim=1))
            out["future_mu"], out["future_log_var"] = mu, log_var
            z = mu + torch.randn_like(mu) * (0.5 * log_var).exp() if self.training else mu
        else:
            z = out["present_mu"]
        return torch.cat([x, z.to(x.dtype)[:, :, None, None].expand(-1, -1, *x.shape[-2:])], dim=1)


def _no_ignore(t: torch.Tensor) -> torch.Tensor:
    """Labels with the IGNORE value replaced by zero (an input, not a target)."""
    return torch.where(t == IGNORE, torch.zeros_like(t), t).float()


def build(in_channels: int, grid=None, **options) -> MotionHead:
    """FIERY's heads (model.net.heads.motion: future_frames, head_channels, probabilistic, latent_dim)."""
    return MotionHead(in_channels, **options)
