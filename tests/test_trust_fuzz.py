"""Property: a checkpoint's stored config runs nothing, whatever it is crafted as. Attacks are generated in
every form (mapping, list, tuple, YAML and JSON strings), at every position of an honest stored config,
as targets (`_args_`, `_partial_`, by interpolation) and as resolvers (nested, spaced, with a name built
by interpolation, assembled by concatenation, escaped for a second resolution). Each must be refused by
the loader every entry point uses (bev.inference.load_checkpoint) with one one-line UntrustedCheckpointError,
and leave its marker file absent: the marker is what the attack would create if anything ran it."""

from __future__ import annotations

import functools
import json
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf, open_dict

from bev.inference import load_checkpoint
from bev.utils.checkpoint import CheckpointError, check_compatible
from bev.utils.config import CONFIG_DIR
from bev.utils.trust import UntrustedCheckpointError, check_stored_config

PWN = "test_trust_fuzz.touch"  # a resolver of this test: resolving it anywhere creates the file it names


def _touch_resolver(path: str) -> str:
    Path(path).touch()
    return "resolved"


if not OmegaConf.has_resolver(PWN):
    OmegaConf.register_new_resolver(PWN, _touch_resolver)


def _call(m: str) -> str:
    return f"${{{PWN}:'{m}'}}"


# kind -> (marker -> (node placed at the position, entries added at the top of the config), live: whether
# resolving + instantiating the node without the check creates the marker)
ATTACKS: dict[str, tuple[Callable[[str], tuple[object, dict]], bool]] = {
    "touch": (lambda m: ({"_target_": "pathlib.Path.touch", "self": m}, {}), True),
    "touch_args": (lambda m: ({"_target_": "pathlib.Path.touch", "_args_": [m]}, {}), True),
    "copyfile": (lambda m: ({"_target_": "shutil.copyfile", "src": __file__, "dst": m}, {}), True),
    # Hydra's own blocklist stops os.system too, but no loader may count on the installed Hydra's policy.
    "os_system": (lambda m: ({"_target_": "os.system", "_args_": [f"touch '{m}'"]}, {}), False),
    "deep_in_allowed_partial": (
        lambda m: (
            {
                "_target_": "torch.optim.Adam",
                "_partial_": True,
                "_args_": [{"g": [{"_target_": "pathlib.Path.touch", "self": m}]}],
            },
            {},
        ),
        True,
    ),
    "partial_touch": (lambda m: ({"_target_": "pathlib.Path.touch", "_partial_": True, "self": m}, {}), False),
    "target_by_interpolation": (
        lambda m: ({"_target_": "${fuzz_target}", "self": m}, {"fuzz_target": "pathlib.Path.touch"}),
        True,
    ),
    "resolver": (lambda m: (_call(m), {}), True),
    "resolver_in_text": (lambda m: (f"a/{_call(m)}/b", {}), True),
    "resolver_spaced": (lambda m: (f"${{ {PWN} :'{m}'}}", {}), True),
    "resolver_in_allowed_one": (lambda m: (f"${{oc.select:fuzz_missing,{_call(m)}}}", {}), True),
    "resolver_name_by_interpolation": (lambda m: (f"${{${{fuzz_name}}:'{m}'}}", {"fuzz_name": PWN}), True),
    "resolver_by_concatenation": (
        lambda m: ("${fuzz_a}${fuzz_b}", {"fuzz_a": "$", "fuzz_b": _call(m)[1:]}),
        True,
    ),
    "resolver_escaped": (lambda m: ("\\" + _call(m), {}), True),
    "oc_env": (lambda m: ("${oc.env:HOME}", {}), False),
    "target_oc_env": (lambda m: ({"_target_": "${oc.env:FUZZ_TARGET,pathlib.Path.touch}", "self": m}, {}), True),
}
FORMS = ("mapping", "ordered_mapping", "yaml", "json", "list", "tuple")


@pytest.fixture(scope="module")
def honest(tmp_path_factory) -> dict:
    """The resolved run config bev-train stores in its checkpoints (experiment synthetic_cpu): its parts
    the loader reads, which keeps the property's 100 examples fast (OmegaConf.create is slow)."""
    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["experiment=synthetic_cpu"], return_hydra_config=True)
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path_factory.mktemp("out"))
        del cfg.hydra
    stored = OmegaConf.to_container(cfg, resolve=True)
    check_stored_config(stored, "honest.ckpt")  # the control: what bev-train stores passes (raises if not)
    return {k: stored[k] for k in ("grid", "data", "model", "trainer")}


def _dict_paths(node: object, path: tuple = ()) -> list[tuple]:
    """The key paths of every mapping in a config (the root included)."""
    if not isinstance(node, dict):
        return []
    return [path] + [p for k, v in node.items() for p in _dict_paths(v, (*path, k))]


def _key(path: tuple) -> str:
    return ".".join(str(k) for k in path)


def _inject(config: dict, path: tuple, how: str, node: object) -> str:
    """Put `node` into the mapping at `path`; return the key path the refusal must name (a prefix)."""
    parent = config
    for k in path:
        parent = parent[k]
    if how == "replace" and parent:
        key = sorted(parent, key=str)[0]
    else:
        key = "fuzz_new"
    if how == "in_list":
        parent[key] = [1, node]
        return _key((*path, key)) + "[1]"
    if how == "in_tuple":
        parent[key] = ("x", node)
        return _key((*path, key)) + "[1]"
    if how == "model_partial":  # a whole-model partial: load_checkpoint would get no module
        config["model"]["_partial_"] = True
        return "model._partial_"
    parent[key] = node
    return _key((*path, key))


def _form(config: dict, form: str) -> object:
    return {
        "mapping": lambda: config,
        "ordered_mapping": lambda: OrderedDict(config),
        "yaml": lambda: yaml.safe_dump(config),
        "json": lambda: json.dumps(config),
        "list": lambda: [config],
        "tuple": lambda: (config,),
    }[form]()


def _one_line_refusal(e: pytest.ExceptionInfo, *expected: str) -> None:
    msg = str(e.value)
    assert len(msg.splitlines()) == 1, msg
    assert "trusted=True" in msg and "trust_checkpoint=true" in msg, msg
    for text in expected:
        assert text in msg, (text, msg)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(sorted(ATTACKS)),
    form=st.sampled_from(FORMS),
    how=st.sampled_from(("replace", "new_key", "in_list", "in_tuple", "model_partial")),
    where=st.integers(min_value=0),
)
def test_no_crafted_stored_config_runs_anything(honest, tmp_path, kind, form, how, where):
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    marker = work / "marker"
    node, extras = ATTACKS[kind][0](str(marker))
    config = json.loads(json.dumps(honest))  # a deep copy
    paths = _dict_paths(config)
    key = _inject(config, paths[where % len(paths)], how, node)
    config.update(extras)
    ckpt = work / "crafted.ckpt"
    torch.save({"state_dict": {}, "bev_config": _form(config, form)}, ckpt)

    with pytest.raises(UntrustedCheckpointError) as e:
        load_checkpoint(ckpt)
    if form == "mapping":
        _one_line_refusal(e, f"key {key}")
    else:
        _one_line_refusal(e, "not the mapping bev-train stores")
    assert not marker.exists()
    assert sorted(p.name for p in work.iterdir()) == ["crafted.ckpt"]


@pytest.mark.parametrize("kind", [k for k, (_, live) in ATTACKS.items() if live])
def test_each_attack_runs_when_nothing_checks_it(kind, tmp_path):
    """The attacks are live: resolved and built as the loader does (a resolved copy re-created, as the
    loader's merges do), without the check, each creates its marker. So the property above can fail."""
    marker = tmp_path / "marker"
    node, extras = ATTACKS[kind][0](str(marker))
    cfg = OmegaConf.create({"x": {"y": node}, **extras})
    resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    try:
        instantiate(resolved.x)
    except Exception:  # the payload's own failure (a partial, a wrong argument) after it ran
        pass
    assert marker.exists()


def test_the_honest_config_passes(honest):
    check_stored_config(honest, "honest.ckpt")  # raises if the walk refused what bev-train stores
    check_stored_config({**honest, "model": {**honest["model"], "lr": "${oc.select:model.base_lr,0.1}"}}, "h.ckpt")


def test_a_model_that_is_no_module_is_a_clear_error():
    with pytest.raises(CheckpointError, match="builds a partial, not a torch module") as e:
        check_compatible(functools.partial(print), {"state_dict": {}}, "x.ckpt")
    assert len(str(e.value).splitlines()) == 1
