"""Image augmentation: exact post_rot/post_tran bookkeeping, checked against an independent warp."""

from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from bev.data.transforms import (
    ImageAug,
    denormalize_image,
    draft_factor,
    float_range,
    normalize_image,
    resize_range,
    sample_augmentation,
    warp_image,
)
from helpers.tiny_nuscenes import texture

H, W = 900, 1600


@pytest.fixture(scope="module")
def jpeg_bytes() -> tuple[bytes, np.ndarray]:
    raw = texture(7)
    buf = io.BytesIO()
    Image.fromarray(raw).save(buf, format="JPEG", quality=95)
    decoded = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    return buf.getvalue(), decoded


def _cv2_reference(raw: np.ndarray, aug: ImageAug, raw_shift=(0.0, 0.0)) -> np.ndarray:
    # OpenCV's warpAffine samples dst(p) = src(M^-1 p) with integer coords at pixel centres:
    # the same convention as bev.geometry, implemented independently of PIL. raw_shift moves
    # the sampling points by that many raw pixels (to show the check is sensitive).
    A, b = aug.affine()
    M = np.hstack([A, (b + A @ np.asarray(raw_shift, dtype=np.float64))[:, None]])
    fH, fW = aug.final_dim
    return cv2.warpAffine(raw, M, (fW, fH), flags=cv2.INTER_LINEAR, borderValue=0)


def _interior(aug: ImageAug, margin: float = 3.0) -> np.ndarray:
    """Output pixels whose pre-image lies well inside the raw image (no border effects)."""
    A, b = aug.affine()
    fH, fW = aug.final_dim
    v, u = np.mgrid[0:fH, 0:fW].astype(np.float64)
    src = np.linalg.solve(A, np.stack([u.ravel() - b[0], v.ravel() - b[1]]))
    ok = (src[0] > margin) & (src[0] < W - 1 - margin) & (src[1] > margin) & (src[1] < H - 1 - margin)
    return ok.reshape(fH, fW)


def test_validation_transform_is_the_lss_crop():
    aug = sample_augmentation((H, W), (128, 352), train=False)
    post_rot, post_tran = aug.post_rot_tran()
    torch.testing.assert_close(post_rot, torch.diag(torch.tensor([0.22, 0.22, 1.0])))
    torch.testing.assert_close(post_tran, torch.tensor([0.0, -48.0, 0.0]))
    assert aug.final_dim == (128, 352)


def test_augmentation_ranges_default_to_lss():
    assert resize_range(None, (128, 352), augment=True) == (0.193, 0.225)  # exactly, at LSS's own size
    assert resize_range(None, (256, 704), augment=True) == pytest.approx((0.386, 0.45))
    assert resize_range([0.3, 0.5], (256, 704), augment=True) == (0.3, 0.5)
    assert float_range(None, (-5.4, 5.4)) == (-5.4, 5.4) and float_range([1, 2], (0.0, 0.0)) == (1.0, 2.0)
    with pytest.warns(UserWarning, match="far from the validation scale"):
        resize_range((0.193, 0.225), (64, 176), augment=True)


def test_train_augmentations_stay_in_range():
    torch.manual_seed(0)
    flips = set()
    for _ in range(200):
        aug = sample_augmentation((H, W), (128, 352), True, (0.193, 0.225), (0.0, 0.22), (-5.4, 5.4), True)
        assert 0.193 <= aug.resize <= 0.225 and -5.4 <= aug.rotate <= 5.4
        newW, newH = int(W * aug.resize), int(H * aug.resize)
        w0, h0, w1, h1 = aug.crop
        assert (h1 - h0, w1 - w0) == (128, 352)
        assert 0 <= w0 <= max(0, newW - 352)
        # bottom-biased: the crop ends between 78% and 100% of the resized height
        assert int(0.78 * newH) - 1 <= h1 <= newH
        flips.add(aug.flip)
    assert flips == {True, False}


def test_smaller_images_show_the_same_field_of_view():
    """resize_lim is for 1600x900: a 400x225 image (the synthetic set's --image-size render) draws 4x the
    resize and the same crop, so an output pixel sees the same scene point, up to a pixel of rounding."""
    for seed in range(50):
        augs = []
        for raw in ((H, W), (H // 4, W // 4)):
            torch.manual_seed(seed)
            augs.append(sample_augmentation(raw, (128, 352), True, (0.193, 0.225), (0.0, 0.22), (-5.4, 5.4), True))
        big, small = augs
        assert small.resize == pytest.approx(4 * big.resize, rel=1e-12)
        assert (small.flip, small.rotate) == (big.flip, big.rotate)
        assert np.abs(np.subtract(small.crop, big.crop)).max() <= 1
        # Full-resolution pixel centres map to the small image's by u' + 0.5 = (u + 0.5) / 4.
        A_big, b_big = big.affine()
        A_small, b_small = small.affine()
        uv = np.array([[100.5, 300.0], [1200.0, 700.25]]).T
        out_big = A_big @ uv + b_big[:, None]
        out_small = A_small @ ((uv + 0.5) / 4 - 0.5) + b_small[:, None]
        assert np.abs(out_big - out_small).max() <= 1.5
    val = [sample_augmentation(raw, (128, 352), train=False) for raw in ((H, W), (H // 4, W // 4))]
    assert val[1].resize == pytest.approx(4 * val[0].resize) and val[1].crop == val[0].crop


@pytest.mark.parametrize("use_draft", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_warp_matches_independent_reference(jpeg_bytes, seed, use_draft):
    data, raw = jpeg_bytes
    torch.manual_seed(seed)
    aug = sample_augmentation((H, W), (128, 352), True)
    img = Image.open(io.BytesIO(data))
    out = np.asarray(warp_image(img, aug, use_draft=use_draft)).astype(np.float32)
    mask = _interior(aug, margin=8)
    assert mask.mean() > 0.5

    def err(shift):
        return np.abs(out - _cv2_reference(raw, aug, shift).astype(np.float32))[mask].mean()

    e0 = err((0.0, 0.0))
    assert e0 < 1.0, e0
    # The exact geometry fits best: sampling 0.75 raw pixels off in any direction (a half-pixel
    # convention slip or a wrong draft offset is 0.5-3.5 raw pixels) fits worse.
    for shift in [(0.75, 0), (-0.75, 0), (0, 0.75), (0, -0.75)]:
        assert err(shift) > e0 + 0.02, (shift, err(shift), e0)


def test_flip_is_the_exact_mirror(jpeg_bytes):
    data, _ = jpeg_bytes
    base = ImageAug(0.21, (10, 40, 10 + 352, 40 + 128), False, 0.0)
    flipped = ImageAug(0.21, (10, 40, 10 + 352, 40 + 128), True, 0.0)
    a = np.asarray(warp_image(Image.open(io.BytesIO(data)), base)).astype(int)
    b = np.asarray(warp_image(Image.open(io.BytesIO(data)), flipped)).astype(int)
    assert np.abs(a[:, ::-1] - b).max() <= 1


@settings(max_examples=50, deadline=None)
@given(
    resize=st.floats(0.1, 0.5),
    crop_w=st.integers(0, 100),
    crop_h=st.integers(0, 100),
    flip=st.booleans(),
    rotate=st.floats(-10, 10),
)
def test_post_rot_maps_pixels_like_the_affine(resize, crop_w, crop_h, flip, rotate):
    aug = ImageAug(resize, (crop_w, crop_h, crop_w + 352, crop_h + 128), flip, rotate)
    post_rot, post_tran = aug.post_rot_tran()
    # The centre of the crop window (raw u = (crop_w + (fW-1)/2) / resize) maps to the output image
    # centre, the fixed point of flip and rotation.
    centre_raw = torch.tensor([(crop_w + 351 / 2) / resize, (crop_h + 127 / 2) / resize, 5.0])
    out = post_rot @ centre_raw + post_tran
    torch.testing.assert_close(out, torch.tensor([351 / 2, 127 / 2, 5.0]), atol=1e-3, rtol=0)
    assert torch.equal(post_rot[2], torch.tensor([0.0, 0.0, 1.0])) and post_tran[2] == 0
    assert abs(abs(torch.linalg.det(post_rot[:2, :2]).item()) - resize**2) < 1e-5


def test_draft_factor():
    assert draft_factor((1600, 900), (400, 225)) == 4
    assert draft_factor((1600, 900), (200, 113)) == 8
    assert draft_factor((1600, 900), (1600, 900)) == 1
    with pytest.raises(ValueError):
        draft_factor((1600, 900), (300, 200))


def test_draft_decodes_at_reduced_scale(jpeg_bytes):
    data, _ = jpeg_bytes
    img = Image.open(io.BytesIO(data))
    aug = sample_augmentation((H, W), (128, 352), train=False)
    warp_image(img, aug)
    assert img.size == (400, 225)  # libjpeg decoded at 1/4 scale, not full HD


def test_normalize_roundtrip():
    rgb = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    t = normalize_image(Image.fromarray(rgb))
    assert t.shape == (3, 5, 7) and t.dtype == torch.float32
    assert np.array_equal(denormalize_image(t), rgb)
