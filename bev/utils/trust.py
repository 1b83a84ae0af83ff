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
  - a `_partial_` node whose target the configs never build partially (optimisers and schedulers are):
    the loader would get a functools.partial where it needs the model;
  - any form but the mapping bev-train stores (a YAML or JSON string would be parsed by OmegaConf into
    a config no walk has seen).
The walk runs twice: on the config as OmegaConf parses it (interpolations as written, read with OmegaConf's
own grammar, so `${ oc.env :X}`, quoted and nested calls count), and, once that passed, on the config
resolved with the allowed resolvers only, which may contain no interpolation any more: a string assembled
by interpolation (`${a}${b}` -> `${oc.env:HOME}`) would be resolved again by a later OmegaConf.create.
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


def _target_nodes(node: Any) -> Iterator[dict]:
    """Every dict with a `_target_` in a config file's YAML tree."""
    if isinstance(node, dict):
        if isinstance(node.get("_target_"), str):
            yield node
        for k, v in node.items():
            if k != "hydra":  # Hydra's own nodes (sweeper, launcher) never reach a run config
                yield from _target_nodes(v)
    elif isinstance(node, list):
        for v in node:
            yield from _target_nodes(v)


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


def _config_target_nodes() -> tuple[dict, ...]:
    import yaml

    return tuple(n for p in _config_files() for n in _target_nodes(yaml.safe_load(p.read_text())))


@functools.cache
def allowed_targets() -> frozenset[str]:
    """The `_target_`s a stored config may name: those of configs/ and torch's optimisers and schedulers."""
    return frozenset({n["_target_"] for n in _config_target_nodes()} | _torch_optim_classes())


@functools.cache
def partial_targets() -> frozenset[str]:
    """The `_target_`s a stored config may build as a partial (`_partial_: true`): the optimisers and
    schedulers, which the module calls later with its parameters; configs/ builds nothing else partially."""
    return frozenset({n["_target_"] for n in _config_target_nodes() if n.get("_partial_")} | _torch_optim_classes())


def allowed_resolvers() -> frozenset[str]:
    """The OmegaConf resolvers an interpolation of a stored config may call."""
    from bev.utils.config import RESOLVERS

    return frozenset(RESOLVERS) | frozenset(SAFE_RESOLVERS)


def _nodes(node: Any, path: str = "") -> Iterator[tuple[str, Any, Any, Any]]:
    """(key path, parent, key, value) of every entry of a nested dict/list/tuple config."""
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, (list, tuple)):
        items = enumerate(node)
    else:
        return
    for k, v in items:
        key = f"{path}[{k}]" if not isinstance(node, dict) else f"{path}.{k}" if path else str(k)
        yield key, node, k, v
        yield from _nodes(v, key)


def _resolver_names(value: str) -> list[str]:
    """The resolvers OmegaConf would call to resolve `value` (by its own grammar), plus any `${name:` the
    text spells (escaped or malformed calls included: a later parse could unescape them)."""
    from omegaconf.errors import GrammarParseError
    from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as G
    from omegaconf.grammar_parser import parse

    names = _RESOLVER_CALL.findall(value)
    try:
        todo = [parse(value)]
    except GrammarParseError:
        return [*names, "an interpolation OmegaConf cannot parse"]
    while todo:
        ctx = todo.pop()
        if isinstance(ctx, G.InterpolationResolverContext):
            name = ctx.resolverName()
            built = any(isinstance(c, G.InterpolationContext) for c in name.getChildren())
            names.append("a resolver name built by interpolation" if built else name.getText())
        todo.extend(ctx.getChildren() if hasattr(ctx, "getChildren") else ())
    return names


def _node_problem(name: Any, value: Any, parent: Any, resolved: bool) -> str | None:
    """What an entry of a stored config would make the loader run, or None."""
    if name == "_target_" and (not isinstance(value, str) or value not in allowed_targets()):
        return f"target {value!r}"
    if name == "_partial_" and value not in (False, None):
        target = parent.get("_target_") if isinstance(parent, dict) else None
        if not isinstance(target, str) or target not in partial_targets():
            return f"_partial_ {value!r} for target {target!r} (the loader would get a partial, not the object)"
    if isinstance(value, str) and "${" in value:
        if resolved:
            return f"a new interpolation {value[:80]!r} (a later load would resolve it again)"
        allowed = allowed_resolvers()
        bad = [r for r in _resolver_names(value) if r not in allowed]
        if bad:
            return f"resolver {bad[0]!r} (in {value[:80]!r})"
    return None


def first_untrusted(config: Any, resolved: bool = False) -> tuple[str, str] | None:
    """(key path, what it names) of the first target, partial or resolver outside the allowlists, or None.
    `resolved`: config is already resolved, so any interpolation left was assembled by resolving."""
    for key, parent, name, value in _nodes(config):
        problem = _node_problem(name, value, parent, resolved)
        if problem:
            return key, problem
    return None


def _refuse(source: str | Path, what: str) -> UntrustedCheckpointError:
    return UntrustedCheckpointError(f"checkpoint {str(source)!r} was refused: its stored config {what}. {TRUST_HINT}")


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def _as_loaded(config: dict, source: str | Path) -> Any:
    """`config` as the loader's OmegaConf.create makes it (a DictConfig)."""
    from omegaconf import OmegaConf

    try:
        return OmegaConf.create(config)
    except Exception as e:  # a value type OmegaConf does not take
        raise CheckpointError(
            f"checkpoint {str(source)!r} has a stored config OmegaConf cannot read ({_one_line(e)}); it was not "
            "written by bev-train, or was altered since."
        ) from None


def _resolved(loaded: Any, source: str | Path) -> Any:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(loaded, resolve=True)
    except Exception as e:  # a missing or circular interpolation, a resolver's own error
        raise CheckpointError(
            f"checkpoint {str(source)!r} has a stored config OmegaConf cannot resolve ({_one_line(e)}); it was not "
            "written by bev-train, or was altered since."
        ) from None


def _has_interpolation(node: Any) -> bool:
    return any(isinstance(v, str) and "${" in v for _, _, _, v in _nodes(node))


def check_stored_config(config: Any, source: str | Path, trusted: bool = False) -> None:
    """Raise UntrustedCheckpointError, before anything is built, when `config` is not a mapping or names
    code outside the allowlists, as parsed and as resolved; `trusted=True` skips the check."""
    from omegaconf import OmegaConf

    if trusted or config is None:
        return
    if type(config) is not dict:  # noqa: E721 (a dict subclass is another form: OmegaConf refuses an OrderedDict)
        raise _refuse(
            source,
            f"is a {type(config).__name__} ({str(config)[:60]!r}), not the mapping bev-train stores, and OmegaConf "
            "would parse it into a config no check has seen",
        )
    loaded = _as_loaded(config, source)
    parsed = OmegaConf.to_container(loaded, resolve=False)
    _raise_if_untrusted(parsed, source, resolved=False)
    if _has_interpolation(parsed):  # resolving runs only allowed resolvers, now that the parsed walk passed
        _raise_if_untrusted(_resolved(loaded, source), source, resolved=True)


def _raise_if_untrusted(config: Any, source: str | Path, resolved: bool) -> None:
    found = first_untrusted(config, resolved=resolved)
    if found is not None:
        key, what = found
        raise _refuse(
            source,
            f"key {key}{', once resolved,' if resolved else ''} names {what}, which this project's configs do not "
            "use, and building the model would run it",
        )
