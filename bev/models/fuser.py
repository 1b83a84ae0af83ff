"""BEVFusion's ConvFuser: the camera and LiDAR BEV maps concatenated on channels, then a 3x3 conv, BN and ReLU."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class ConvFuser(nn.Module):
    """[(B, C_i, X, Y), ...] (camera first, then LiDAR) -> (B, out_channels, X, Y)."""

    def __init__(self, in_channels: Sequence[int], out_channels: int):
        super().__init__()
        self.in_channels, self.out_channels = tuple(int(c) for c in in_channels), int(out_channels)
        self.conv = nn.Conv2d(sum(self.in_channels), self.out_channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(self.out_channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, maps: Sequence[torch.Tensor]) -> torch.Tensor:
        got = tuple(m.shape[1] for m in maps)
        if got != self.in_channels:
            raise ValueError(f"the fuser takes BEV maps of {list(self.in_channels)} channels, got {list(got)}")
        return self.relu(self.norm(self.conv(torch.cat(list(maps), 1))))


def build_fuser(in_channels: Sequence[int], kind: str = "conv", out_channels: int | None = None) -> ConvFuser:
    """model.net.fuser: kind "conv" (ConvFuser); out_channels null: the camera branch's width (the first input's),
    so the decoder reads as many channels as in the camera-only model."""
    if kind != "conv":
        raise ValueError(f"model.net.fuser.kind must be conv (BEVFusion's ConvFuser), got {kind!r}")
    return ConvFuser(in_channels, in_channels[0] if out_channels is None else out_channels)


__all__ = ["ConvFuser", "build_fuser"]
