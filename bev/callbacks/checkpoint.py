"""Checkpoint callbacks: atomic saves (bev.utils.checkpoint), last.ckpt after every epoch and at an interrupt."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info

from bev.utils.checkpoint import write_checkpoint
from bev.utils.io import remove_stale_temporaries


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO saving through bev.utils.checkpoint.write_checkpoint (atomic).

    Lightning's own save goes through an fsspec transaction whose temporary file lives in the
    system temp dir; when that is another filesystem the final move is a copy, so a crash can
    leave a truncated checkpoint. A same-directory rename is atomic on POSIX filesystems.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        write_checkpoint(checkpoint, path)


class ModelCheckpoint(L.pytorch.callbacks.ModelCheckpoint):
    """Lightning's, with `save_last` writing last.ckpt after every training epoch and at the end of training.

    Lightning (2.6) writes last.ckpt only with a top-k checkpoint, and with check_val_every_n_epoch > 1
    only at validations, so a run resumed from last.ckpt lost every epoch since (and a finished run's
    last.ckpt missed its final epochs). Here last.ckpt holds the state after the last step of every
    epoch, validated or not, and at the end of training. The class keeps Lightning's name, so the
    checkpoints' callback state keys stay the same.

    Its state also carries the process's RNG states (torch, CUDA, NumPy, Python) at the save, restored
    when a single-process run resumes, so the resumed run draws the same batch order and augmentations
    as the uninterrupted one (Lightning saves none; DDP ranks keep their own: DistributedSampler orders
    by seed and epoch). Loader workers that persist across epochs are not covered."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit" and trainer.is_global_zero and self.dirpath and os.path.isdir(self.dirpath):
            for tmp in remove_stale_temporaries(self.dirpath):  # saves killed in an earlier session
                rank_zero_info(f"removed {tmp.name}, left in {self.dirpath} by a killed checkpoint save")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._stop_gently_on_sigint()  # now: Lightning registers its SIGTERM handler after setup and on_fit_start

    # ------------------------------------------------------------------ interrupts (SIGINT, SIGTERM)
    # Lightning sets a flag on SIGTERM and stops at the end of the current step (or validation batch) with a
    # SIGTERMException; a Ctrl-C is made to do the same, so that the state saved is that of a finished step
    # (a KeyboardInterrupt can land in the middle of an optimiser step). A second Ctrl-C stops at once.
    stopped_by: str | None = None  # "SIGINT" or "SIGTERM" once an interrupt stopped the run

    def _stop_gently_on_sigint(self) -> None:
        """Ctrl-C -> SIGTERM to this process (Lightning's handler, registered for the fit, sets its flag); only in
        the main thread, where signal handlers live, and when Lightning's SIGTERM handler is there to take it."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.SIG_IGN, None):
            return
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started ignoring it (nohup, a background job)
            return
        # Lightning's teardown puts back the handlers found when its fit started: this one goes with the fit.
        self._main_pid = os.getpid()
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._main_pid:  # a loader worker forked with this handler: the training process stops it
            return
        if self.stopped_by:  # the second Ctrl-C
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.stopped_by = "SIGINT"
        print(
            "\nbev-train: SIGINT: stopping after the current step, saving it to last.ckpt (Ctrl-C again: stop at once)",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGTERM)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """At a SIGTERM (or a first Ctrl-C): last.ckpt of the last finished step, unless it is saved already. Any
        other exception saves nothing (the state may be half a step); the message names the last save."""
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if not isinstance(exception, SIGTERMException):
            if isinstance(exception, KeyboardInterrupt) and trainer.is_global_zero:
                print(f"bev-train: stopped at once (SIGINT); {resume_hint(self)}", file=sys.stderr, flush=True)
            return
        self.stopped_by = self.stopped_by or "SIGTERM"
        if self.save_last and self._saving_allowed(trainer) and self._last_step_in_last != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    _last_step_in_last: int = -1  # the global step last.ckpt holds, as written by this run

    def _save_last_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict[str, Any]) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        if self.save_last:
            self._last_step_in_last = trainer.global_step

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rng": _rng_states()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # Now, on resume: Lightning restores callbacks before it first builds the train loader's iterator
        # (a draw), as the uninterrupted run did after the save. No sanity check runs on a resume.
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if state_dict.get("rng") and not (distributed and torch.distributed.get_world_size() > 1):
            _set_rng_states(state_dict["rng"])

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        # Also after a validation at this epoch's last step: a checkpoint saved there resumes into
        # the finished epoch, and Lightning builds one more loader iterator (an RNG draw) than the
        # uninterrupted run did; one saved here resumes at the next epoch's start, as that run went on.
        if self.save_last and self._saving_allowed(trainer) and self._epoch_end_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            self._epoch_end_saved = trainer.global_step

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:  # mid-epoch (val_check_interval < 1)
            self._save_last_if_missed(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._save_last_if_missed(trainer)

    _epoch_end_saved: int = -1  # the global step of the last last.ckpt written at an epoch end

    @staticmethod
    def _saving_allowed(trainer: L.Trainer) -> bool:
        from lightning.pytorch.trainer.states import TrainerFn

        return not trainer.fast_dev_run and not trainer.sanity_checking and trainer.state.fn == TrainerFn.FITTING

    def _save_last_if_missed(self, trainer: L.Trainer) -> None:
        """last.ckpt now, unless this step is saved already (or nothing is to be saved: sanity check, fast_dev_run)."""
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def resume_hint(callback: ModelCheckpoint | None) -> str:
    """Where an interrupted run resumes from: the last.ckpt this run wrote (or found), or that there is none."""
    last = callback.last_model_path if callback is not None else ""
    if last and Path(last).is_file():
        return f"resume with the same command and ckpt_path={last}"
    return "no checkpoint was saved yet: run the command again to start over"


def interrupted(trainer: L.Trainer) -> SystemExit:
    """After a run stopped by SIGINT or SIGTERM (Lightning's SIGTERMException): one line saying at which step and
    how to resume; the exit status is 128 + the signal's number, as the shell gives a process the signal ended."""
    callback = trainer.checkpoint_callback if isinstance(trainer.checkpoint_callback, ModelCheckpoint) else None
    name = (callback.stopped_by if callback else None) or "SIGTERM"
    if trainer.is_global_zero:
        print(
            f"bev-train: stopped by {name} after step {trainer.global_step} (epoch {trainer.current_epoch}); "
            f"{resume_hint(callback)}",
            file=sys.stderr,
            flush=True,
        )
    return SystemExit(128 + int(getattr(signal, name)))


def _rng_states() -> dict[str, Any]:
    """The RNG states as tensors and plain numbers (a checkpoint must load with weights_only=True)."""
    import random

    import numpy as np

    _, keys, pos, has_gauss, gauss = np.random.get_state()
    version, words, gauss_next = random.getstate()
    states = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "python": {"version": version, "words": torch.tensor(words, dtype=torch.int64), "gauss": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(states["torch"])
    n = states["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = states["python"]
    random.setstate((p["version"], tuple(p["words"].tolist()), p["gauss"]))
    if "cuda" in states and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])
