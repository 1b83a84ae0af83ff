"""BEV encoder: the LSS ResNet-18 trunk (conv1, layer1-3) with two up-sampling steps back to full size."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bev.models.camera import Up, resnet_stage
from bev.utils.precision import resolve_channels_last


class BevEncoder(nn.Module):
    """(B, Cin, X, Y) -> (B, num_classes, X, Y): logits(features(x)), logits = the 1x1 conv `head`.

    features(x) (B, feature_channels, X, Y) is everything before the final 1x1 conv `head`, for
    other heads to read (the temporal model's future heads, a detection head). With widths (64, 128, 256) and blocks 2 this is LSS's BevEncode (ResNet-18 conv1 + layer1-3);
    narrower widths give the cheap CPU variant with the same shape. channels_last: as in
    bev.models.camera.CameraEncoder (NHWC convolutions, default-layout input and output).
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int = 1,
        widths: tuple[int, int, int] = (64, 128, 256),
        blocks: int = 2,
        channels_last: bool | str = False,
        task_decoders: bool = False,
    ):
        super().__init__()
        if len(widths) != 3:
            raise ValueError(f"BEV encoder needs 3 widths, got {list(widths)}")
        w0, w1, w2 = widths
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, w0, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(w0), nn.ReLU(inplace=True)
        )
        self.layer1 = resnet_stage(w0, w0, blocks, 1)
        self.layer2 = resnet_stage(w0, w1, blocks, 2)
        self.layer3 = resnet_stage(w1, w2, blocks, 2)
        self.up1 = Up(w2 + w0, w2)
        # The head stays the last element of up2 so that the state_dict keys (up2.3.*) of existing
        # checkpoints are unchanged; `head` and `features` name the split.
        self.up2 = nn.Sequential(
            nn.Conv2d(w2, w1, 3, padding=1, bias=False),
            nn.BatchNorm2d(w1),
            nn.ReLU(inplace=True),
            nn.Conv2d(w1, num_classes, 1),
        )
        # task_decoders: a second up path of the same shape for the detection head (BEVFusion's neck per task): the
        # encoder is shared, segmentation and boxes each get their own decoder.
        self.det_up1 = Up(w2 + w0, w2) if task_decoders else None
        self.det_up2 = self._decoder_tail(w2, w1) if task_decoders else None
        # Zero-init the last BN of each residual block (torchvision's zero_init_residual), as LSS does.
        for m in self.modules():
            if hasattr(m, "bn2") and isinstance(m.bn2, nn.BatchNorm2d):
                nn.init.zeros_(m.bn2.weight)
        self.channels_last = resolve_channels_last(channels_last, self)
        if self.channels_last:
            self.to(memory_format=torch.channels_last)

    def widen_input(self, copies: int) -> None:
        """Take `copies` inputs concatenated on channels (BEVDet4D's aligned frames, the present last): the stem
        conv reads all of them, its weights on the last copy as before and zero on the others, so the encoder
        starts out reading the last copy alone."""
        old = self.stem[0]
        new = nn.Conv2d(
            old.in_channels * copies, old.out_channels, old.kernel_size, old.stride, old.padding, bias=False
        )
        with torch.no_grad():
            new.weight.zero_()
            new.weight[:, -old.in_channels :] = old.weight
        self.stem[0] = new.to(memory_format=torch.channels_last) if self.channels_last else new

    @property
    def head(self) -> nn.Conv2d:
        """The final 1x1 conv: features -> num_classes logits."""
        return self.up2[-1]

    @property
    def feature_channels(self) -> int:
        return self.head.in_channels

    @staticmethod
    def _decoder_tail(w2: int, w1: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(w2, w1, 3, padding=1, bias=False), nn.BatchNorm2d(w1), nn.ReLU(inplace=True))

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, Cin, X, Y) -> the skip (stride 2) and the deepest (stride 8) features, shared by every decoder."""
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x1 = self.layer1(self.stem(x))
        return x1, self.layer3(self.layer2(x1))

    @staticmethod
    def _decode(up1: nn.Module, tail: nn.Module, x1: torch.Tensor, x3: torch.Tensor, size) -> torch.Tensor:
        x = F.interpolate(up1(x3, x1), size=size, mode="bilinear", align_corners=True)
        return tail(x)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Cin, X, Y) -> (B, feature_channels, X, Y), the input of `head`."""
        return self._decode(self.up1, self.up2[:-1], *self._encode(x), x.shape[-2:])

    def task_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(segmentation features, detection features), each (B, feature_channels, X, Y): one encoder pass, then
        each task's decoder (the same features twice without task_decoders)."""
        x1, x3 = self._encode(x)
        seg = self._decode(self.up1, self.up2[:-1], x1, x3, x.shape[-2:])
        if self.det_up1 is None:
            return seg, seg
        return seg, self._decode(self.det_up1, self.det_up2, x1, x3, x.shape[-2:])

    def copy_decoder_to_detection(self) -> None:
        """Start the detection decoder as a copy of the segmentation decoder (a static checkpoint has only that)."""
        with torch.no_grad():
            for mine, theirs in ((self.det_up1, self.up1), (self.det_up2, self.up2[:-1])):
                for a, b in zip(mine.state_dict().values(), theirs.state_dict().values()):
                    a.copy_(b)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """head(features) in the default memory layout (the features may be channels_last)."""
        return self.head(features).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.features(x))
