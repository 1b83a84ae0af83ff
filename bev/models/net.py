"""The BEV network, composed as BEVFusion's: encoders -> (fuser) -> decoder -> heads.

  camera     LiftSplat: image encoder + depth distribution, lifted and splatted into the BEV voxel grid (bev.ops)
  lidar      optional: LidarEncoder, points -> pillars on the same grid (bev.ops) -> SECOND backbone (bev.models.lidar)
  temporal   optional: the past frames' BEV features warped into the present and fused (FIERY, BEVDet4D)
  fuser      with both: ConvFuser, the camera (after temporal) and LiDAR BEV maps concatenated, conv (BEVFusion)
  decoder    BevDecoder (2D, LSS's BevEncode) or VoxelDecoder3d (3D, BEVDet-Occ), shared by the heads
  heads      one per task, from its package (bev.tasks.<task>.head): segmentation, detection, motion, occupancy

Static, temporal, occupancy, camera-only, LiDAR-only and fused models are configurations of this one class
(model.net in the configs). The output is a dict: each task's output under its name, and "depth", the camera depth
logits (B, N, D, fH, fW), with a camera branch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from bev.geometry import Grid
from bev.models.decoder import build_decoder
from bev.models.fuser import build_fuser
from bev.models.lidar import LidarEncoder
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

    lidar: LidarEncoder's options (None: no LiDAR branch); then camera None means no camera branch (LiDAR-only;
    without lidar, None is the default camera branch, as ever); fuser: build_fuser's options, needed with both
    branches. points= (P, 6) rows (batch index, x, y, z, intensity, time lag), as bev.data.lidar.collate_points
    batches them; the batch size is the cameras', else batch_size=, else the last batch index + 1. A network
    without a LiDAR branch ignores points.
    """

    def __init__(
        self,
        grid: Grid | Mapping[str, Any] | None,
        image_size: tuple[int, int] = (128, 352),
        camera: Mapping[str, Any] | None = None,
        decoder: Mapping[str, Any] | None = None,
        heads: Mapping[str, Mapping[str, Any] | None] | None = None,
        temporal: Mapping[str, Any] | None = None,
        lidar: Mapping[str, Any] | None = None,
        fuser: Mapping[str, Any] | None = None,
    ):
        super().__init__()
        heads = {k: v for k, v in (heads or {"segmentation": {}}).items() if v is not None}  # null: no such head
        self.camera = (
            None if camera is None and lidar is not None else LiftSplat(grid, image_size, **dict(camera or {}))
        )
        self.grid = self.camera.grid if self.camera is not None else Grid.from_any(grid)
        self.image_size = self.camera.image_size if self.camera is not None else tuple(int(s) for s in image_size)
        self.lidar = self.fuser = None
        if lidar is not None:  # the LiDAR parts before the decoder; camera-only models draw their weights as ever
            self.lidar = LidarEncoder(self.grid, **dict(lidar))
            self.temporal = self._temporal(temporal)
            self.fuser = self._fuser(fuser)
        elif fuser is not None:
            raise ValueError("model.net.fuser fuses the camera and LiDAR maps: set model.net.lidar too, or fuser null")
        self.decoder = build_decoder(self._decoder_input(), self.grid.nz, **dict(decoder or {}))
        built = {name: self._head(name, heads[name]) for name in HEAD_ORDER if name in heads}
        if lidar is None:
            self.temporal = self._temporal(temporal)
            if self.temporal is not None and self.temporal.copies > 1:
                self.decoder.widen_input(self.temporal.copies)
        built.update({name: self._head(name, opts) for name, opts in heads.items() if name not in HEAD_ORDER})
        self.heads = nn.ModuleDict({name: built[name] for name in heads})
        self._check_parts()

    def _temporal(self, options: Mapping[str, Any] | None) -> Temporal | None:
        if options is None:
            return None
        if self.camera is None:
            raise ValueError("model.net.temporal fuses the cameras' past frames: a LiDAR-only network has none")
        return Temporal(self.grid, self.camera.out_channels, **dict(options))

    def _fuser(self, options: Mapping[str, Any] | None) -> nn.Module | None:
        """The fuser of the camera and LiDAR maps; none (and none allowed) for LiDAR-only."""
        if self.camera is None:
            if options is not None:
                raise ValueError("model.net.fuser needs a camera branch to fuse with: set model.net.fuser=null")
            return None
        if options is None:
            raise ValueError(
                "a network with cameras and LiDAR needs a fuser: add +model/fuser@model.net.fuser=conv, or set "
                "model.net.camera=null (LiDAR-only)"
            )
        copies = 1 if self.temporal is None else self.temporal.copies
        return build_fuser([self.camera.out_channels * copies, self.lidar.out_channels], **dict(options))

    def _decoder_input(self) -> int:
        """Channels the decoder reads: the fused map's, else the one branch's (before temporal copies)."""
        if self.fuser is not None:
            return self.fuser.out_channels
        return self.lidar.out_channels if self.camera is None else self.camera.out_channels

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
        """Within this block forward() splats and pools the pillars with plain scatters (for torch.onnx.export):
        the camera splat a scatter-add, the LiDAR pillar sums and maxima scatter-adds and scatter-maxes."""
        with contextlib.ExitStack() as stack:
            for branch in (self.camera, self.lidar):
                if branch is not None:
                    stack.enter_context(branch.exportable())
            yield self

    def forward(
        self,
        images=None,
        intrinsics=None,
        rots=None,
        trans=None,
        post_rots=None,
        post_trans=None,
        future_egomotion: torch.Tensor | None = None,
        *,
        points: torch.Tensor | None = None,
        batch_size: int | None = None,
        past_no_grad: bool = False,
        past_features: torch.Tensor | None = None,
        future_labels: Mapping[str, torch.Tensor] | None = None,
        return_features: bool = False,
    ) -> dict[str, Any]:
        cams = (images, intrinsics, rots, trans, post_rots, post_trans)
        out: dict[str, Any] = {}
        maps = []
        if self.camera is not None:
            if any(c is None for c in cams):
                raise ValueError(
                    "the network has a camera branch: pass images, intrinsics, rots, trans, post_rots, post_trans"
                )
            if self.temporal is None:
                feats, out["depth"] = self.camera(*cams)
            else:
                feats = self._fused(cams, future_egomotion, past_no_grad, past_features, out)
            maps.append(feats)
        if self.lidar is not None:
            maps.append(self.lidar(self._points(points), self._batch_size(images, points, batch_size)))
        decoded = self.decoder(maps[0] if self.fuser is None else self.fuser(maps))
        for name, head in self.heads.items():
            x = decoded.get(name, decoded["shared"])
            out[name] = head(x, future_labels) if getattr(head, "takes_labels", False) else head(x)
        if not return_features:
            out.pop("present_features", None)
        return out

    def _points(self, points: torch.Tensor | None) -> torch.Tensor:
        if points is None:
            raise ValueError(
                "the network has a LiDAR branch (model.net.lidar): pass points= (P, 6) as batches hold them "
                "(data.lidar.enabled=true)"
            )
        return points

    @staticmethod
    def _batch_size(images, points: torch.Tensor, batch_size: int | None) -> int:
        # Sizes stay as given, not int(): under torch.export a dynamic batch size is a symbol that int() would fix.
        if images is not None:
            return images.shape[0]
        if batch_size is not None:
            return batch_size if isinstance(batch_size, (int, torch.SymInt)) else int(batch_size)
        return int(points[:, 0].max()) + 1 if len(points) else 1

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
