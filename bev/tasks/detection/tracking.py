"""Velocity from tracks: a box's velocity as the displacement of the same object since the key frame before.

A model that sees one frame cannot see motion: its velocity branch learns the mean of what each look allows
(docs/detection.md#velocity-from-tracks). The boxes themselves move, though: matched to the boxes of the key frame
before (CenterPoint's tracker: each box, best score first, takes the nearest free past box of its class within the
gate, measured from the box moved back by its own predicted velocity), a box's velocity is its displacement over
the last `past_frames` key frames divided by the time between them. Only past frames are read, so this runs online.

The nuScenes detection task allows at most 0.5 s of past sensor data at inference (one 2 Hz key frame before the
present): with past_frames=1 a velocity and its match read the present boxes and those of that one key frame only.
More is refused unless `outside_rules` (Python only, for measurements), which such scores must then say.

Works on the devkit's result boxes (global frame: ego motion drops out) of whole scenes, as scoring has them;
a box without a match (a scene's first frame, a new object) keeps the head's velocity. Classes whose velocity
the devkit does not score (barrier, traffic cone) are left alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from bev.classes import DETECTION_CLASSES
from bev.geometry import BOX_FIELDS
from bev.tasks.detection.nusc_eval import KEY_FRAME_SECONDS, MAX_PAST_KEY_FRAMES, UNSCORED, attribute_name

UNTRACKED = frozenset(c for c, errors in UNSCORED.items() if "vel_err" in errors)
CONFIG_KEYS = ("past_frames", "gate", "min_past_score", "still_speed")  # model.detection.track_velocity's options


@dataclass(frozen=True)
class TrackVelocity:
    """past_frames: key frames a velocity spans at most (1: 0.5 s, the most the nuScenes detection rules allow);
    gate: metres between a box moved back by its own velocity and a past box beyond which they are not one object;
    min_past_score: past boxes below this score start no track; still_speed: m/s under which a track is
    taken as still (velocity 0): the position noise of the boxes over one span. outside_rules: allow
    past_frames > 1 (not a config option: scores from it are outside the detection rules)."""

    past_frames: int
    gate: float
    min_past_score: float
    still_speed: float
    outside_rules: bool = False

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
        if self.past_frames > MAX_PAST_KEY_FRAMES and not self.outside_rules:
            raise ValueError(
                f"model.detection.track_velocity.past_frames={self.past_frames} reads {self.past_seconds:g} s of past "
                f"key frames: the nuScenes detection rules allow at most {MAX_PAST_KEY_FRAMES * KEY_FRAME_SECONDS:g} s "
                f"of past sensor data; set model.detection.track_velocity.past_frames={MAX_PAST_KEY_FRAMES}"
            )

    @property
    def past_seconds(self) -> float:
        """The past a velocity reads: past_frames key frames of 0.5 s."""
        return self.past_frames * KEY_FRAME_SECONDS

    @classmethod
    def from_config(cls, options) -> TrackVelocity:
        """From model.detection.track_velocity (a mapping of the four options), with the unknown keys named."""
        if not isinstance(options, Mapping) or set(options) != set(CONFIG_KEYS):
            given = sorted(options) if isinstance(options, Mapping) else repr(options)
            raise ValueError(
                f"model.detection.track_velocity needs exactly {', '.join(CONFIG_KEYS)} (or null), got {given}"
            )
        return cls(**{k: options[k] for k in CONFIG_KEYS})


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x)


def sample_links(nusc) -> dict[str, tuple[str, float]]:
    """{sample token: (previous key frame's token or '', timestamp in seconds)} from the devkit's tables."""
    return {s["token"]: (s["prev"], s["timestamp"] / 1e6) for s in nusc.sample}


class Tracker:
    """Online tracks of one scene's key frames, fed in time order: update() gives each box's velocity from its track.

    Boxes are given as class names (N,), scores (N,), global x, y centres (N, 2) and the head's global velocities
    (N, 2; used to move a box back for matching, as CenterPoint); a frame whose `prev` is not the last one fed
    starts the tracks afresh (a new scene, a gap)."""

    def __init__(self, options: TrackVelocity):
        self.options = options
        self.token: str | None = None
        self.time = -np.inf
        # The last frame's names, scores and tracks: each box's last past_frames (time, centre), oldest first.
        self.past: tuple[list[str], np.ndarray, list] | None = None

    def update(self, token: str, prev: str, t: float, names, scores, centres, velocities=None) -> np.ndarray:
        """(N, 2) velocities (m/s, global frame) of the frame's boxes; NaN for a box without a past match."""
        centres = np.asarray(centres, dtype=np.float64).reshape(-1, 2)
        names, scores = [str(n) for n in names], np.asarray(scores, dtype=np.float64).reshape(-1)
        head = np.zeros_like(centres) if velocities is None else np.asarray(velocities, np.float64).reshape(-1, 2)
        tracks = [[(t, c)] for c in centres]
        velocity = np.full((len(centres), 2), np.nan)
        if self.past is not None and prev and prev == self.token and t > self.time:  # no time between: no speed
            back = centres - np.nan_to_num(head) * (t - self.time)  # where each box was a key frame ago (CenterPoint)
            for i, j in greedy_match(names, scores, back, *self.past, self.options):
                track = self.past[2][j] + tracks[i]
                velocity[i] = _velocity(track, self.options.still_speed)
                tracks[i] = track[-self.options.past_frames :]
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
    head = np.concatenate([boxes[:, 7:9], np.zeros((len(boxes), 1))], 1) @ rot.T  # ego -> global: R v
    names = [DETECTION_CLASSES[int(label)] for label in np.asarray(labels).reshape(-1)]
    velocity = tracker.update(token, prev, t, names, scores, centres[:, :2], head[:, :2])
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
            head = [b["velocity"][:2] for b in boxes]
            prev, t = links[token]
            for box, v in zip(boxes, tracker.update(token, prev, t, names, scores, centres, head)):
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


def greedy_match(names, scores, points, past_names, past_scores, past_tracks, options: TrackVelocity):
    """(box, past box) pairs by CenterPoint's greedy assignment: boxes in decreasing score (ties: given order), each
    taking the nearest past box still free (ties: the first) of its class, of score >= min_past_score, whose last
    centre is within `gate` metres of the box's point (its centre moved back by its velocity)."""
    past_names = np.asarray(past_names, dtype=object)
    past = np.array([track[-1][1] for track in past_tracks], dtype=np.float64).reshape(-1, 2)
    free = np.asarray(past_scores, dtype=np.float64) >= options.min_past_score
    matched = []
    for i in np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable"):
        if names[i] in UNTRACKED:
            continue
        dist = np.where(free & (past_names == names[i]), np.linalg.norm(past - points[i], axis=1), np.inf)
        j = int(np.argmin(dist)) if len(dist) else -1
        if j >= 0 and dist[j] <= options.gate:
            free[j] = False
            matched.append((int(i), j))
    return matched


def check_past(net_past_frames: int, track: TrackVelocity | None) -> None:
    """Refuse boxes that read more past sensor data than the nuScenes detection rules allow (0.5 s: one key frame):
    a temporal network's past frames, plus, for velocities from tracks, the past boxes' own past."""
    if net_past_frames > MAX_PAST_KEY_FRAMES:
        raise ValueError(
            f"data.past_frames={net_past_frames} feeds the detection head {net_past_frames * KEY_FRAME_SECONDS:g} s of "
            f"past key frames: the nuScenes detection rules allow at most {MAX_PAST_KEY_FRAMES * KEY_FRAME_SECONDS:g} s "
            f"of past sensor data; set data.past_frames={MAX_PAST_KEY_FRAMES}"
        )
    if track is not None and net_past_frames and not track.outside_rules:
        seconds = (net_past_frames + track.past_frames) * KEY_FRAME_SECONDS
        raise ValueError(
            f"model.detection.track_velocity with data.past_frames={net_past_frames}: the past boxes a track reads were "
            f"made from their own past frames ({seconds:g} s of past in all), beyond the "
            f"{MAX_PAST_KEY_FRAMES * KEY_FRAME_SECONDS:g} s the nuScenes detection rules allow; set "
            "model.detection.track_velocity=null (the head's velocity, from the fused past frame)"
        )
