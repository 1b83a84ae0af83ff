#!/usr/bin/env python
"""bev.tasks.motion.metric.PanopticQuality vs FIERY's own metric, on many sequences.

    .venv/bin/python scripts/check_vpq_vs_fiery.py --fiery /tmp/fiery [--cases 3000] [--seed 0]

--fiery: a checkout of github.com/wayveai/fiery, whose fiery/metrics.py is loaded from there (the pytorch_lightning
1.2 names it imports are stood in for in this process). Hand-made sequences (misses, false positives, id swaps,
IoU of exactly 0.5, merges, splits, empty frames, void cells) and random ones go through both metrics, with and
without temporal consistency, per case and pooled. Reported: the largest |difference| of pq, sq and rq, whether
tp/fp/fn agree exactly, and the undefined ratios (ours NaN, FIERY's 0) apart. Writes JSON to --out atomically.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bev.tasks.motion.metric import PanopticQuality  # noqa: E402
from bev.utils.io import atomic_write  # noqa: E402

KEYS = ("pq", "sq", "rq")


# ---------------------------------------------------------------- FIERY's code, loaded as it is
class _Metric:
    """Stand-in for pytorch_lightning 1.2's Metric: just what FIERY's metrics use."""

    def __init__(self, compute_on_step: bool = True, **_):
        self._defaults = {}

    def add_state(self, name, default, dist_reduce_fx=None):
        self._defaults[name] = default
        setattr(self, name, default.clone())


def _stat_scores_multiple_classes(pred, target, num_classes):
    """Stand-in for pytorch_lightning 1.2's: per class (tp, fp, tn, fn, support)."""
    out = [[], [], [], [], []]
    for c in range(num_classes):
        p, t = pred == c, target == c
        for i, v in enumerate((p & t, p & ~t, ~p & ~t, ~p & t, t)):
            out[i].append(v.sum())
    return tuple(torch.stack(v).float() for v in out)


def stub_lightning() -> dict:
    """pytorch_lightning 1.2's names that FIERY's metrics and trainer (bench_temporal.py --fiery) import, as
    stand-ins in sys.modules; returns what they replaced."""
    names = [
        "pytorch_lightning",
        "pytorch_lightning.metrics",
        "pytorch_lightning.metrics.metric",
        "pytorch_lightning.metrics.functional",
        "pytorch_lightning.metrics.functional.classification",
        "pytorch_lightning.metrics.functional.reduction",
    ]
    saved = {n: sys.modules.get(n) for n in names}
    mods = {n: types.ModuleType(n) for n in names}
    mods["pytorch_lightning.metrics.metric"].Metric = _Metric
    mods[
        "pytorch_lightning.metrics.functional.classification"
    ].stat_scores_multiple_classes = _stat_scores_multiple_classes
    mods["pytorch_lightning.metrics.functional.reduction"].reduce = lambda x, reduction: x
    mods["pytorch_lightning"].LightningModule = torch.nn.Module
    mods["pytorch_lightning"].metrics = mods["pytorch_lightning.metrics"]
    sys.modules.update(mods)
    return saved


def load_fiery(root: Path):
    """fiery.metrics from a FIERY checkout, with the stand-ins in place."""
    if not (root / "fiery" / "metrics.py").is_file():
        raise SystemExit(f"{root} is not a FIERY checkout (no fiery/metrics.py): clone github.com/wayveai/fiery")
    saved = stub_lightning()
    try:
        spec = importlib.util.spec_from_file_location("fiery_metrics", root / "fiery" / "metrics.py")
        metrics = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(metrics)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    return metrics


def fiery_vpq(fm, pred, gt, consistent=True, ignore_index=None) -> dict:
    """FIERY's PanopticMetric (vehicles, index 1); with ignore_index its void class carries those cells."""
    m = fm.PanopticMetric(n_classes=2, temporally_consistent=consistent)
    if ignore_index is None:
        m.update(pred, gt)
    else:  # FIERY's update with void cells: segmentation >= n_classes is void
        for b in range(gt.shape[0]):
            mapping = {}
            for t in range(gt.shape[1]):
                void = gt[b, t] == ignore_index
                g = torch.where(void, 0, gt[b, t])
                r = m.panoptic_metrics(
                    (pred[b, t] > 0).long(), pred[b, t], torch.where(void, 2, (g > 0).long()), g, mapping
                )
                for key in m.keys:  # as its update accumulates
                    getattr(m, key).add_(r[key])
    return fiery_result(m)


def fiery_result(m) -> dict:
    """pq, sq, rq and the states (tp, fp, fn, IoU sum) of a FIERY PanopticMetric, for vehicles (index 1)."""
    r = m.compute()
    states = (m.true_positive, m.false_positive, m.false_negative, m.iou)
    return {k: float(r[k][1]) for k in KEYS} | {k: float(v[1]) for k, v in zip(("tp", "fp", "fn", "iou_sum"), states)}


# ---------------------------------------------------------------- cases
def hand_made() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, pred, gt) with (B, T, X, Y) int64 maps on a 12 x 12 grid."""

    def seq(*frames):
        return torch.stack([torch.as_tensor(f, dtype=torch.int64) for f in frames])[None]

    def box(i, x0, x1, y0, y1, base=None):
        f = torch.zeros(12, 12, dtype=torch.int64) if base is None else base.clone()
        f[x0:x1, y0:y1] = i
        return f

    a, b = box(1, 1, 4, 1, 4), box(2, 6, 9, 6, 10)
    two = box(2, 6, 9, 6, 10, a)
    empty = torch.zeros(12, 12, dtype=torch.int64)
    half = box(5, 1, 4, 1, 3)
    half[1:4, 4] = 5  # 6 of 9 true cells + 3 more: IoU 6/12 = 0.5 exactly
    return [
        ("perfect", seq(two, two, two), seq(two, two, two)),
        ("perfect_other_ids", seq(two * 7, two * 7, two * 7), seq(two, two, two)),
        ("missed_frame", seq(a, empty, a), seq(a, a, a)),
        ("false_positive", seq(two, two, two), seq(a, a, a)),
        ("id_swap", seq(box(3, 1, 4, 1, 4), box(4, 1, 4, 1, 4), box(4, 1, 4, 1, 4)), seq(a, a, a)),
        ("id_swap_back", seq(box(3, 1, 4, 1, 4), box(4, 1, 4, 1, 4), box(3, 1, 4, 1, 4)), seq(a, a, a)),
        ("swap_after_gap", seq(box(3, 1, 4, 1, 4), empty, box(4, 1, 4, 1, 4)), seq(a, a, a)),
        ("ids_exchanged", seq(two, torch.where(two > 0, 3 - two, 0), two), seq(two, two, two)),
        ("iou_exactly_half", seq(half), seq(a)),
        ("merged", seq(torch.where(two > 0, 1, 0)), seq(two)),
        ("split", seq(box(9, 6, 9, 8, 10, box(8, 6, 9, 6, 8))), seq(b)),
        ("all_empty", seq(empty, empty), seq(empty, empty)),
        ("pred_only", seq(two, empty), seq(empty, empty)),
        ("gt_only", seq(empty, empty), seq(two, a)),
        ("two_sequences", torch.cat([seq(a, box(4, 1, 4, 1, 4)), seq(a, a)]), torch.cat([seq(a, a), seq(a, a)])),
    ]


def _paint(rng, frame, ident, x, y, h, w):
    X, Y = frame.shape
    x0, y0 = round(x), round(y)
    frame[max(0, x0) : max(0, min(X, x0 + h)), max(0, y0) : max(0, min(Y, y0 + w))] = ident


def random_gt(rng, B, T, X, Y, n_obj) -> np.ndarray:
    gt = np.zeros((B, T, X, Y), np.int64)
    for b in range(B):
        for k in range(1, n_obj + 1):
            x, y = rng.uniform(-2, X - 2), rng.uniform(-2, Y - 2)
            vx, vy = rng.uniform(-2.5, 2.5, size=2)
            h, w = rng.integers(2, 7, size=2)
            for t in range(T):
                if rng.random() > 0.1:  # now and then an object is not seen
                    _paint(rng, gt[b, t], k, x + vx * t, y + vy * t, h, w)
    gt[:, :, 0, 0] = 0  # FIERY asserts some background exists
    return gt


def _jitter(rng, mask, strength):
    m = np.roll(mask, (rng.integers(-1, 2), rng.integers(-1, 2)), axis=(0, 1)) if rng.random() < strength else mask
    flip = rng.random(mask.shape) < 0.1 * strength
    edge = np.zeros_like(mask)
    edge[1:] |= m[:-1]
    edge[:-1] |= m[1:]
    edge[:, 1:] |= m[:, :-1]
    edge[:, :-1] |= m[:, 1:]
    return np.where(flip & (edge != m), ~m, m)


def random_pred(rng, gt) -> np.ndarray:
    B, T, X, Y = gt.shape
    pred = np.zeros_like(gt)
    p_miss, p_swap, p_fp, p_merge = rng.uniform(0, 0.3, size=4)
    strength = rng.uniform(0, 1)
    for b in range(B):
        ids = {int(k): int(rng.integers(1, 60)) for k in np.unique(gt[b]) if k > 0}
        for t in range(T):
            for k in rng.permutation(list(ids)) if ids else []:
                if rng.random() < p_swap:
                    ids[k] = int(rng.integers(1, 60))
                mask = gt[b, t] == k
                if not mask.any() or rng.random() < p_miss:
                    continue
                ident = ids[k] if rng.random() > p_merge else ids[min(ids)]
                pred[b, t][_jitter(rng, mask, strength)] = ident
            while rng.random() < p_fp:
                _paint(
                    rng,
                    pred[b, t],
                    int(rng.integers(1, 80)),
                    rng.uniform(0, X),
                    rng.uniform(0, Y),
                    *rng.integers(1, 6, size=2),
                )
    return pred


def random_case(rng):
    B, T = int(rng.integers(1, 4)), int(rng.integers(1, 6))
    X, Y = int(rng.integers(8, 40)), int(rng.integers(8, 40))
    gt = random_gt(rng, B, T, X, Y, int(rng.integers(0, 8)))
    if rng.random() < 0.1:  # noise: ids with no relation to the truth
        pred = rng.integers(0, 6, size=gt.shape) * (rng.random(gt.shape) < 0.5)
    else:
        pred = random_pred(rng, gt)
    if rng.random() < 0.05:  # large ids
        pred = np.where(pred > 0, pred + 1000, 0)
    return torch.from_numpy(pred.astype(np.int64)), torch.from_numpy(gt)


# ---------------------------------------------------------------- comparisons
def ours_vpq(pred, gt, consistent=True, ignore_index=None, metric=None) -> dict:
    m = metric or PanopticQuality(temporally_consistent=consistent, ignore_index=ignore_index)
    m.update(pred, gt)
    return m.compute()


class Tally:
    def __init__(self):
        self.cases, self.count_mismatches = 0, []
        self.max_diff = dict.fromkeys(KEYS, 0.0)
        self.undefined = dict.fromkeys(KEYS, 0)
        self.undefined_not_zero = []

    def add(self, name, ours, theirs):
        self.cases += 1
        if any(ours[k] != theirs[k] for k in ("tp", "fp", "fn")):
            self.count_mismatches.append(name)
        for k in KEYS:
            if math.isnan(ours[k]):
                self.undefined[k] += 1
                if theirs[k] != 0:
                    self.undefined_not_zero.append(name)
            else:
                self.max_diff[k] = max(self.max_diff[k], abs(ours[k] - theirs[k]))

    def summary(self) -> dict:
        return {
            "cases": self.cases,
            "max_abs_diff": self.max_diff,
            "count_mismatches": len(self.count_mismatches),
            "count_mismatch_cases": self.count_mismatches[:20],
            "undefined_in_ours_zero_in_fiery": self.undefined,
            "undefined_but_fiery_nonzero": self.undefined_not_zero[:20],
        }


def check_vpq(fm, n_cases: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    tally, void_tally = Tally(), Tally()
    pooled = {c: PanopticQuality(temporally_consistent=c) for c in (True, False)}
    state_sums = {c: dict.fromkeys(("tp", "fp", "fn", "iou_sum"), 0.0) for c in (True, False)}
    everything = []
    cases = hand_made() + [(f"random_{i}", *random_case(rng)) for i in range(n_cases)]
    for name, pred, gt in cases:
        for consistent in (True, False):
            theirs = fiery_vpq(fm, pred, gt, consistent)
            tally.add(f"{name}/{consistent}", ours_vpq(pred, gt, consistent), theirs)
            pooled[consistent].update(pred, gt)
            for k in state_sums[consistent]:
                state_sums[consistent][k] += theirs[k]
        everything.append((pred, gt))
        if name.startswith("random") and gt.numel():
            void = torch.from_numpy(rng.random(gt.shape) < rng.uniform(0, 0.3))
            gt_v = torch.where(void, 255, gt)
            void_tally.add(name + "/void", ours_vpq(pred, gt_v, True, 255), fiery_vpq(fm, pred, gt_v, True, 255))
    return {
        "per_case": tally.summary(),
        "void": void_tally.summary(),
        "pooled": _pooled(fm, pooled, state_sums, everything),
    }


def _ratios(tp, fp, fn, iou_sum) -> dict:
    denom = tp + fp / 2 + fn / 2
    return {"pq": iou_sum / max(denom, 1), "sq": iou_sum / max(tp, 1), "rq": tp / max(denom, 1)}


def _pooled(fm, pooled, state_sums, everything) -> dict:
    """All cases through one metric each. FIERY keeps its states in float32, so its pooled IoU sum
    drifts as it grows; its per-case states summed in float64 show what the drift is."""
    out = {}
    for consistent, metric in pooled.items():
        theirs = fm.PanopticMetric(n_classes=2, temporally_consistent=consistent)
        for pred, gt in everything:
            theirs.update(pred, gt)
        ours, fiery = metric.compute(), fiery_result(theirs)
        f64 = _ratios(**state_sums[consistent]) | state_sums[consistent]
        out["consistent" if consistent else "per_frame"] = {
            "ours": {k: ours[k] for k in KEYS + ("tp", "fp", "fn", "iou_sum")},
            "fiery": fiery,
            "fiery_case_states_summed_in_float64": f64,
            "max_abs_diff": max(abs(ours[k] - fiery[k]) for k in KEYS),
            "max_abs_diff_vs_float64_sum": max(abs(ours[k] - f64[k]) for k in KEYS),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fiery", required=True, type=Path, help="a checkout of github.com/wayveai/fiery")
    p.add_argument("--cases", type=int, default=3000, help="random VPQ cases (besides the hand-made ones)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "vpq_vs_fiery.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    fm = load_fiery(args.fiery)
    t0 = time.time()
    vpq = check_vpq(fm, args.cases, args.seed)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seed": args.seed,
        "fiery_metrics_sha256": hashlib.sha256((args.fiery / "fiery" / "metrics.py").read_bytes()).hexdigest(),
        "torch": torch.__version__,
        "seconds": round(time.time() - t0, 1),
        "vpq": vpq,
    }
    s = vpq["per_case"]
    print(
        f"VPQ: {s['cases']} cases, max |diff| "
        + ", ".join(f"{k} {v:.2e}" for k, v in s["max_abs_diff"].items())
        + f", count mismatches {s['count_mismatches']}; void cases {vpq['void']['cases']}, max |diff| "
        + ", ".join(f"{k} {v:.2e}" for k, v in vpq["void"]["max_abs_diff"].items())
    )
    atomic_write(args.out, json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
