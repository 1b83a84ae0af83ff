"""Velocity from tracks: a box's velocity as the displacement of the same object over the past key frames.

A model that sees one frame cannot see motion: its velocity branch learns the mean of what each look allows
(docs/detection.md#velocity-from-tracks). The boxes themselves move, though: matched from key frame to key frame (the
greedy nearest-centre matching of CenterPoint's tracker, each past track moved ahead by its own velocity
first), a box's velocity is its track's displacement over the last `past_frames` key frames divided by the
time between them. Only past frames are read, so this runs online as well.

Works on the devkit's result boxes (global frame: ego motion drops out) of whole scenes, as scoring has them;
a box without a match (a scene's first frame, a new object) keeps the head's velocity. Classes whose velocity
the devkit does not score (barrier, traffic cone) are left alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from bev.detection.nusc_eval import UNSCORED, attribute_name

UNTRACKED = frozenset(c for c, errors in UNSCORED.items() if "vel_err" in errors)


@dataclass(frozen=True)
class TrackVelocity:
    """past_frames: key frames a velocity spans at most (a longer span averages the boxes' position noise);
    gate: metres between a box and a past track's predicted centre beyond which they are not one object;
    min_past_score: past boxes below this score start no track; still_speed: m/s under which a track is
    taken as still (velocity 0): the position noise of the boxes over one span."""

    past_frames: int
    gate: float
    min_past_score: float
    still_speed: float

    def __post_init__(self):
        checks = (
            (
                "past_frames",
                isinstance(self.past_frames, int) and not isinstance(self.past_frames, bool) and self.past_frames >= 1,
                "a whole number >= 1",
            ),
            ("gate", self.gate > 0, "> 0 (metres)"),
            ("min_past_score", 0 <= self.min_past_score <= 1, "in [0, 1]"),
            ("still_speed", self.still_speed >= 0, ">= 0 (m/s)"),
        )
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"model.detection.track_velocity.{name} must be {what}, got {getattr(self, name)!r}")


def sample_links(nusc) -> dict[str, tuple[str, float]]:
    """{sample token: (previous key frame's token or '', timestamp in seconds)} from the devkit's tables."""
    return {s["token"]: (s["prev"], s["timestamp"] / 1e6) for s in nusc.sample}


def track_velocity(
    results: Mapping[str, list[dict]], links: Mapping[str, tuple[str, float]], options: TrackVelocity
) -> dict[str, list[dict]]:
    """{token: [devkit result box, ...]} -> the same boxes (new dicts) with velocity and attribute from tracks.
    links: sample_links(); a sample whose previous key frame is not in `results` starts its tracks afresh."""
    history: dict[str, list[list[tuple[float, np.ndarray]]]] = {}
    out: dict[str, list[dict]] = {}
    for token in sorted(results, key=lambda t: links[t][1]):  # a key frame after the one before it
        prev, t = links[token]
        boxes = [dict(b) for b in results[token]]
        tracks = [[(t, np.asarray(b["translation"][:2], dtype=np.float64))] for b in boxes]
        if prev in history:
            past = results[prev]
            for i, j in _match(boxes, tracks, past, history[prev], t, options):
                tracks[i] = (history[prev][j] + tracks[i])[-(options.past_frames + 1) :]
                v = _velocity(tracks[i], options.still_speed)
                boxes[i]["velocity"] = v.tolist()
                boxes[i]["attribute_name"] = attribute_name(boxes[i]["detection_name"], float(np.hypot(*v)))
        history[token], out[token] = tracks, boxes
        history.pop(prev, None)  # a key frame has one successor
    return out


def _velocity(track: list[tuple[float, np.ndarray]], still_speed: float) -> np.ndarray:
    (t0, c0), (t1, c1) = track[0], track[-1]
    v = (c1 - c0) / (t1 - t0)
    return v if np.hypot(*v) >= still_speed else np.zeros(2)


def _match(boxes, tracks, past, past_tracks, t: float, options: TrackVelocity) -> list[tuple[int, int]]:
    """(box, past box) pairs: per class, closest pairs first, each box and past box once, within the gate of the
    past track's centre moved on to time t."""
    pairs = []
    for name in {b["detection_name"] for b in boxes} - UNTRACKED:
        mine = [i for i, b in enumerate(boxes) if b["detection_name"] == name]
        theirs = [
            j
            for j, b in enumerate(past)
            if b["detection_name"] == name and b["detection_score"] >= options.min_past_score
        ]
        if not theirs:
            continue
        ahead = np.stack([_predict(past_tracks[j], t, options.still_speed) for j in theirs])
        here = np.stack([tracks[i][-1][1] for i in mine])
        dist = np.linalg.norm(here[:, None] - ahead[None], axis=-1)
        for a, b in zip(*np.nonzero(dist < options.gate)):
            pairs.append((dist[a, b], mine[a], theirs[b]))
    used_box, used_past, matched = set(), set(), []
    for _, i, j in sorted(pairs):
        if i not in used_box and j not in used_past:
            used_box.add(i), used_past.add(j), matched.append((i, j))
    return matched


def _predict(track: list[tuple[float, np.ndarray]], t: float, still_speed: float) -> np.ndarray:
    """Where a past track's object is at time t: its last centre, moved on by its velocity when it has one."""
    last_t, last = track[-1]
    if len(track) < 2:
        return last
    return last + _velocity(track, still_speed) * (t - last_t)
