"""Temporal fusion (FIERY's and BEVDet4D's): the past frames' BEV features warped into the present ego frame
with the cumulative ego motion (bilinear) and fused with the present's, before the decoder.

- residual: a conv over all aligned frames added to the present frame's features (its last conv starts at zero, so
  an untrained fusion passes the present through: a model initialised from a static checkpoint starts out as it).
- concat (BEVDet4D): the aligned frames side by side, the decoder reads them all (BevDecoder.widen_input).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bev.geometry import Grid
from bev.tasks.motion.head import conv_bn_relu

FUSIONS = ("residual", "concat")


def planar(motion: torch.Tensor) -> torch.Tensor:
    """(..., 4, 4) ego motions -> (..., 3, 3) 2D rigid transforms of their x, y translation and yaw."""
    yaw = torch.atan2(motion[..., 1, 0], motion[..., 0, 0])
    c, s = torch.cos(yaw), torch.sin(yaw)
    zero, one = torch.zeros_like(c), torch.ones_like(c)
    rows = [c, -s, motion[..., 0, 3], s, c, motion[..., 1, 3], zero, zero, one]
    return torch.stack(rows, dim=-1).view(*motion.shape[:-2], 3, 3)


def past_to_present(future_egomotion: torch.Tensor, past_frames: int) -> torch.Tensor:
    """(B, T', 4, 4) motions t -> t+1 -> (B, P, 3, 3) planar transforms of each past frame t < P to the present P."""
    steps = planar(future_egomotion[:, :past_frames].float())
    out, acc = [], torch.eye(3, dtype=steps.dtype, device=steps.device).expand_as(steps[:, 0])
    for t in range(past_frames - 1, -1, -1):  # present <- P-1 <- ... <- t
        acc = acc @ steps[:, t]
        out.append(acc)
    return torch.stack(out[::-1], dim=1)


def rigid_inverse(m: torch.Tensor) -> torch.Tensor:
    """Inverse of (..., 3, 3) 2D rigid transforms [R t; 0 1] -> [R^T -R^T t; 0 1]."""
    rt = m[..., :2, :2].transpose(-1, -2)
    out = m.clone()
    out[..., :2, :2] = rt
    out[..., :2, 2] = -(rt @ m[..., :2, 2:]).squeeze(-1)
    return out


def warp_theta(present_to_past: torch.Tensor, grid: Grid) -> torch.Tensor:
    """(M, 3, 3) metric maps present -> past -> (M, 2, 3) affine_grid matrices (align_corners=False).

    A BEV map is (C, X, Y): grid_sample's height is x, its width y, so its normalised coordinates
    are (u_y, u_x), each u = (metres - centre) / half-extent (cell centres at (2i + 1) / n - 1).
    """
    (x0, x1, _), (y0, y1, _) = grid.xbound, grid.ybound
    norm = present_to_past.new_tensor([[(x1 - x0) / 2, 0, (x0 + x1) / 2], [0, (y1 - y0) / 2, (y0 + y1) / 2], [0, 0, 1]])
    swap = present_to_past.new_tensor([[0.0, 1, 0], [1, 0, 0], [0, 0, 1]])  # (x, y) <-> (y, x) order
    a = torch.linalg.inv(norm) @ present_to_past @ norm  # normalised present (x, y) -> normalised past (x, y)
    return (swap @ a @ swap)[:, :2]


def warp_to_present(feats: torch.Tensor, future_egomotion: torch.Tensor, grid: Grid) -> torch.Tensor:
    """(B, P, C, X, Y) BEV features of past frames 0..P-1, each in its own ego frame -> the same in the
    present frame P's (bilinear; cells that were outside a past grid get zeros)."""
    B, P, C, X, Y = feats.shape
    # fp32 under autocast: bf16 matmuls would move the motions by up to 0.25 m (CUDA linalg.inv refuses bf16)
    with torch.autocast(feats.device.type, enabled=False):
        theta = warp_theta(rigid_inverse(past_to_present(future_egomotion, P)).flatten(0, 1), grid)
        sample = F.affine_grid(theta, [B * P, C, X, Y], align_corners=False)
        out = F.grid_sample(
            feats.flatten(0, 1).float(), sample, mode="bilinear", padding_mode="zeros", align_corners=False
        )
    return out.to(feats.dtype).view(B, P, C, X, Y)


class Temporal(nn.Module):
    """Past frames (B, P, C, X, Y) and the present (B, C, X, Y), each in its own ego frame -> the present's fused
    features: (B, C, X, Y) (residual) or (B, (P + 1) C, X, Y) (concat; `copies` = P + 1 for the decoder).
    future_egomotion (B, >= P, 4, 4): entry t maps frame t's ego coordinates to frame t+1's.

    residual: the present plus a kernel x kernel conv over all frames' features concatenated, then a 1x1
    (hidden width `fusion_channels`, default the BEV feature width)."""

    def __init__(
        self,
        grid: Grid,
        channels: int,
        past_frames: int = 2,
        fusion: str = "residual",
        fusion_channels: int | None = None,
        fusion_kernel: int = 3,
    ):
        super().__init__()
        if past_frames < 0:
            raise ValueError(f"model.net.temporal.past_frames must be >= 0, got {past_frames}")
        if fusion not in FUSIONS:
            raise ValueError(f"model.net.temporal.fusion must be one of {FUSIONS}, got {fusion!r}")
        self.grid, self.past_frames = grid, int(past_frames)
        self.concat = fusion == "concat" and self.past_frames > 0
        self.copies = self.past_frames + 1 if self.concat else 1
        self.mix = None
        if self.past_frames and not self.concat:
            hidden = fusion_channels or channels
            frames = self.past_frames + 1
            self.mix = nn.Sequential(
                conv_bn_relu(channels * frames, hidden, fusion_kernel), nn.Conv2d(hidden, channels, 1)
            )
            nn.init.zeros_(self.mix[-1].weight)
            nn.init.zeros_(self.mix[-1].bias)

    def forward(self, past: torch.Tensor, present: torch.Tensor, future_egomotion: torch.Tensor) -> torch.Tensor:
        if not self.past_frames:
            return present
        frames = torch.cat([warp_to_present(past, future_egomotion, self.grid), present.unsqueeze(1)], dim=1)
        if self.concat:
            return frames.flatten(1, 2)
        return frames[:, -1] + self.mix(frames.flatten(1, 2))
