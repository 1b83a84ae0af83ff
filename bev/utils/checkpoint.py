"""Checkpoints: written atomically, read with one clear error for every way that can fail.

The Lightning glue (AtomicCheckpointIO, ModelCheckpoint) is in bev.callbacks.checkpoint."""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not fit the model being built."""


# Settings that name places on disk. A checkpoint's stored config never decides where files are read or
# written: these come from the user's command or the config defaults (docs/inference.md).
PLACE_KEYS = frozenset({"dataroot", "init_from", "paths", "ckpt_path", "weights_path"})
PLACE_SUFFIXES = ("_dir", "dirpath", "_path", "_root", "_file")


def names_a_place(key: Any) -> bool:
    """Whether a config key names a place on disk (data.dataroot, data.cache_dir, paths.*, *_dir, *_path, ...)."""
    return isinstance(key, str) and (key in PLACE_KEYS or key.endswith(PLACE_SUFFIXES))


def without_places(config: Any, place: bool = False) -> Any:
    """A copy of a stored config with every setting that names a place on disk (names_a_place), and every
    value under one (paths.*), set to None; the keys stay, so interpolations of them still resolve."""
    if isinstance(config, dict):
        return {k: without_places(v, place or names_a_place(k)) for k, v in config.items()}
    if isinstance(config, list):
        return [without_places(v, place) for v in config]
    return None if place else config


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


def read_checkpoint(path: str | Path, mmap: bool = False) -> dict:
    """Load a Lightning checkpoint on the CPU, with one clear error for a missing, corrupt or inflating file.
    mmap=True maps the tensors' data instead of reading it (for a look at the metadata)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist.")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is not a file.")
    _check_declared_sizes(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt or not a PyTorch checkpoint ({type(e).__name__}: {first}). "
            "If a run was killed while saving, use last.ckpt or an epoch_NNN.ckpt of the same run."
        ) from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise CheckpointError(f"{str(path)!r} is not a Lightning checkpoint (no 'state_dict' entry).")
    upgrade_checkpoint(ckpt)
    return ckpt


# Names earlier checkpoints used, and today's: read_checkpoint and a resumed run (BEVLitModule.on_load_checkpoint)
# rename them, so every checkpoint bev-train wrote loads as it was trained.
RENAMED_STATE = {"val_iou_best": "val_headline_best"}  # the best of the headline metric (val/iou before it)
RENAMED_MODEL_KEYS = {"heads": "tasks"}  # model.heads listed the tasks trained


def upgrade_checkpoint(ckpt: dict) -> bool:
    """A checkpoint of an earlier layout in today's, in place: its network as a BEVNet (bev.utils.legacy), its
    state_dict keys (RENAMED_STATE), stored model settings (RENAMED_MODEL_KEYS) and task modules under their current
    names.
    True when the network's layout was upgraded (its optimiser states then follow: legacy.reorder_optimizer_states)."""
    from bev.utils.legacy import upgrade_module, upgrade_network, upgrade_settings

    upgraded = upgrade_network(ckpt)
    state = ckpt.get("state_dict")
    config = ckpt.get("bev_config")
    model = config.get("model") if isinstance(config, dict) else None
    for table, names in ((state, RENAMED_STATE), (model, RENAMED_MODEL_KEYS)):
        if isinstance(table, dict):
            for old, new in names.items():
                if old in table and new not in table:
                    table[new] = table.pop(old)
    module = upgrade_module(ckpt)
    upgrade_settings(ckpt)
    return module or upgraded


# The nodes of a stored config load_checkpoint reads as mappings: anything else there (a string, a list) is an
# edited or damaged file, refused naming the key instead of failing inside OmegaConf.
STORED_MAPPINGS = ("grid", "data", "model", "model.net", "model.net.camera")


def check_stored_sections(config: Any, path: str | Path, model_given: bool = False) -> None:
    """Raise CheckpointError naming the first node of STORED_MAPPINGS (and trainer, when present) of a stored
    config that is not a mapping; the model's nodes are not read when a whole model config is given."""
    if not isinstance(config, dict):  # None: no stored config; other forms: bev.utils.trust refuses them
        return
    keys = [k for k in STORED_MAPPINGS if not (model_given and k.startswith("model"))]
    net = (config.get("model") or {}).get("net") if isinstance(config.get("model"), dict) else None
    if isinstance(net, dict) and net.get("camera") is None and isinstance(net.get("lidar"), dict):
        keys.remove("model.net.camera")  # a LiDAR-only network has no camera branch
    for key in keys + (["trainer"] if "trainer" in config else []):
        node: Any = config
        for part in key.split("."):
            node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
        if not isinstance(node, dict):
            what = {id(_ABSENT): "missing", id(None): "null"}.get(id(node), f"of type {type(node).__name__}")
            what += f" ({str(node)[:60]!r})" if node not in (_ABSENT, None) else ""
            fix = ", or pass model=<the model config it was trained with>" if key.startswith("model") else ""
            raise CheckpointError(
                f"checkpoint {str(path)!r}: its stored config's {key} is {what}, not the mapping bev-train stores "
                f"(an edited or damaged file). Use a checkpoint bev-train wrote{fix}"
            )


_ABSENT = object()


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


class Chosen(NamedTuple):
    """The checkpoint file a path given as ckpt_path names, and why that one (said by the commands)."""

    path: Path
    reason: str  # "" for a file given as it is


def resolve_checkpoint(path: str | Path) -> Path:
    """A .ckpt file as is; a run or checkpoints directory -> the file choose_checkpoint picks."""
    return choose_checkpoint(path).path


def choose_checkpoint(path: str | Path) -> Chosen:
    """A .ckpt file as is; in a run or checkpoints directory, by this rule:

    1. the newest last checkpoint (last.ckpt, or last-vN.ckpt that a second bev-train into the same folder
       writes beside it; newest by modification time) stands for the folder's latest run: the best checkpoint
       by the monitor (val/iou) that it names, else that last checkpoint itself;
    2. without a readable last checkpoint: the checkpoint with the best monitored score it recorded when saved;
    3. else the newest readable checkpoint.
    Unreadable files (a killed save) are skipped with a warning naming them."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return Chosen(path, "")
    ckdir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = sorted(ckdir.glob("*.ckpt"))
    if not found:
        raise CheckpointError(
            f"no checkpoint in {str(path)!r} (expected checkpoints/epoch_NNN.ckpt or last.ckpt): pass ckpt_path=<a "
            ".ckpt file, or the run directory bev-train wrote>"
        )
    states, errors = _peek_all(found)
    if not states:
        names = ", ".join(p.name for p in found)
        raise CheckpointError(f"no readable checkpoint in {str(path)!r}: {names} cannot be read ({errors[0]})")
    chosen = _by_rule(states)
    if errors:
        skipped = ", ".join(p.name for p in found if p not in states)
        warnings.warn(
            f"{skipped} in {ckdir} cannot be read (corrupt: a killed save?); using {chosen.path.name}, {chosen.reason}",
            stacklevel=2,
        )
    return chosen


class _Peek(NamedTuple):
    """What the choice needs of one checkpoint: its ModelCheckpoint states and how new it is."""

    states: dict[str, dict]  # the ModelCheckpoint callbacks' states, by their state keys
    newness: tuple  # (modification time, global step, name): larger is newer


def _peek_all(files: list[Path]) -> tuple[dict[Path, _Peek], list[str]]:
    """The readable checkpoints among `files` (tensors memory-mapped, not read) and the errors of the others."""
    peeks, errors = {}, []
    for f in files:
        try:
            ckpt = read_checkpoint(f, mmap=True)
        except CheckpointError as e:
            errors.append(str(e))
            continue
        callbacks = ckpt.get("callbacks") if isinstance(ckpt.get("callbacks"), dict) else {}
        states = {k: v for k, v in callbacks.items() if str(k).startswith("ModelCheckpoint") and isinstance(v, dict)}
        step = ckpt.get("global_step") if isinstance(ckpt.get("global_step"), int) else -1
        peeks[f] = _Peek(states, (f.stat().st_mtime_ns, step, f.name))
    return peeks, errors


def _by_rule(peeks: dict[Path, _Peek]) -> Chosen:
    """choose_checkpoint's rule over the readable checkpoints of one folder."""
    lasts = [p for p in peeks if p.name == "last.ckpt" or re.fullmatch(r"last-v\d+\.ckpt", p.name)]
    newest = max(peeks, key=lambda p: peeks[p].newness)
    if lasts:
        last = max(lasts, key=lambda p: peeks[p].newness)
        latest = last.name + (f" (the newest of {len(lasts)} last checkpoints)" if len(lasts) > 1 else "")
        for key, state in peeks[last].states.items():
            best = Path(str(state.get("best_model_path") or "")).name  # by name: the run dir may have moved
            if best and _key_settings(key).get("monitor") and last.parent / best in peeks:
                return Chosen(last.parent / best, f"the best by {_monitor(key)} that {latest} names")
        return Chosen(last, f"{latest} (it names no readable best checkpoint)")
    monitored = [(peeks[p].newness, k) for p in peeks for k in peeks[p].states if _key_settings(k).get("monitor")]
    key = max(monitored)[1] if monitored else ""  # the newest checkpoint's monitor: scores of one metric compared
    scored = [(s, p) for p in peeks for s in [_recorded_score(peeks[p], key)] if s is not None]
    if scored:
        best = max(scored, key=lambda sp: (sp[0], peeks[sp[1]].newness))[1]
        return Chosen(best, f"the best by {_monitor(key)} the checkpoints recorded (no readable last checkpoint)")
    return Chosen(newest, "the newest checkpoint (none records a monitored score, no readable last.ckpt)")


def _monitor(key: str) -> str:
    """'val/iou (max)' from a ModelCheckpoint state key such as "ModelCheckpoint{'monitor': 'val/iou', 'mode': 'max', ...}"."""
    settings = _key_settings(key)
    return f"{settings.get('monitor')} ({settings.get('mode', 'min')})" if settings.get("monitor") else "its monitor"


def _key_settings(key: str) -> dict:
    import ast

    try:  # a literal only: the key comes from the file
        settings = ast.literal_eval(key.removeprefix("ModelCheckpoint"))
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return {}
    return settings if isinstance(settings, dict) else {}


def _recorded_score(peek: _Peek, key: str) -> float | None:
    """The score of the ModelCheckpoint `key` a checkpoint recorded when saved, signed so that larger is better."""
    score = peek.states.get(key, {}).get("current_score")
    if not isinstance(score, (torch.Tensor, float, int)) or (isinstance(score, torch.Tensor) and score.numel() != 1):
        return None
    value = float(score)
    if not math.isfinite(value):
        return None
    return value if _key_settings(key).get("mode") == "max" else -value


def warn_of_an_earlier_run(run_dir: str | Path) -> None:
    """Warn a bev-train without ckpt_path into a run directory that holds an earlier run's last checkpoint: its own
    are saved beside them (last-v1.ckpt, ...), and the directory then resolves to the newest run (choose_checkpoint)."""
    ckdir = Path(run_dir) / "checkpoints"
    lasts = [p for p in ckdir.glob("last*.ckpt") if p.is_file()] if ckdir.is_dir() else []
    if lasts:
        newest = max(lasts, key=lambda p: p.stat().st_mtime_ns)
        warnings.warn(
            f"{ckdir} holds an earlier run's checkpoints ({newest.name}): this run saves its own beside them and the "
            f"folder then resolves to this run's. To continue the earlier run instead, pass ckpt_path={newest}",
            stacklevel=2,
        )


def logged_val_iou(ckpt: dict) -> float | None:
    """The val/iou the training run logged for the epoch this checkpoint was saved at."""
    for key, state in ckpt.get("callbacks", {}).items():
        if key.startswith("ModelCheckpoint") and "val/iou" in key and state.get("current_score") is not None:
            return float(state["current_score"])
    return None


def load_matching(module: nn.Module, ckpt: Mapping[str, Any], file: Any) -> tuple[set[str], str]:
    """Load the `net.*` tensors of checkpoint `ckpt` (read from `file`) whose names and shapes match `module`'s; returns their names and a summary of what was loaded, what is new and
    what was skipped."""
    theirs = {k: v for k, v in ckpt["state_dict"].items() if k.startswith("net.")}
    own = module.state_dict()
    take = {k: v for k, v in theirs.items() if k in own and tuple(own[k].shape) == tuple(v.shape)}
    if not take:
        raise ValueError(
            f"model.init_from: none of {file}'s network tensors fit this model "
            f"(a different camera, grid or BEV encoder config?)"
        )
    module.load_state_dict(take, strict=False)
    new = [k for k in own if k.startswith("net.") and k not in take]
    skipped = [k for k in theirs if k not in take]

    def parts(keys) -> str:
        counts = Counter(".".join(k.split(".")[1 : 3 if k.startswith("net.heads.") else 2]) for k in keys)
        return ", ".join(f"{name} ({n})" for name, n in counts.items()) or "none"

    lines = [
        f"model.init_from: loaded {len(take)} tensors from {file}: {parts(take)}",
        f"  new (trained from scratch): {parts(new)}",
    ]
    if skipped:
        lines.append(
            f"  skipped (not in this model or shaped differently): {', '.join(skipped[:8])}"
            + (f" and {len(skipped) - 8} more" if len(skipped) > 8 else "")
        )
    return set(take), "\n".join(lines)
