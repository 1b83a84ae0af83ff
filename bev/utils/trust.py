"""What a checkpoint's stored config may make this process do: build the project's own objects, nothing else.

bev-train stores its resolved config in every checkpoint, and bev.load_model, bev-eval, bev-predict and
bev-export rebuild the model (and data module) from it with Hydra's `instantiate`, which imports and
calls whatever a `_target_` names. A shared checkpoint could therefore name `os.system`. Before anything
is built, `check_stored_config` walks the whole stored config (every dict and list, `_args_` and
`_partial_` nodes included) and refuses:
  - a `_target_` that is not in `allowed_targets()`: every target named by the project's configs/
    (bev.*, torch, Lightning; Hydra's own launcher/sweeper nodes are never stored), plus the optimiser
    and learning-rate scheduler classes of torch.optim, whose constructors take numbers and parameters;
  - an interpolation calling a resolver other than the project's (bev.*, bev.utils.config) and
    oc.select: oc.env would read the environment, others could be registered by any imported library.
`_convert_` and `_recursive_` only choose container types and recursion: they run no code.
A user who trusts a file passes trusted=True (Python) or trust_checkpoint=true (command line).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bev.utils.checkpoint import CheckpointError

TRUST_HINT = (
    "If you trust this file and its author, load it with trust_checkpoint=true on the command line "
    "(Python: bev.load_model(path, trusted=True)); otherwise do not use it."
)
SAFE_RESOLVERS = ("oc.select",)  # besides the project's own (bev.*)
_RESOLVER_CALL = re.compile(r"\$\{\s*([^\s:{}'\"]+)\s*:")


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint's stored config names code this project does not define."""


def _config_files() -> Iterator[Path]:
    from bev.utils.config import CONFIG_DIR

    root = Path(CONFIG_DIR)
    if not root.is_dir():  # the allowlist is read from them: without them nothing could be checked
        raise UntrustedCheckpointError(
            f"the project's configs/ folder {str(root)!r} is missing, so a checkpoint's "
            f"stored config cannot be checked. {TRUST_HINT}"
        )
    return (p for p in sorted(root.rglob("*.yaml")) if p.relative_to(root).parts[0] != "hydra")


def _targets(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "_target_" and isinstance(v, str):
                yield v
            elif k != "hydra":  # Hydra's own nodes (sweeper, launcher) never reach a run config
                yield from _targets(v)
    elif isinstance(node, list):
        for v in node:
            yield from _targets(v)


def _torch_optim_classes() -> set[str]:
    import torch

    names = {
        f"torch.optim.{n}"
        for n, c in vars(torch.optim).items()
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
    }
    sched = torch.optim.lr_scheduler
    return names | {
        f"torch.optim.lr_scheduler.{n}"
        for n, c in vars(sched).items()
        if isinstance(c, type) and issubclass(c, sched.LRScheduler)
    }


@functools.cache
def allowed_targets() -> frozenset[str]:
    """The `_target_`s a stored config may name: those of configs/ and torch's optimisers and schedulers."""
    import yaml

    named = {t for p in _config_files() for t in _targets(yaml.safe_load(p.read_text()))}
    return frozenset(named | _torch_optim_classes())


def allowed_resolvers() -> frozenset[str]:
    """The OmegaConf resolvers an interpolation of a stored config may call."""
    from bev.utils.config import RESOLVERS

    return frozenset(RESOLVERS) | frozenset(SAFE_RESOLVERS)


def _nodes(node: Any, path: str = "") -> Iterator[tuple[str, str, Any]]:
    """(key path, key, value) of every entry of a nested dict/list config."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        key = f"{path}[{k}]" if isinstance(node, list) else f"{path}.{k}" if path else str(k)
        yield key, k, v
        yield from _nodes(v, key)


def first_untrusted(config: Any) -> tuple[str, str] | None:
    """(key path, what it names) of the first target or resolver outside the allowlists, or None."""
    targets, resolvers = allowed_targets(), allowed_resolvers()
    for key, name, value in _nodes(config):
        if name == "_target_" and (not isinstance(value, str) or value not in targets):
            return key, f"target {value!r}"
        if isinstance(value, str) and "${" in value:
            bad = [r for r in _RESOLVER_CALL.findall(value) if r not in resolvers]
            if bad:
                return key, f"resolver {bad[0]!r} (in {value[:80]!r})"
    return None


def check_stored_config(config: Any, source: str | Path, trusted: bool = False) -> None:
    """Raise UntrustedCheckpointError, before anything is built, when `config` (a plain nested dict/list)
    names code outside the allowlists; `trusted=True` skips the check."""
    if trusted or config is None:
        return
    found = first_untrusted(config)
    if found is not None:
        key, what = found
        raise UntrustedCheckpointError(
            f"checkpoint {str(source)!r} was refused: its stored config key {key} names {what}, which this project's "
            f"configs do not use, and building the model would run it. {TRUST_HINT}"
        )
