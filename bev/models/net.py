"""The BEV network, composed as BEVFusion's: encoders -> (fuser) -> decoder -> heads.

  camera     LiftSplat: image encoder + depth distribution, lifted and splatted into the BEV voxel grid (bev.ops)
  temporal   optional: the past frames' BEV features warped into the present and fused (FIERY, BEVDet4D)
  decoder    BevDecoder (2D, LSS's BevEncode) or VoxelDecoder3d (3D, BEVDet-Occ), shared by the heads
  heads      one per task, from its package (bev.tasks.<task>.head): segmentation, detection, motion, occupancy

Static, temporal and occupancy models are configurations of this one class (model.net in the configs). The
output is a dict: each task's output under its name, and "depth", the camera depth logits (B, N, D, fH, fW).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from bev.geometry import Grid
from bev.models.decoder import build_decoder
from bev.models.lift import LiftSplat
from bev.models.temporal import Temporal
from bev.tasks import TASKS, build_head

# Heads are built in this order (the motion head after the temporal part): a seed gives the same weights as ever.
HEAD_ORDER = ("segmentation", "detection", "occupancy")


class BEVNet(nn.Module):
    """Cameras -> {task: output, "depth": depth logits}.

    forward(images, intrinsics, rots, trans, post_rots, post_trans): (B, N, ...) camera tensors; with a temporal
    part (B, P+1, N, ...) windows (the present last) and future_egomotion (B, >= P, 4, 4), entry t mapping frame
    t's ego coordinates to frame t+1's. past_no_grad runs the past frames' camera branch without gradient
    (BEVDet4D); past_features (B, P, C * Z, X, Y) replaces it (features computed before); future_labels feed a
    probabilistic motion head in training; return_features adds the present's BEV features ("present_features").
    Outputs: "segmentation" (B, K, X, Y) logits, "detection" {"heatmap", "regression"}, "motion" {"segmentation",
    "centerness", "offset", "flow", ...} (B, F+1, ...), "occupancy" (B, 18, 200, 200, 16) logits.
    """

    def __init__(
        self,
        grid: Grid | Mapping[str, Any] | None,
        image_size: tuple[int, int] = (128, 352),
        camera: Mapping[str, Any] | None = None,
        decoder: Mapping[str, Any] | None = None,
        heads: Mapping[str, Mapping[str, Any] | None] | None = None,
        temporal: Mapping[str, Any] | None = None,
    ):
        super().__init__()
        heads = {k: v for k, v in (heads or {"segmentation": {}}).items() if v is not None}  # null: no such head
        self.camera = LiftSplat(grid, image_size, **dict(camera or {}))
        self.grid, self.image_size = self.camera.grid, self.camera.image_size
        self.decoder = build_decoder(self.camera.out_channels, self.grid.nz, **dict(decoder or {}))
        built = {name: self._head(name, heads[name]) for name in HEAD_ORDER if name in heads}
        self.temporal = None if temporal is None else Temporal(self.grid, self.camera.out_channels, **dict(temporal))
        if self.temporal is not None and self.temporal.copies > 1:
            self.decoder.widen_input(self.temporal.copies)
        built.update({name: self._head(name, opts) for name, opts in heads.items() if name not in HEAD_ORDER})
        self.heads = nn.ModuleDict({name: built[name] for name in heads})
        self._check_parts()

    def _head(self, name: str, options: Mapping[str, Any] | None) -> nn.Module:
        head = build_head(name, self.decoder.out_channels, self.grid, options)
        if getattr(head, "volumetric", False) != self.decoder.volumetric:
            kind = "a 3D (voxel3d)" if self.decoder.volumetric else "a 2D (bev)"
            raise ValueError(
                f"model.net.heads.{name} does not read the features of {kind} decoder: set model.net.decoder.kind "
                "to the one it reads (occupancy's voxel3d head: voxel3d; every other head: bev)"
            )
        return head

    def _check_parts(self) -> None:
        if "motion" in self.heads and self.temporal is None:
            raise ValueError("model.net.heads.motion needs past frames: set model.net.temporal (model=temporal_small)")
        if not self.heads:
            raise ValueError(f"model.net.heads is empty: give one or more of {list(TASKS)}")

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks this network has heads for."""
        return tuple(self.heads)

    @property
    def past_frames(self) -> int | None:
        """Past frames a window holds (None: the network takes single frames)."""
        return None if self.temporal is None else self.temporal.past_frames

    @property
    def num_classes(self) -> int | None:
        """Segmentation channels (object then map classes); None without a segmentation head."""
        head = self.heads["segmentation"] if "segmentation" in self.heads else None
        return None if head is None else head.num_classes

    @contextlib.contextmanager
    def exportable(self) -> Iterator[BEVNet]:
        """Within this block forward() splats with a plain scatter-add (for torch.onnx.export)."""
        with self.camera.exportable():
            yield self

    def forward(
        self,
        images,
        intrinsics,
        rots,
        trans,
        post_rots,
        post_trans,
        future_egomotion: torch.Tensor | None = None,
        *,
        past_no_grad: bool = False,
        past_features: torch.Tensor | None = None,
        future_labels: Mapping[str, torch.Tensor] | None = None,
        return_features: bool = False,
    ) -> dict[str, Any]:
        cams = (images, intrinsics, rots, trans, post_rots, post_trans)
        out: dict[str, Any] = {}
        if self.temporal is None:
            feats, out["depth"] = self.camera(*cams)
        else:
            feats = self._fused(cams, future_egomotion, past_no_grad, past_features, out)
        decoded = self.decoder(feats)
        for name, head in self.heads.items():
            x = decoded.get(name, decoded["shared"])
            out[name] = head(x, future_labels) if getattr(head, "takes_labels", False) else head(x)
        if not return_features:
            out.pop("present_features", None)
        return out

    def _fused(self, cams, future_egomotion, past_no_grad: bool, past_features, out: dict) -> torch.Tensor:
        """The temporal part's input: the past frames' and the present's BEV features, fused."""
        self._check_frames(cams[0], future_egomotion)
        if past_features is None:
            past, present = self.frame_features(cams, past_no_grad, out)
        else:
            past = past_features
            present, out["depth"] = self.camera(*(c[:, -1] for c in cams))
        out["present_features"] = present
        return self.temporal(past, present, future_egomotion)

    def frame_features(self, cams: tuple[torch.Tensor, ...], past_no_grad: bool, out: dict | None = None):
        """Camera inputs (B, T, N, ...) -> BEV features, each frame in its own ego frame: the past frames'
        (B, T-1, C * Z, X, Y) and the present's (B, C * Z, X, Y); the present's depth logits go to out["depth"]."""
        out = {} if out is None else out
        B, T = cams[0].shape[:2]
        if not past_no_grad or T == 1:
            feats, depth = self.camera(*(c.flatten(0, 1) for c in cams))
            feats, out["depth"] = feats.unflatten(0, (B, T)), depth.unflatten(0, (B, T))[:, -1]
            return feats[:, :-1], feats[:, -1]
        # Inference mode (no autograd bookkeeping at all: faster than no_grad); the past stays a tensor of its own,
        # as a slice of one joint with the present's would carry gradients back through the warp.
        with torch.inference_mode():
            past = self.camera(*(c[:, :-1].flatten(0, 1) for c in cams))[0].unflatten(0, (B, T - 1))
        present, out["depth"] = self.camera(*(c[:, -1] for c in cams))
        return past, present

    def _check_frames(self, images: torch.Tensor, future_egomotion: torch.Tensor | None) -> None:
        frames = self.past_frames + 1
        if images.dim() != 6 or images.shape[1] != frames:
            raise ValueError(
                f"the network takes windows of past_frames + 1 = {frames} frames (images (B, {frames}, N, 3, H, W)), "
                f"got images {tuple(images.shape)}"
            )
        if future_egomotion is None:
            raise ValueError("the temporal network needs future_egomotion (B, >= past_frames, 4, 4)")
