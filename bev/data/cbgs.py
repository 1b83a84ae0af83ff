"""Class-balanced grouping and sampling (CBGS, Zhu et al. 2019; mmdet3d's CBGSDataset) for detection training.

Each class c has the samples that hold at least one of its trained boxes, S_c. An epoch draws, for every class,
|S_c| * (1 / C) / (|S_c| / D) = D / C samples from S_c with replacement, D = sum_c |S_c| and C the classes
that occur: every class is then in about 1 / C of the drawn samples, and the epoch holds D samples (on
nuScenes about 4-5 times the split). A sample with several classes can be drawn under each of them. Unlike
mmdet3d, which draws once, every epoch draws anew, from the seed and the epoch's number: a run resumed at
epoch k draws what the uninterrupted run drew at epoch k (the trainer says the epoch through set_epoch).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from bev.classes import DETECTION_CLASSES
from bev.data.detection import trained_mask


def class_samples(labels_per_sample: Sequence[np.ndarray], num_classes: int) -> list[np.ndarray]:
    """S_c for c in 0..num_classes-1: the sample numbers whose labels hold c."""
    has = [set(np.asarray(lab).tolist()) for lab in labels_per_sample]
    return [np.asarray([i for i, h in enumerate(has) if c in h], dtype=np.int64) for c in range(num_classes)]


def draws_per_class(per_class: Sequence[np.ndarray]) -> int:
    """D / C: |S_c| * ratio_c with ratio_c = (1 / C) / (|S_c| / D), the same for every class that occurs."""
    present = [s for s in per_class if len(s)]
    if not present:
        raise ValueError("data.cbgs: no training sample holds a detection box; set data.cbgs=false or check the split")
    return int(round(sum(len(s) for s in present) / len(present)))


def cbgs_epoch(per_class: Sequence[np.ndarray], generator: torch.Generator) -> np.ndarray:
    """One epoch's sample numbers, shuffled (module doc)."""
    k = draws_per_class(per_class)
    draws = [s[torch.randint(len(s), (k,), generator=generator).numpy()] for s in per_class if len(s)]
    out = np.concatenate(draws)
    return out[torch.randperm(len(out), generator=generator).numpy()]


class ClassBalancedSampler(Sampler[int]):
    """CBGS over a detection dataset (NuScenesBEVDataset with detection=true); len() is the epoch length.
    The draws depend on `seed` and the epoch number only, so every DDP process draws the same epoch. The epoch
    is the one set_epoch() gave (Lightning calls it at the start of every epoch, a resumed one included), then
    counts on with each pass."""

    def __init__(self, dataset, seed: int = 0):
        self.per_class = class_samples(_trained_labels(dataset), len(DETECTION_CLASSES))
        self.seed, self.epoch = int(seed), 0
        self.length = draws_per_class(self.per_class) * sum(1 for s in self.per_class if len(s))

    def __len__(self) -> int:
        return self.length

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        self.epoch += 1
        return iter(cbgs_epoch(self.per_class, g).tolist())


def _trained_labels(dataset) -> list[np.ndarray]:
    """Per item (sample, or window: its present frame), the detection labels of the boxes it trains on (as
    bev.data.detection.detection_item keeps)."""
    out = []
    for k in range(len(dataset)):
        i = int(dataset.window_frames(k)[dataset.past_frames]) if dataset.temporal else k  # the present frame
        det = dataset.detection_boxes(i)
        out.append(det["labels"][trained_mask(det, dataset.det_range)])
    return out
