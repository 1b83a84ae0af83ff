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
from dataclasses import dataclass, fields

import numpy as np

from bev.classes import DETECTION_CLASSES
from bev.detection.nusc_eval import UNSCORED, attribute_name
from bev.geometry import BOX_FIELDS

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
            ("gate", _number(self.gate) and self.gate > 0, "> 0 (metres)"),
            ("min_past_score", _number(self.min_past_score) and 0 <= self.min_past_score <= 1, "in [0, 1]"),
            ("still_speed", _number(self.still_speed) and self.still_speed >= 0, ">= 0 (m/s)"),
        )
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"model.detection.track_velocity.{name} must be {what}, got {getattr(self, name)!r}")

    @classmethod
    def from_config(cls, options) -> TrackVelocity:
        """From model.detection.track_velocity (a mapping of the four options), with the unknown keys named."""
        names = [f.name for f in fields(cls)]
        if not isinstance(options, Mapping) or set(options) != set(names):
            given = sorted(options) if isinstance(options, Mapping) else repr(options)
            raise ValueError(f"model.detection.track_velocity needs exactly {', '.join(names)} (or null), got {given}")
        return cls(**{k: options[k] for k in names})


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x)


def sample_links(nusc) -> dict[str, tuple[str, float]]:
    """{sample token: (previous key frame's token or '', timestamp in seconds)} from the devkit's tables."""
    return {s["token"]: (s["prev"], s["timestamp"] / 1e6) for s in nusc.sample}


class Tracker:
    """Online tracks of one scene's key frames, fed in time order: update() gives each box's velocity from its track.

    Boxes are given as class names (N,), scores (N,) and global x, y centres (N, 2); a frame whose `prev` is not the
    last one fed starts the tracks afresh (a new scene, a gap)."""

    def __init__(self, options: TrackVelocity):
        self.options = options
        self.token: str | None = None
        self.time = -np.inf
        self.past: tuple[list[str], np.ndarray, list] | None = None  # the last frame's names, scores, tracks

    def update(self, token: str, prev: str, t: float, names, scores, centres) -> np.ndarray:
        """(N, 2) velocities (m/s, global frame) of the frame's boxes; NaN for a box without a past match."""
        centres = np.asarray(centres, dtype=np.float64).reshape(-1, 2)
        names, scores = [str(n) for n in names], np.asarray(scores, dtype=np.float64).reshape(-1)
        tracks = [[(t, c)] for c in centres]
        velocity = np.full((len(centres), 2), np.nan)
        if self.past is not None and prev and prev == self.token and t > self.time:  # no time between: no speed
            for i, j in _match(names, centres, *self.past, t, self.options):
                tracks[i] = (self.past[2][j] + tracks[i])[-(self.options.past_frames + 1) :]
                velocity[i] = _velocity(tracks[i], self.options.still_speed)
        self.token, self.time, self.past = token, t, (names, scores, tracks)
        return velocity


def track_ego_boxes(
    tracker: Tracker, token: str, prev: str, t: float, boxes, scores, labels, ego_rotation, ego_translation
):
    """One key frame's ego-frame boxes ((K, 9) BOX_FIELDS, scores, labels into DETECTION_CLASSES; the ego pose:
    rotation (3, 3) ego -> global, translation (3,)) -> a float64 copy of the boxes whose matched ones carry their
    track's velocity, turned into the ego frame (bev-predict's boxes)."""
    boxes = np.array(boxes, dtype=np.float64).reshape(-1, len(BOX_FIELDS))
    rot = np.asarray(ego_rotation, dtype=np.float64)
    centres = boxes[:, :3] @ rot.T + np.asarray(ego_translation, dtype=np.float64)
    names = [DETECTION_CLASSES[int(label)] for label in np.asarray(labels).reshape(-1)]
    velocity = tracker.update(token, prev, t, names, scores, centres[:, :2])
    found = np.isfinite(velocity).all(1)
    in_ego = np.concatenate([velocity[found], np.zeros((found.sum(), 1))], 1) @ rot  # global -> ego: R^T v
    boxes[found, 7:9] = in_ego[:, :2]
    return boxes


def track_velocity(
    results: Mapping[str, list[dict]], links: Mapping[str, tuple[str, float]], options: TrackVelocity
) -> dict[str, list[dict]]:
    """{token: [devkit result box, ...]} -> the same boxes (new dicts) with velocity and attribute from tracks.
    links: sample_links(); a sample whose previous key frame is not in `results` starts its tracks afresh."""
    out: dict[str, list[dict]] = {}
    for chain in _chains(results, links):
        tracker = Tracker(options)
        for token in chain:
            boxes = [dict(b) for b in results[token]]
            names = [b["detection_name"] for b in boxes]
            scores = [b["detection_score"] for b in boxes]
            centres = [b["translation"][:2] for b in boxes]
            for box, v in zip(boxes, tracker.update(token, links[token][0], links[token][1], names, scores, centres)):
                if np.isfinite(v).all():
                    box["velocity"] = v.tolist()
                    box["attribute_name"] = attribute_name(box["detection_name"], float(np.hypot(*v)))
            out[token] = boxes
    return out


def _chains(results: Mapping[str, list[dict]], links: Mapping[str, tuple[str, float]]) -> list[list[str]]:
    """The tokens of `results` as runs of consecutive key frames (each run in time order). Every token is in one run:
    one whose prev links never lead to a first frame (a loop in a broken table) is a run of its own."""
    following = {links[t][0]: t for t in results if links[t][0] in results}
    chains, seen = [], set()
    for token in sorted(results, key=lambda t: links[t][1]):
        if links[token][0] not in results:  # the first of its run
            chain = [token]
            while chain[-1] in following:
                chain.append(following[chain[-1]])
            chains.append(chain)
            seen.update(chain)
    return chains + [[t] for t in results if t not in seen]


def _velocity(track: list[tuple[float, np.ndarray]], still_speed: float) -> np.ndarray:
    (t0, c0), (t1, c1) = track[0], track[-1]
    v = (c1 - c0) / (t1 - t0)
    return v if np.hypot(*v) >= still_speed else np.zeros(2)


def _match(names, centres, past_names, past_scores, past_tracks, t: float, options: TrackVelocity):
    """(box, past box) pairs: per class, closest pairs first, each box and past box once, within the gate of the
    past track's centre moved on to time t."""
    pairs = []
    for name in set(names) - UNTRACKED:
        mine = [i for i, n in enumerate(names) if n == name]
        theirs = [j for j, n in enumerate(past_names) if n == name and past_scores[j] >= options.min_past_score]
        if not theirs:
            continue
        ahead = np.stack([_predict(past_tracks[j], t, options.still_speed) for j in theirs])
        dist = np.linalg.norm(centres[mine][:, None] - ahead[None], axis=-1)
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
