"""The segmentation head: a 1x1 conv from the decoder's BEV features to one logit map per object and map class
(LSS's last BevEncode conv)."""

from __future__ import annotations

import torch
from torch import nn


class SegmentationHead(nn.Module):
    """(B, in_channels, X, Y) features -> (B, num_classes, X, Y) logits in the default memory layout."""

    def __init__(self, in_channels: int, num_classes: int = 1):
        super().__init__()
        self.num_classes = int(num_classes)
        self.conv = nn.Conv2d(in_channels, self.num_classes, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.conv(features).contiguous()  # the features may be channels_last


def build(in_channels: int, grid=None, num_classes: int = 1) -> SegmentationHead:
    """The segmentation head (model.net.heads.segmentation: num_classes, the object then map classes)."""
    return SegmentationHead(in_channels, num_classes)
