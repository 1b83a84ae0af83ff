"""Training callbacks and plugins, one module each."""

from bev.callbacks.checkpoint import AtomicCheckpointIO, ModelCheckpoint
from bev.callbacks.epoch_summary import EpochSummary
from bev.callbacks.png_logger import BevPngLogger
from bev.callbacks.sweep import RUN_METRICS_FILE, SweepSummary, summarize_sweep
from bev.callbacks.threads import ThreadsFollowLoad
from bev.callbacks.time_budget import TimeBudget, parse_deadline, parse_duration

__all__ = [
    "AtomicCheckpointIO",
    "BevPngLogger",
    "EpochSummary",
    "ModelCheckpoint",
    "RUN_METRICS_FILE",
    "SweepSummary",
    "ThreadsFollowLoad",
    "TimeBudget",
    "parse_deadline",
    "parse_duration",
    "summarize_sweep",
]
