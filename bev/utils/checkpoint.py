"""Checkpoints: written atomically, read with one clear error for every way that can fail.

The Lightning glue (AtomicCheckpointIO, ModelCheckpoint) is in bev.callbacks.checkpoint."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not fit the model being built."""


def write_checkpoint(checkpoint: dict[str, Any], path: str | Path) -> None:
    """torch.save through bev.utils.io.atomic_open (same-directory temp file, fsync, os.replace), so a
    crash never leaves a truncated checkpoint. A full disk ends in one clear DiskFullError naming the
    path and the free space, not torch's "unexpected pos"."""
    from bev.utils.io import atomic_open, explain_disk_full

    # Inside atomic_open the disk is judged while the partial file still takes its space; outside, for
    # the flush, fsync and rename.
    with explain_disk_full(path), atomic_open(path, "wb") as f, explain_disk_full(path):
        torch.save(checkpoint, f)


# torch.save stores a checkpoint's entries uncompressed, so their declared sizes add up to about the file's
# own size; an archive that declares more than this beyond it would be inflated in memory by torch.load.
MAX_INFLATION_BYTES = 64 << 20


def _check_declared_sizes(path: Path) -> None:
    """Refuse a zip checkpoint whose entries declare far more data than the file holds (compressed entries:
    a 10 MB file can inflate to gigabytes), from its central directory, before anything is read."""
    import zipfile

    from bev.utils.io import format_bytes

    try:
        with zipfile.ZipFile(path) as archive:
            declared = sum(info.file_size for info in archive.infolist())
    except (zipfile.BadZipFile, OSError, ValueError):  # not a zip archive (or a broken one): torch.load says so
        return
    size = path.stat().st_size
    if declared > size + MAX_INFLATION_BYTES:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was refused: its entries declare {format_bytes(declared)} of data in a file of "
            f"{format_bytes(size)} (compressed: torch.save writes them uncompressed), and loading it would inflate "
            "all of it in memory. Use a checkpoint bev-train wrote."
        )


def read_checkpoint(path: str | Path) -> dict:
    """Load a Lightning checkpoint on the CPU, with one clear error for a missing, corrupt or inflating file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist.")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is not a file.")
    _check_declared_sizes(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt or not a PyTorch checkpoint ({type(e).__name__}: {first}). "
            "If a run was killed while saving, use last.ckpt or an epoch_NNN.ckpt of the same run."
        ) from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise CheckpointError(f"{str(path)!r} is not a Lightning checkpoint (no 'state_dict' entry).")
    return ckpt


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def check_compatible(module: nn.Module, ckpt: dict, path: str | Path, model_config: dict | None = None) -> None:
    """Raise CheckpointError naming the differences when ckpt's weights do not fit `module`, or when
    `module` (what a stored config built) is not a torch module at all."""
    if not isinstance(module, nn.Module):  # e.g. a functools.partial, from a config with `_partial_: true`
        raise CheckpointError(
            f"checkpoint {str(path)!r}: its model config builds a {type(module).__name__}, not a torch module "
            "(a `_partial_` or `_target_` that is not the model's?). Use the model config the run was trained with."
        )
    own, theirs = module.state_dict(), ckpt["state_dict"]
    missing = [k for k in own if k not in theirs]
    unexpected = [k for k in theirs if k not in own]
    shapes = [k for k in own if k in theirs and tuple(own[k].shape) != tuple(theirs[k].shape)]
    if not (missing or unexpected or shapes):
        return
    example = (shapes or missing or unexpected)[0]
    detail = f"{len(missing)} missing, {len(unexpected)} unexpected and {len(shapes)} differently shaped tensors (e.g. {example!r})"
    stored = ckpt.get("bev_config")
    saved = stored.get("model") if isinstance(stored, dict) else None  # a trusted file may store another form
    diffs = ""
    if saved is not None and model_config is not None:
        from bev.utils.trust import without_places

        # places on disk (init_from, weights_path) are never taken from a checkpoint: not a difference to name
        a, b = _flat(without_places(saved)), _flat(without_places(model_config))
        keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        if keys:
            diffs = (
                " Differing model settings (checkpoint -> now): "
                + "; ".join(f"model.{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys[:6])
                + "."
            )
    raise CheckpointError(
        f"checkpoint {str(path)!r} was trained with a different model config: {detail}.{diffs} "
        "Use the experiment and model overrides the run was trained with."
    )


def resolve_checkpoint(path: str | Path) -> Path:
    """A .ckpt file as is; a run or checkpoints directory -> its best checkpoint by val/iou.

    The best is the one last.ckpt names; when last.ckpt is unreadable (a corrupt file), the one the
    newest readable epoch checkpoint names, with a warning."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return path
    ckdir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    last, epochs = ckdir / "last.ckpt", sorted(ckdir.glob("epoch_*.ckpt"))
    unreadable: list[str] = []
    error: CheckpointError | None = None
    for source in [last] * last.is_file() + epochs[::-1]:
        try:
            best = _best_named_in(source, ckdir)
        except CheckpointError as e:
            unreadable.append(source.name)
            error = error or e
            continue
        if best is not None and best.name not in unreadable:
            if unreadable:
                warnings.warn(
                    f"{', '.join(unreadable)} in {ckdir} cannot be read (corrupt: a killed save?); using "
                    f"{best.name}, the best checkpoint {source.name} names",
                    stacklevel=2,
                )
            return best
    if len(epochs) == 1 and epochs[0].name not in unreadable:
        return epochs[0]
    if last.is_file() and "last.ckpt" not in unreadable:
        return last
    raise error or CheckpointError(
        f"no readable checkpoint found in {str(path)!r} (expected checkpoints/epoch_NNN.ckpt or last.ckpt)."
    )


def _best_named_in(source: Path, ckdir: Path) -> Path | None:
    """The best checkpoint (by its ModelCheckpoint state) that `source` names, when it is in ckdir."""
    for key, state in read_checkpoint(source).get("callbacks", {}).items():
        best = state.get("best_model_path") if key.startswith("ModelCheckpoint") else None
        if best and (ckdir / Path(best).name).is_file():  # by name: the run dir may have moved
            return ckdir / Path(best).name
    return None


def logged_val_iou(ckpt: dict) -> float | None:
    """The val/iou the training run logged for the epoch this checkpoint was saved at."""
    for key, state in ckpt.get("callbacks", {}).items():
        if key.startswith("ModelCheckpoint") and "val/iou" in key and state.get("current_score") is not None:
            return float(state["current_score"])
    return None
