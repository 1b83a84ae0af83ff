"""The temporal model's cache of past frames' BEV features (model.past_cache_mb), keyed per frame and augmentation."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch


class PastFeatureCache:
    """BEV features of frames, each in its own ego frame, kept to serve as later windows' past frames.

    With past_no_grad the past frames only feed features forward; a frame that an earlier step
    already lifted (as a window's present or past frame) is taken from here instead of running the
    camera encoder again: features of the weights of that step (as streaming video training reuses
    its history). Keyed by sample token and image augmentation (post_rots, post_trans); the least
    recently used entries go first past limit_mb; entries older than max_age steps are not used.
    """

    def __init__(self, limit_mb: float, max_age: int | None = None):
        if limit_mb < 0 or (max_age is not None and max_age < 0):
            raise ValueError(f"past_cache_mb and past_cache_max_age must be >= 0, got {limit_mb} and {max_age}")
        self.limit, self.max_age = int(limit_mb * 2**20), max_age
        self.entries: OrderedDict[Any, tuple[int, torch.Tensor]] = OrderedDict()
        self.bytes = 0

    def get(self, key: Any, step: int) -> torch.Tensor | None:
        entry = self.entries.get(key)
        if entry is None or (self.max_age is not None and step - entry[0] > self.max_age):
            return None
        self.entries.move_to_end(key)
        return entry[1]

    def put(self, key: Any, feats: torch.Tensor, step: int) -> None:
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1].nbytes
        if feats.nbytes > self.limit:
            return
        while self.bytes + feats.nbytes > self.limit:
            self.bytes -= self.entries.popitem(last=False)[1][1].nbytes
        self.entries[key] = (step, feats)
        self.bytes += feats.nbytes


def frame_keys(batch: Mapping[str, Any], past_frames: int) -> list[list]:
    """Per window, the PastFeatureCache keys of its P + 1 input frames: (sample token, augmentation bytes)."""
    tokens = batch.get("sample_tokens")
    if tokens is None:
        raise ValueError("model.past_cache_mb > 0 needs the windows' sample_tokens in the batch (data.past_frames > 0)")
    aug = (
        torch.cat([batch["post_rots"].flatten(3), batch["post_trans"]], dim=-1).detach().cpu().numpy()
    )  # (B, T, N, 12)
    return [[(tokens[b][t], aug[b, t].tobytes()) for t in range(past_frames + 1)] for b in range(len(tokens))]
