"""`threads: auto`: torch's intra-op threads follow the load other processes put on our CPUs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import lightning as L
import torch

from bev.utils.threads import OtherLoad, follows_load, intra_op_threads, threads_for_load


class ThreadsFollowLoad(L.Callback):
    """`threads: auto` on the CPU: at the start of training (or of testing) and of every epoch, torch's intra-op
    threads become `max_threads` less one per CPU that other processes kept busy meanwhile
    (bev.utils.threads.threads_for_load; a short probe before the first epoch). Each change is
    printed. On an idle machine the count never changes."""

    def __init__(self, max_threads: int, probe_s: float = 0.5):
        self.max_threads, self.probe_s = int(max_threads), float(probe_s)
        self.load = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.load = OtherLoad()
        time.sleep(self.probe_s)
        self._follow("at the start")

    def on_test_start(self, trainer, pl_module) -> None:  # bev-eval: one probe before its single pass
        self.on_train_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.load is not None and trainer.current_epoch > 0:
            self._follow(f"in epoch {trainer.current_epoch - 1}")

    def _follow(self, when: str) -> None:
        others = self.load.cpus_busy()
        n = threads_for_load(self.max_threads, others)
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
            print(f"threads: {n} (other processes kept {others:.1f} of the CPUs busy {when})", flush=True)
        self.load.mark()


@contextmanager
def threads_following_load(
    threads: int | str | None, num_workers: int, accelerator: str = "cpu", devices: int | str = 1
) -> Iterator[list]:
    """intra_op_threads for the block, yielding the Trainer callbacks that follow other processes' load:
    [ThreadsFollowLoad] where `threads: auto` set n threads for one CPU process, else []."""
    with intra_op_threads(threads, num_workers, accelerator, devices) as n:
        yield [ThreadsFollowLoad(n)] if n and follows_load(threads, accelerator, devices) else []
