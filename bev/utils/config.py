"""Hydra helpers: where the configs live, instantiating config groups, run-mode queries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from bev.classes import class_names, normalize_map_layers

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")


def instantiate_list(node: DictConfig | None) -> list:
    """Instantiate every entry of a config group dict that has a _target_ (null entries switch one off)."""
    from hydra.utils import instantiate

    if not node:
        return []
    return [instantiate(c) for c in node.values() if c is not None and "_target_" in c]


def output_dir(cfg: DictConfig) -> Path | None:
    """The run directory (cfg.paths.output_dir), or None when the config has none."""
    try:
        return Path(cfg.paths.output_dir)
    except Exception:
        return None


def is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def task_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _class_names(categories, map_layers=None) -> list[str]:
    return list(class_names(categories, map_layers))


def _map_classes(map_layers=None) -> list[str]:
    return list(normalize_map_layers(map_layers))


def _as_list(names: list[str]):
    from omegaconf import OmegaConf

    # ListConfig, not list: OmegaConf.resolve can only put a container in place of an interpolation.
    return OmegaConf.create(names)


def on_fp32_cpu(fp32_cpu: Any, other: Any) -> Any:
    """`fp32_cpu` on a machine that trains in fp32 on its CPU (no CUDA GPU, no native bf16: bev.utils.precision),
    else `other`: model sizes chosen for the machine, resolved (and stored in checkpoints) when the config is."""
    from bev.utils.precision import trains_in_fp32_on_cpu

    return fp32_cpu if trains_in_fp32_on_cpu() else other


# The project's resolvers (bev.utils.trust lets stored configs call these and no other of its own).
RESOLVERS = {
    "bev.num_classes": lambda cats, layers=None: len(_class_names(cats, layers)),
    "bev.object_classes": lambda cats: _as_list(_class_names(cats)),
    "bev.map_classes": lambda layers=None: _as_list(_map_classes(layers)),
    "bev.on_fp32_cpu": on_fp32_cpu,
}


def register_resolvers() -> None:
    """Config resolvers so the model's head follows data.categories + data.map_layers:
    ${bev.num_classes:${data.categories},${data.map_layers}}, ${bev.object_classes:${data.categories}},
    ${bev.map_classes:${data.map_layers}}."""
    from omegaconf import OmegaConf

    for name, fn in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register_resolvers()


def check_optimizer(cfg: DictConfig) -> None:
    """Build model.optimizer once over a stand-in parameter, before the data is indexed and the model built: a
    value the optimiser refuses (lr=[1,2], lr=-1) is named with its key at the start, not minutes into the run."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, "model.optimizer")
    if node is None:
        return
    factory = instantiate(node)
    try:
        factory(params=_stand_in())
    except Exception as e:
        raise ValueError(_optimizer_refusal(factory, e)) from None


def _stand_in() -> list:
    import torch

    return [torch.nn.Parameter(torch.zeros(1))]


def _optimizer_refusal(factory, error: Exception) -> str:
    """Which model.optimizer settings the optimiser refuses alone (each tried by itself), with its own words."""
    import inspect

    cls = getattr(factory, "func", factory)
    name = f"{getattr(cls, '__module__', '')}.{getattr(cls, '__qualname__', cls)}".lstrip(".")
    given = dict(getattr(factory, "keywords", {}) or {})
    bad = [k for k, v in given.items() if _refuses(cls, {k: v})]
    why = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
    if not bad:
        return f"model.optimizer ({name}) cannot be built ({why}): check its settings {sorted(given)}"
    try:
        defaults = {k: p.default for k, p in inspect.signature(cls).parameters.items()}
    except (TypeError, ValueError):
        defaults = {}
    settings = ", ".join(f"model.optimizer.{k}={given[k]!r}" for k in bad)
    example = next((f" (its default: {k}={defaults[k]!r})" for k in bad if k in defaults), "")
    return f"{settings} is refused by {name} ({why}): pass a value it takes{example}"


def _refuses(cls, kwargs: dict) -> bool:
    try:
        cls(_stand_in(), **kwargs)
    except Exception:
        return True
    return False


def resolve_depth_stride(cfg: DictConfig) -> None:
    """Depth targets at the camera encoder's stride: data.depth_stride null takes model.net.camera.downsample (stored so in
    the checkpoints); one given that differs is refused when the depth loss would compare the two (depth_weight > 0)."""
    from omegaconf import OmegaConf

    stride = OmegaConf.select(cfg, "model.net.camera.downsample", default=None)
    if not OmegaConf.select(cfg, "data.depth_target", default=False) or stride is None:
        return  # no depth targets, or a network without the key (the dataset's default: 16)
    given = cfg.data.get("depth_stride")
    if given is None:
        cfg.data.depth_stride = stride
    elif given != stride and float(OmegaConf.select(cfg, "model.depth_weight", default=0) or 0) > 0:
        raise ValueError(
            f"data.depth_stride={given} but model.net.camera.downsample={stride}: the depth loss would compare the camera "
            f"encoder's stride-{stride} depth cells with targets at stride {given}. Leave data.depth_stride unset (it "
            f"follows the model) or pass data.depth_stride={stride}"
        )


def plain(value: Any) -> Any:
    """Config values (OmegaConf containers, tuples) as plain dicts, lists and scalars; objects by their repr."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def check_flags(cfg: DictConfig, keys: Sequence[str]) -> None:
    """An entry point's top-level switches: true or false (or unset), never "maybe" read as true."""
    for key in keys:
        value = cfg.get(key)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{key}={value!r} must be true or false")
