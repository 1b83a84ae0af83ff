"""Image augmentation with exact post_rot / post_tran bookkeeping (Lift-Splat-Shoot style).

An augmentation is one 2D affine map of pixel-centre coordinates (bev.geometry convention:
the centre of pixel (i, j) is u=j, v=i) from the raw camera image to the network input:

    (u', v') = A @ (u, v) + b,  with post_rot = [[A, 0], [0, 0, 1]], post_tran = (b, 0).

It composes, in this order: resize by `resize`, crop the window whose top-left pixel is
(crop_w, crop_h), mirror horizontally (u -> fW - 1 - u, the exact mirror of the pixel grid),
and rotate by `rotate` degrees about the image centre. The output image is produced from
that very matrix in ONE resampling (PIL affine warp), so the bookkeeping is exact by
construction rather than an approximation of what a chain of PIL ops did.

JPEGs are decoded with libjpeg DCT scaling (``Image.draft``) at 1/2, 1/4 or 1/8 of full
size when the final scale allows it; a draft pixel k covers raw pixels [f*k, f*(k+1)), which
is folded into the warp exactly.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from bev.data.rig import IMAGE_H, IMAGE_W

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Lift-Splat-Shoot's training augmentation: the one statement of these defaults (None in the data
# classes and configs means these). resize_lim is absolute: LSS chose it around LSS_VAL_RESIZE, the
# validation scale of 128x352 crops of 1600x900 images; resize_range scales it to other crops.
LSS_RESIZE_LIM = (0.193, 0.225)
LSS_VAL_RESIZE = 0.22
LSS_BOT_PCT_LIM = (0.0, 0.22)
LSS_ROT_LIM = (-5.4, 5.4)  # degrees


@dataclass(frozen=True)
class ImageAug:
    """Parameters of one image augmentation (all in raw-image pixels / degrees)."""

    resize: float
    crop: tuple[int, int, int, int]  # (w0, h0, w0 + fW, h0 + fH) in the resized image
    flip: bool
    rotate: float

    @property
    def final_dim(self) -> tuple[int, int]:
        return self.crop[3] - self.crop[1], self.crop[2] - self.crop[0]

    def affine(self) -> tuple[np.ndarray, np.ndarray]:
        """(A (2x2), b (2,)) mapping raw pixel centres to output pixel centres."""
        fH, fW = self.final_dim
        A = np.eye(2) * self.resize
        b = -np.array([self.crop[0], self.crop[1]], dtype=np.float64)
        if self.flip:
            F = np.array([[-1.0, 0.0], [0.0, 1.0]])
            A, b = F @ A, F @ b + np.array([fW - 1.0, 0.0])
        if self.rotate:
            # Same sense as PIL's Image.rotate (counter-clockwise on screen), about the centre.
            h = math.radians(self.rotate)
            R = np.array([[math.cos(h), math.sin(h)], [-math.sin(h), math.cos(h)]])
            c = np.array([(fW - 1) / 2.0, (fH - 1) / 2.0])
            A, b = R @ A, R @ (b - c) + c
        return A, b

    def post_rot_tran(self) -> tuple[torch.Tensor, torch.Tensor]:
        A, b = self.affine()
        post_rot = torch.eye(3)
        post_rot[:2, :2] = torch.as_tensor(A, dtype=torch.float32)
        post_tran = torch.zeros(3)
        post_tran[:2] = torch.as_tensor(b + 0.0, dtype=torch.float32)  # +0.0: no -0.0 in printouts
        return post_rot, post_tran


def _uniform(lo: float, hi: float) -> float:
    # torch's global RNG: seeded per DataLoader worker and by lightning.seed_everything.
    return float(lo + (hi - lo) * torch.rand(()).item())


def sample_augmentation(
    raw_hw: tuple[int, int],
    final_dim: Sequence[int],
    train: bool,
    resize_lim: Sequence[float] = LSS_RESIZE_LIM,
    bot_pct_lim: Sequence[float] = LSS_BOT_PCT_LIM,
    rot_lim: Sequence[float] = LSS_ROT_LIM,
    rand_flip: bool = True,
) -> ImageAug:
    """Draw an augmentation (train) or return the deterministic validation one.

    As in lift-splat-shoot: random resize in resize_lim, crop biased to the bottom by a random
    fraction in bot_pct_lim, random horizontal crop offset, flip, rotation in rot_lim degrees.
    Validation: resize = max(fH/H, fW/W), crop_h = int((1 - mean(bot_pct_lim)) * newH) - fH,
    centred crop_w, no flip/rotation (128x352 from 900x1600: scale 0.22, crop (0, 48)).
    resize_lim is for 1600x900 images: another size scales it by the ratio of the two validation scales,
    so that every size shows the same field of view (a 400x225 image draws 4x the resize).
    """
    H, W = raw_hw
    fH, fW = int(final_dim[0]), int(final_dim[1])
    if train:
        resize = _uniform(*resize_lim) * max(fH / H, fW / W) / max(fH / IMAGE_H, fW / IMAGE_W)
        newW, newH = int(W * resize), int(H * resize)
        crop_h = int((1 - _uniform(*bot_pct_lim)) * newH) - fH
        crop_w = int(_uniform(0, max(0, newW - fW)))
        flip = bool(rand_flip) and bool(torch.rand(()).item() < 0.5)
        rotate = _uniform(*rot_lim)
    else:
        resize = max(fH / H, fW / W)
        newW, newH = int(W * resize), int(H * resize)
        crop_h = int((1 - float(np.mean(bot_pct_lim))) * newH) - fH
        crop_w = int(max(0, newW - fW) / 2)
        flip, rotate = False, 0.0
    return ImageAug(resize, (crop_w, crop_h, crop_w + fW, crop_h + fH), flip, rotate)


def float_range(lim: Sequence[float] | None, default: tuple[float, float]) -> tuple[float, float]:
    """lim as a (lo, hi) pair of floats; None gives the default."""
    return default if lim is None else (float(lim[0]), float(lim[1]))


def resize_range(resize_lim, final_dim, augment: bool, raw_hw=(IMAGE_H, IMAGE_W)) -> tuple[float, float]:
    """resize_lim as floats; None gives LSS_RESIZE_LIM scaled to final_dim's validation scale."""
    val = max(final_dim[0] / raw_hw[0], final_dim[1] / raw_hw[1])
    if resize_lim is None:
        return LSS_RESIZE_LIM if val == LSS_VAL_RESIZE else tuple(v * val / LSS_VAL_RESIZE for v in LSS_RESIZE_LIM)
    lim = float_range(resize_lim, LSS_RESIZE_LIM)
    if augment and not 0.8 * lim[0] <= val <= 1.25 * lim[1]:
        warnings.warn(
            f"resize_lim {lim} is far from the validation scale {val:.4f} of final_dim {tuple(final_dim)}: "
            f"training crops would show a different field of view than validation. Scale resize_lim with "
            f"final_dim, or pass resize_lim=None to scale the LSS range automatically.",
            stacklevel=2,
        )
    return lim


def draft_factor(raw_size: tuple[int, int], draft_size: tuple[int, int]) -> int:
    """The libjpeg DCT scale denominator (1, 2, 4 or 8) that turned raw_size into draft_size."""
    for f in (1, 2, 4, 8):
        if all(-(-r // f) == d for r, d in zip(raw_size, draft_size)):
            return f
    raise ValueError(f"draft size {draft_size} is not a 1/2^k scale of {raw_size}")


def warp_image(img: Image.Image, aug: ImageAug, use_draft: bool = True) -> Image.Image:
    """Decode an opened (not yet loaded) image, at reduced JPEG DCT scale when possible, and
    apply `aug` in one bilinear warp. Returns the final_dim RGB image (black outside the raw image)."""
    raw_size = img.size  # (W, H)
    if use_draft and img.format == "JPEG":
        # Ask for at least the resized resolution so the warp never upsamples a draft.
        want = (max(1, math.ceil(raw_size[0] * aug.resize)), max(1, math.ceil(raw_size[1] * aug.resize)))
        img.draft("RGB", want)
    if img.mode != "RGB":
        img = img.convert("RGB")
    f = draft_factor(raw_size, img.size)
    A, b = aug.affine()
    # Draft pixel centre p_d <-> raw pixel centre f * (p_d + 0.5) - 0.5.
    A_d = A * f
    b_d = b + A @ np.full(2, 0.5 * (f - 1))
    # PIL's affine maps output corner coords to input corner coords (centre = corner - 0.5).
    (a, b_), (c, d) = A_d
    Ainv = np.array([[d, -b_], [-c, a]]) / (a * d - b_ * c)  # 2x2 inverse (np.linalg.inv is slow per call)
    off = -Ainv @ (np.full(2, 0.5) + b_d) + 0.5
    data = (Ainv[0, 0], Ainv[0, 1], off[0], Ainv[1, 0], Ainv[1, 1], off[1])
    fH, fW = aug.final_dim
    return img.transform((fW, fH), Image.AFFINE, data, resample=Image.BILINEAR)


_MEAN = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
_STD = torch.tensor(IMAGENET_STD).view(3, 1, 1)
# (x / 255 - mean) / std as one multiply-add, in NumPy: per-image tensors are small, and torch's
# intra-op threads only add spin-wait overhead in a loader (badly so on a busy 2-core machine).
_SCALE = (1.0 / (255.0 * np.asarray(IMAGENET_STD, dtype=np.float32))).astype(np.float32)
_SHIFT = (-np.asarray(IMAGENET_MEAN, dtype=np.float32) / np.asarray(IMAGENET_STD, dtype=np.float32)).astype(np.float32)


# The same multiply-add for each of the 256 byte values, per channel: a table look-up is 3x faster.
_LUT = np.arange(256, dtype=np.float32)[None, :] * _SCALE[:, None] + _SHIFT[:, None]


def normalize_array(img: Image.Image) -> np.ndarray:
    """PIL RGB -> (3, H, W) float32 NumPy array, ImageNet mean/std normalised."""
    u = np.asarray(img)
    out = np.empty((3,) + u.shape[:2], np.float32)
    for c in range(3):
        np.take(_LUT[c], u[..., c], out=out[c])
    return out


def normalize_image(img: Image.Image) -> torch.Tensor:
    """PIL RGB -> (3, H, W) float32 tensor, ImageNet mean/std normalised."""
    return torch.from_numpy(normalize_array(img))


def denormalize_image(t: torch.Tensor) -> np.ndarray:
    """(3, H, W) normalised tensor -> (H, W, 3) uint8 for display."""
    t = t.detach().cpu().float() * _STD + _MEAN
    return (t.clamp(0, 1) * 255 + 0.5).to(torch.uint8).permute(1, 2, 0).numpy()
