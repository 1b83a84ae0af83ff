"""Temporal Lift-Splat (FIERY's half): past frames fused in the present ego frame, and the future.

The model only adds to LiftSplatShoot: per input frame its `lift_splat` gives BEV voxel features;
the past frames' features are warped into the present frame with the cumulative ego motion
(bilinear) and fused by a temporal block; the static BEV encoder's `features` then feed
- the static head (`bev_encoder.logits`): the present frame's object + map logits (B, K, X, Y), as
  LiftSplatShoot, so that present-frame IoUs compare with the static model's;
- the future heads, time folded into channels (PowerBEV's deterministic future): for the present
  and each of the F future frames `segmentation` (B, F+1, 1, X, Y) vehicle logits, `centerness`
  (B, F+1, 1, X, Y), `offset` and `flow` (B, F+1, 2, X, Y) in grid cells, channel 0 along x.
With `probabilistic=True`, FIERY's present / future Gaussian latents condition the future heads
(the future distribution sees the future labels in training; KL between the two).

The static modules are LiftSplatShoot's own (camera_encoder, bev_encoder: same keys), so a static
checkpoint's weights load into a temporal model by name (bev.lit_temporal, model.init_from), and
with an untrained fusion the temporal model's "bev" is the static model's logits of the present.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bev.geometry import FEATURE_STRIDE, Grid
from bev.models.lss import LiftSplatShoot
from bev.tasks.motion import IGNORE

# How the aligned past frames meet the present: "residual" (TemporalFusion: a conv over all frames added to the
# present, then the BEV encoder) or "concat" (BEVDet4D: the BEV encoder over the frames side by side).
FUSIONS = ("residual", "concat")
# Future head outputs and their channels per frame.
FUTURE_HEAD_CHANNELS = {"segmentation": 1, "centerness": 1, "offset": 2, "flow": 2}


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


def conv_bn_relu(cin: int, cout: int, k: int = 3) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
    )


class TemporalFusion(nn.Module):
    """Warped frames (B, T, C, X, Y) -> (B, C, X, Y): the present frame plus a residual from all T
    frames' features concatenated (BEVDet4D's concat; a kernel x kernel conv, then a 1x1). The residual's last conv starts at
    zero, so an untrained fusion passes the present frame through: a temporal model initialised from
    a static checkpoint starts out as that static model."""

    def __init__(self, channels: int, frames: int, hidden: int | None = None, kernel: int = 3):
        super().__init__()
        hidden = hidden or channels
        self.mix = nn.Sequential(conv_bn_relu(channels * frames, hidden, kernel), nn.Conv2d(hidden, channels, 1))
        nn.init.zeros_(self.mix[-1].weight)
        nn.init.zeros_(self.mix[-1].bias)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return frames[:, -1] + self.mix(frames.flatten(1, 2))


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
    """BEV features (B, Cf, X, Y) -> per-frame heads, time folded into channels (PowerBEV): two branches,
    segmentation + centerness and offset + flow, each an optional 3x3 conv then a 1x1 conv to
    (F+1) x channels."""

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


class TemporalLiftSplat(LiftSplatShoot):
    """P+1 input frames of N cameras -> the present frame's static logits and F+1 frames of future heads.

    forward(images (B, P+1, N, 3, H, W), intrinsics/rots/trans/post_rots/post_trans (B, P+1, N, ...),
    future_egomotion (B, >= P, 4, 4): entry t maps frame t's ego coordinates to frame t+1's) ->
    {"bev": (B, K, X, Y), "segmentation", "centerness", "offset", "flow"} (see the module docstring);
    probabilistic models add "present_mu", "present_log_var" (and "future_*" given future labels).
    past_no_grad runs the past frames' camera encoder and splat without gradient (BEVDet4D).
    """

    def __init__(
        self,
        grid: Grid | Mapping[str, Any] | None,
        image_size: tuple[int, int] = (128, 352),
        downsample: int = FEATURE_STRIDE,
        context_channels: int = 64,
        num_classes: int = 1,
        camera: Mapping[str, Any] | None = None,
        bev: Mapping[str, Any] | None = None,
        splat: str = "bev_pool",
        pool_backend: str = "auto",
        detection: Mapping[str, Any] | None = None,
        past_frames: int = 2,
        future_frames: int = 4,
        fusion: str = "residual",
        fusion_channels: int | None = None,
        fusion_kernel: int = 3,
        head_channels: int = 0,
        probabilistic: bool = False,
        latent_dim: int = 16,
    ):
        super().__init__(
            grid, image_size, downsample, context_channels, num_classes, camera, bev, splat, pool_backend, detection
        )
        if past_frames < 0 or future_frames < 0:
            raise ValueError(f"past_frames and future_frames must be >= 0, got {past_frames} and {future_frames}")
        self.past_frames, self.future_frames = int(past_frames), int(future_frames)
        self.probabilistic, self.latent_dim = bool(probabilistic), int(latent_dim) if probabilistic else 0
        if fusion not in FUSIONS:
            raise ValueError(f"model.net.fusion must be one of {FUSIONS}, got {fusion!r}")
        bev_in = context_channels * self.grid.nz
        self.concat = fusion == "concat" and self.past_frames > 0
        self.fusion = None
        if self.concat:  # BEVDet4D: the BEV encoder reads the aligned frames' features side by side
            self.bev_encoder.widen_input(self.past_frames + 1)
        elif self.past_frames:
            self.fusion = TemporalFusion(bev_in, self.past_frames + 1, fusion_channels, fusion_kernel)
        cf = self.bev_encoder.feature_channels
        if self.probabilistic:
            frames = self.future_frames + 1
            self.present_dist = GaussianLatent(cf, self.latent_dim)
            self.future_dist = GaussianLatent(cf + frames * (1 + 2), self.latent_dim)  # + future segmentation and flow
        self.future = FutureHeads(cf + self.latent_dim, self.future_frames + 1, head_channels)

    def init_future_from_static(self, object_class: int = 0) -> bool:
        """Start every frame's segmentation logits as the static head's logits of one object class (vehicles):
        the present prediction copied to every future frame, the baseline the future heads learn from.
        False (nothing done) when a 3x3 head conv sits in between (head_channels > 0)."""
        seg, static = self.future.branches["instance"][-1], self.bev_encoder.head
        if seg.in_channels != static.in_channels + self.latent_dim:
            return False
        frames, cf = self.future.frames, static.in_channels
        with torch.no_grad():
            seg.weight[:frames] = 0.0  # the latent's columns too
            seg.weight[:frames, :cf] = static.weight[object_class]
            seg.bias[:frames] = static.bias[object_class]
        return True

    def load_present_stem(self, weight: torch.Tensor) -> bool:
        """With fusion "concat": a static model's BEV encoder stem weight (O, C, k, k) on the present frame's
        channels and zero on the past frames', so the model starts as that static model; False if it does not fit."""
        conv = self.bev_encoder.stem[0]
        present = conv.in_channels // (self.past_frames + 1)
        if tuple(weight.shape) != (conv.out_channels, present, *conv.kernel_size):
            return False
        with torch.no_grad():
            conv.weight.zero_()
            conv.weight[:, -present:] = weight.to(conv.weight.dtype)
        return True

    def frame_features(self, cams: tuple[torch.Tensor, ...], past_no_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Camera inputs (B, T, N, ...) -> BEV features, each frame in its own ego frame: the past frames'
        (B, T-1, C * Z, X, Y) and the present's (B, C * Z, X, Y)."""
        B, T = cams[0].shape[:2]
        if not past_no_grad or T == 1:
            feats = self.lift_splat(*(c.flatten(0, 1) for c in cams)).unflatten(0, (B, T))
            return feats[:, :-1], feats[:, -1]
        # Inference mode (no autograd bookkeeping at all: faster than no_grad); the past stays a tensor of its own,
        # as a slice of one joint with the present's would carry gradients back through the warp.
        with torch.inference_mode():
            past = self.lift_splat(*(c[:, :-1].flatten(0, 1) for c in cams)).unflatten(0, (B, T - 1))
        return past, self.lift_splat(*(c[:, -1] for c in cams))

    def forward(
        self,
        images,
        intrinsics,
        rots,
        trans,
        post_rots,
        post_trans,
        future_egomotion,
        past_no_grad: bool = False,
        future_labels: Mapping[str, torch.Tensor] | None = None,
        past_features: torch.Tensor | None = None,
        return_features: bool = False,
    ) -> dict[str, torch.Tensor]:
        """past_features (B, P, C * Z, X, Y): the past frames' BEV features computed before (frame_features),
        used instead of their cameras; return_features adds the present frame's as "present_features"."""
        self._check_frames(images)
        cams = (images, intrinsics, rots, trans, post_rots, post_trans)
        if past_features is None:
            past, present = self.frame_features(cams, past_no_grad)
        else:
            past, present = past_features, self.lift_splat(*(c[:, -1] for c in cams))
        feats = present
        if self.past_frames:
            frames = torch.cat([warp_to_present(past, future_egomotion, self.grid), present.unsqueeze(1)], dim=1)
            feats = frames.flatten(1, 2) if self.concat else self.fusion(frames)
        x, det = self.bev_encoder.task_features(feats)
        out = {"bev": self.bev_encoder.logits(x)}
        if self.det_head is not None:  # boxes of the present frame from the fused features (BEVDet4D)
            out.update(self.det_head(det))
        if self.probabilistic:
            x = self._with_latent(x, out, future_labels)
        out.update(self.future(x))
        if return_features:
            out["present_features"] = present
        return out

    def _check_frames(self, images: torch.Tensor) -> None:
        T = images.shape[1]
        if T != self.past_frames + 1:
            raise ValueError(f"images have {T} frames but the model takes past_frames + 1 = {self.past_frames + 1}")

    def _with_latent(
        self, x: torch.Tensor, out: dict, future_labels: Mapping[str, torch.Tensor] | None
    ) -> torch.Tensor:
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


def network_kind(ckpt: Mapping[str, Any]) -> str | None:
    """What a checkpoint's network is, as its stored bev-train config says (model.net._target_): "temporal"
    (a TemporalLiftSplat), "static" (another LiftSplatShoot), or None (no stored config, or other code)."""
    target = (((ckpt.get("bev_config") or {}).get("model") or {}).get("net") or {}).get("_target_")
    # Only the project's own modules are imported: a checkpoint must not make us import anything else.
    if not isinstance(target, str) or not target.startswith("bev."):
        return None
    module, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    if not isinstance(cls, type):
        return None
    if issubclass(cls, TemporalLiftSplat):
        return "temporal"
    return "static" if issubclass(cls, LiftSplatShoot) else None
