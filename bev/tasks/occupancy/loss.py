"""Losses of per-voxel Occ3D logits: weighted cross-entropy (BEVDet-Occ's and FlashOcc's) and the Lovasz-softmax
loss of Berman, Rannen Triki and Blaschko (CVPR 2018), written here from the paper's definition.

Lovasz-softmax: for each class c, the errors m_i(c) = |[y_i = c] - p_i(c)| of the scored voxels, sorted in
decreasing order, weighted by the discrete derivative of the Jaccard loss along that order:
    loss_c = sum_k m_(k) * (J(k) - J(k - 1)),   J(k) = 1 - |G \\ E_k| / |G u E_k|  (J(0) = 0)
where G is the set of voxels of class c and E_k the k largest errors (the Lovasz extension of the Jaccard
loss, Eq. 9 and Algorithm 1 of the paper). It is averaged over the classes present in the truth. For one-hot
probabilities it equals 1 - IoU of each class exactly (a test holds it to that).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bev.tasks.occupancy.grid import NUM_CLASSES, OCC3D_CLASSES

IGNORE = 255  # bev.tasks.occupancy.data.IGNORE: voxels without a label

# Voxels per class over Occ3D-nuScenes's training set, as FlashOCC's bev_occ_head.py lists them
# (nusc_class_frequencies, github.com/Yzichen/FlashOCC); its class_balance option weighs class c by
# 1 / log(frequency_c + 0.001) ("log_frequency"). Order: OCC3D_CLASSES.
OCC3D_NUSC_FREQUENCIES = (
    944004, 1897170, 152386, 2391677, 16957802, 724139, 189027, 2074468, 413451, 2384460, 5916653,
    175883646, 4275424, 51393615, 61411620, 105975596, 116424404, 1892500630,
)  # fmt: skip
CLASS_WEIGHT_PRESETS = ("log_frequency", "inverse_sqrt_frequency")


def preset_weights(name: str) -> torch.Tensor:
    """The presets, both from OCC3D_NUSC_FREQUENCIES (f_c):
    log_frequency: 1 / log(f_c + 0.001), FlashOCC's class_balance: from free space (0.047) to the rarest class,
        bicycle (0.084), they span only 1.8x, so free space and the ground still dominate the loss;
    inverse_sqrt_frequency: sqrt(f_free / f_c), free space 1, manmade 4.2, car 10.6, bicycle 111: a rare class's
        voxels together weigh sqrt(f_c / f_free) of free space's instead of f_c / f_free."""
    freq = np.asarray(OCC3D_NUSC_FREQUENCIES, np.float64)
    if name == "log_frequency":
        w = 1.0 / np.log(freq + 0.001)
    elif name == "inverse_sqrt_frequency":
        w = np.sqrt(freq[-1] / freq)
    else:
        raise ValueError(
            f"model.occupancy.loss.class_weight {name!r}: choose null, {CLASS_WEIGHT_PRESETS}, a list or a map"
        )
    return torch.tensor(w, dtype=torch.float32)


CLASS_WEIGHT_FORMS = f"null, a preset {CLASS_WEIGHT_PRESETS}, a list of {NUM_CLASSES} numbers or {{class: weight}}"


def class_weights(spec) -> torch.Tensor | None:
    """model.occupancy.loss.class_weight -> (18,) weights: null (none), a preset of CLASS_WEIGHT_PRESETS (preset_weights), a
    list of 18 numbers, or {class name: weight} (unlisted classes 1.0). Each a finite number >= 0, not all 0."""
    if spec is None:
        return None
    if isinstance(spec, str):
        return preset_weights(spec)
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - set(OCC3D_CLASSES))
        if unknown:
            raise ValueError(
                f"model.occupancy.loss.class_weight names unknown class(es) {unknown}; classes: {list(OCC3D_CLASSES)}"
            )
        values = {name: spec.get(name, 1.0) for name in OCC3D_CLASSES}
    elif isinstance(spec, Sequence) and not isinstance(spec, bytes):
        values = dict(zip(OCC3D_CLASSES, spec))
        if len(spec) != NUM_CLASSES:
            raise ValueError(
                f"model.occupancy.loss.class_weight has {len(spec)} weights, not {NUM_CLASSES}: choose {CLASS_WEIGHT_FORMS}"
            )
    else:
        raise ValueError(f"model.occupancy.loss.class_weight={spec!r}: choose {CLASS_WEIGHT_FORMS}")
    bad = {k: v for k, v in values.items() if not _weight(v)}
    if bad:
        raise ValueError(f"model.occupancy.loss.class_weight: the weights of {bad} are not finite numbers >= 0")
    if not sum(values.values()) > 0:
        raise ValueError(f"model.occupancy.loss.class_weight: the weights are all 0; choose {CLASS_WEIGHT_FORMS}")
    return torch.tensor([float(v) for v in values.values()], dtype=torch.float32)


def _weight(v) -> bool:
    """A finite number >= 0 (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def lovasz_grad(truth_sorted: torch.Tensor) -> torch.Tensor:
    """J(k) - J(k - 1) along errors sorted in decreasing order, for the 0/1 truth in that order (per column)."""
    gts = truth_sorted.sum(0, keepdim=True)
    intersection = gts - truth_sorted.cumsum(0)
    union = gts + (1.0 - truth_sorted).cumsum(0)
    jaccard = 1.0 - intersection / union
    return torch.cat([jaccard[:1], jaccard[1:] - jaccard[:-1]])


def lovasz_softmax(probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean Lovasz-softmax loss over the classes present in `labels`: probs (P, K) softmax outputs, labels (P,)
    class ids of the scored voxels. 0 when there is none. Every class is sorted at once (one column each)."""
    if labels.numel() == 0:
        return probs.sum() * 0.0
    truth = F.one_hot(labels, probs.shape[1]).to(probs.dtype)
    errors, order = (truth - probs).abs().sort(0, descending=True)
    per_class = (errors * lovasz_grad(truth.gather(0, order))).sum(0)
    present = truth.sum(0) > 0
    return per_class[present].mean()


class OccupancyLoss(nn.Module):
    """Cross-entropy of (B, 18, X, Y, Z) logits against (B, X, Y, Z) class ids (IGNORE skipped), weighted by class
    (the weighted mean, as torch and mmdet's CrossEntropyLoss with avg_factor = the summed weights), plus
    lovasz_weight x Lovasz-softmax. visible_only: only voxels of mask_camera count (BEVDet-Occ's and FlashOcc's
    use_mask=True); else every labelled voxel. Returns {"occ": cross-entropy, "lovasz": ...}; total() weighs them."""

    def __init__(self, class_weight=None, lovasz_weight: float = 0.0, visible_only: bool = True):
        super().__init__()
        w = class_weights(class_weight)
        self.register_buffer("class_weight", w, persistent=False)
        if not _weight(lovasz_weight):
            raise ValueError(
                f"model.occupancy.loss.lovasz_weight must be a finite number >= 0 (0: off), got {lovasz_weight!r}"
            )
        self.lovasz_weight = float(lovasz_weight)
        if not isinstance(visible_only, bool):  # "maybe" would read as true
            raise ValueError(f"model.occupancy.loss.visible_only must be true or false, got {visible_only!r}")
        self.visible_only = visible_only

    def targets(self, semantics: torch.Tensor, mask_camera: torch.Tensor | None) -> torch.Tensor:
        """int64 class ids with IGNORE wherever a voxel does not count."""
        target = semantics.long()
        if self.visible_only:
            if mask_camera is None:
                raise ValueError(
                    "model.occupancy.loss.visible_only=true needs occ_mask_camera in the batch (data.occupancy=true)"
                )
            target = target.masked_fill(~mask_camera.bool(), IGNORE)
        return target

    def forward(self, logits: torch.Tensor, semantics: torch.Tensor, mask_camera=None) -> dict[str, torch.Tensor]:
        logits = logits.float()
        target = self.targets(semantics, mask_camera)
        terms = {}
        if (target != IGNORE).any():
            terms["occ"] = F.cross_entropy(logits, target, weight=self.class_weight, ignore_index=IGNORE)
        else:  # nothing scored in this batch: a zero that keeps the graph
            terms["occ"] = logits.sum() * 0.0
        if self.lovasz_weight:
            keep = target != IGNORE
            probs = logits.softmax(1).movedim(1, -1)[keep]
            terms["lovasz"] = lovasz_softmax(probs, target[keep])
        return terms

    def total(self, terms: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return terms["occ"] + self.lovasz_weight * terms.get("lovasz", 0.0)


def check_loss_options(options: Mapping | None) -> dict:
    """model.occupancy.loss's keys, refused with the list of known ones when unknown."""
    options = dict(options or {})
    known = ("class_weight", "lovasz_weight", "visible_only")
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"unknown model.occupancy.loss key(s) {unknown}; the keys are {list(known)}")
    return options


__all__: Sequence[str] = (
    "IGNORE",
    "OccupancyLoss",
    "class_weights",
    "preset_weights",
    "lovasz_softmax",
    "check_loss_options",
)
