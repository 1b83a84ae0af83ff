"""`make train`'s helpers: its time limit before training, its last lines, its learning curve.

    python -m bev.make_train deadline --make-start S --minutes 20 --eval-reserve-s 45 --min-train-s 120
        prints the deadline bev-train gets (Unix seconds) on stdout; on stderr when it is, and one line saying
        why make train cannot end within its minutes when too little is left for the minimum training
    python -m bev.make_train report outputs/synthetic_cpu --make-start S --minutes 20
        the last lines of make train: how long it took, and when the time left a small part of the schedule,
        how much, what the model scores, and how to train it further
    python -m bev.make_train plot outputs/synthetic_cpu --out outputs/synthetic_cpu/learning_curve.png
        val/iou and train/loss against the optimiser step, from the run's CSV log

The deadline is TRAIN_MINUTES after make started less what follows bev-train (EVAL_RESERVE_S); bev-train's
TimeBudget keeps this run's measured start-up and a validation free before it for bev-eval, and guarantees
the minimum training time from the first training step (bev/callbacks/time_budget.py). `deadline` and
`report` need the standard library only (they run in ~0.1 s); `plot` loads matplotlib and Lightning.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

UNDERTRAINED = 0.25  # below this fraction of the planned steps the last lines say the model is undertrained
# What the whole schedule of experiment=synthetic_cpu scores: the README's row for it, to two decimals
# (tests/test_make_train.py holds the two together).
FULL_SCHEDULE = {"iou_vehicle": ("vehicle IoU", 0.42), "miou_map": ("map mIoU", 0.57)}


def _clock(unix_s: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix_s))


def plan_deadline(now: float, make_start: float, minutes: float, eval_reserve_s: float, min_train_s: float):
    """(deadline in Unix seconds, the lines to print before bev-train starts)."""
    end = make_start + minutes * 60
    deadline = end - eval_reserve_s
    lines = [
        f"make train: bev-train has until {_clock(deadline)} ({deadline - now:.0f} s from now), training at least "
        f"{min_train_s:.0f} s from its first step; then the evaluation (TRAIN_MINUTES={minutes:g} ends at {_clock(end)})"
    ]
    need = min_train_s + eval_reserve_s  # at the least: bev-train's and bev-eval's start-ups come on top
    if end - now < need:
        spent = (now - make_start) / 60
        lines.append(
            f"make train: it cannot end within TRAIN_MINUTES={minutes:g}: {max(end - now, 0):.0f} s are left after "
            f"{spent:.1f} min of venv and data, less than the {min_train_s:.0f} s of minimum training and the "
            f"{eval_reserve_s:.0f} s kept for the evaluation; it ends after {_clock(now + need)}. The venv and the "
            f"data are made once: a next `make train` spends its TRAIN_MINUTES on training"
        )
    return int(deadline), lines


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def report(run: Path, make_start: float, minutes: float, now: float, data: str = "data/synthetic") -> list[str]:
    """The last lines of make train (see the module docstring)."""
    took = (now - make_start) / 60
    lines = [f"make train: {took:.1f} min in all (TRAIN_MINUTES={minutes:g})"]
    record = _read(run / "metrics.json")
    budget = record.get("time_budget") or {}
    if took > minutes:
        lines[0] += f", {took - minutes:.1f} min over" + _why_late(budget, run, now)
    planned, steps = budget.get("planned_steps"), record.get("global_step")
    if planned and steps is not None and steps < UNDERTRAINED * planned:
        lines += _undertrained(run, data, budget, steps, planned, _after_training_s(run, now), minutes)
    return lines


def _why_late(budget: dict, run: Path, now: float) -> str:
    """Where the time went beyond TRAIN_MINUTES, from bev-train's record."""
    parts = []
    if budget.get("startup_s"):
        parts.append(f"bev-train's start-up {budget['startup_s']:.0f} s")
    if budget.get("late_s"):
        parts.append(f"the minimum training ({budget.get('min_train_s', 0):.0f} s) past the deadline")
    parts.append(f"{_after_training_s(run, now):.0f} s after training (evaluation, plots)")
    return ": " + ", ".join(parts)


def _after_training_s(run: Path, now: float) -> float:
    """Seconds since bev-train wrote its metrics.json, as it ended: the evaluation and the plots."""
    try:
        return max(now - (run / "metrics.json").stat().st_mtime, 0.0)
    except OSError:
        return 0.0


def _undertrained(
    run: Path, data: str, budget: dict, steps: int, planned: int, after_s: float, minutes: float
) -> list[str]:
    """What an undertrained model scores, and the three ways to train it further."""
    scores = _read(run / "eval" / "metrics.json").get("metrics", {})
    got = ", ".join(f"{name} {scores[k]:.3f}" for k, (name, _) in FULL_SCHEDULE.items() if k in scores)
    full = " and ".join(f"{v:.2f}" for _, v in FULL_SCHEDULE.values())
    lines = [
        f"make train: warning: the model is undertrained: {steps} of its {planned} planned steps "
        f"({100 * steps / planned:.0f} %) fitted in the time; it scores {got or 'what the evaluation above says'}, "
        f"where the whole schedule reaches about {full}.",
        f"  To train it further: `make train` again resumes from {run}/checkpoints/last.ckpt and continues the schedule;",
    ]
    s_per_step = budget.get("s_per_step")
    if s_per_step:
        rest = (planned - steps) * s_per_step * 1.1  # + ~10 % of validations
        need = math.ceil((rest + (budget.get("startup_s") or 0) + after_s) / 60) + 1
        lines.append(
            f"  with `make train TRAIN_MINUTES={max(need, int(minutes))}` the remaining steps fit at {s_per_step:.2f} s/step;"
        )
    else:
        lines.append("  with more time: `make train TRAIN_MINUTES=<minutes>`;")
    lines.append(
        f"  or on a GPU: `bev-train experiment=synthetic_cpu trainer=gpu data.dataroot={data}` (minutes there: docs/gpu.md)."
    )
    return lines


def plot(run: Path, out: Path, title: str | None = None) -> None:
    """Draw the run's training loss and validation IoUs against the step on twin axes, save it to `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bev.utils.metrics_log import read_metrics_log

    log = read_metrics_log(run)  # every csv/version_* merged, one value per step
    fig, ax_loss = plt.subplots(figsize=(8, 4.5), dpi=120)
    loss_styles = {"train/loss_step": dict(color="tab:gray", alpha=0.5, lw=0.8), "train/loss_epoch": dict(color="k")}
    for key, style in loss_styles.items():
        if key in log:
            ax_loss.plot(*log[key], label=key.replace("_step", " (step)").replace("_epoch", " (epoch)"), **style)
    ax_loss.set_xlabel("optimiser step")
    ax_loss.set_ylabel("BCE loss")
    ax_iou = ax_loss.twinx()
    for key, style in (("val/iou", "o-"), ("val/iou_vis", "s--"), ("val/miou_map", "^-")):
        if key in log:
            ax_iou.plot(*log[key], style, ms=4, label=key)
    ax_iou.set_ylabel("IoU")
    ax_iou.set_ylim(0, 1)
    steps, ious = log.get("val/iou", ([], []))
    if ious:
        best = max(ious)
        ax_iou.annotate(f"best {best:.3f}", (steps[ious.index(best)], best), textcoords="offset points", xytext=(5, 5))
    lines = ax_loss.get_lines() + ax_iou.get_lines()
    ax_loss.legend(lines, [ln.get_label() for ln in lines], loc="center right")
    ax_loss.set_title(title or f"learning curve: {run}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bev.make_train", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("deadline", help="print bev-train's deadline (Unix seconds); the plan goes to stderr")
    r = sub.add_parser("report", help="the last lines of make train")
    r.add_argument("run", type=Path, help="bev-train's run directory (metrics.json, eval/metrics.json)")
    r.add_argument("--data", default="data/synthetic", help="the dataroot (for the GPU command)")
    for q in (d, r):
        q.add_argument("--make-start", type=float, required=True, help="when make started (Unix seconds)")
        q.add_argument("--minutes", type=float, required=True, help="TRAIN_MINUTES")
    d.add_argument("--eval-reserve-s", type=float, required=True, help="seconds kept after bev-train")
    d.add_argument("--min-train-s", type=float, required=True, help="training guaranteed from its first step")
    g = sub.add_parser("plot", help="the learning curve of a run (its csv/version_*/metrics.csv)")
    g.add_argument("run", type=Path, help="a bev-train run directory")
    g.add_argument("--out", type=Path, required=True, help="the PNG to write")
    g.add_argument("--title", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    now = time.time()
    if args.command == "deadline":
        deadline, lines = plan_deadline(now, args.make_start, args.minutes, args.eval_reserve_s, args.min_train_s)
        print("\n".join(lines), file=sys.stderr)
        print(deadline)
    elif args.command == "report":
        print("\n".join(report(args.run, args.make_start, args.minutes, now, args.data)))
    else:
        try:
            plot(args.run, args.out, args.title)
        except FileNotFoundError as e:  # no CSV log in the run directory
            print(f"make_train plot: error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
