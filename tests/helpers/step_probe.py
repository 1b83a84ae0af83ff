"""A callback for the interrupt tests: says each finished training step on stdout, then waits (until a SIGTERM
is noted), so that a test can send a signal while a run is mid-epoch and know which step it landed after."""

import time

import lightning as L


class StepProbe(L.Callback):
    def __init__(self, pause_s: float = 1.0) -> None:
        self.pause_s = pause_s

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        print(f"step {trainer.global_step}", flush=True)
        end = time.monotonic() + self.pause_s
        while time.monotonic() < end and not trainer.received_sigterm:
            time.sleep(0.05)
