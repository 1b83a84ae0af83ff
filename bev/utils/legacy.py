"""Checkpoints of the layout before the composed network (bev.models.BEVNet) in today's layout.

Their stored config built one of three network classes; each becomes a BEVNet configuration, and the weights
move with the parts (docs/configs.md#checkpoints-of-earlier-layouts):

  LiftSplatShoot     camera_encoder.* -> camera.encoder.*; bev_encoder.up2.3.* (the 1x1 head) ->
                     heads.segmentation.conv.*; bev_encoder.* -> decoder.*; det_head.* -> heads.detection.*
  TemporalLiftSplat  as LiftSplatShoot, and fusion.mix.* -> temporal.mix.*; future.*, present_dist.*,
                     future_dist.* -> heads.motion.*
  OccupancyNet       camera_encoder.* as above; voxel_encoder.* -> decoder.*; occ_head.* -> heads.occupancy.*;
                     channel_to_height: bev_encoder.up2.3.* -> heads.occupancy.proj.*, bev_encoder.* -> decoder.*

and the module's settings: a TemporalLitModule's or OccupancyLitModule's under model.<task> (upgrade_module);
segmentation's top-level model.pos_weight, class_weight, ... under model.segmentation (upgrade_settings).
"""

from __future__ import annotations

from typing import Any

NET = "bev.models.BEVNet"
LEGACY_NETS = {
    "bev.models.LiftSplatShoot": "static",
    "bev.models.lss.LiftSplatShoot": "static",
    "bev.models.temporal.TemporalLiftSplat": "temporal",
    "bev.models.occupancy.OccupancyNet": "occupancy",
}
CAMERA_KEYS = ("downsample", "context_channels", "splat", "pool_backend")


def legacy_kind(net: Any) -> str | None:
    """ "static", "temporal" or "occupancy" for a stored model.net of the earlier layout, else None."""
    return LEGACY_NETS.get(_target(net))


def _target(node: Any) -> str | None:
    """The `_target_` of a stored config node; None for anything but a mapping with a string there (a crafted
    config is refused by the trust check after the upgrade, not here)."""
    target = node.get("_target_") if isinstance(node, dict) else None
    return target if isinstance(target, str) else None


def upgrade_net_config(net: dict) -> dict:
    """A stored model.net of the earlier layout -> today's BEVNet config (the same network)."""
    kind = legacy_kind(net)
    old = dict(net)
    camera = {**dict(old.get("camera") or {}), **{k: old[k] for k in CAMERA_KEYS if k in old}}
    new: dict[str, Any] = {"_target_": NET, "grid": old.get("grid"), "camera": camera}
    for key in ("_convert_", "image_size"):
        if key in old:
            new[key] = old[key]
    bev = {"kind": "bev", **dict(old.get("bev") or {})}
    if kind == "occupancy":
        new.update(_occupancy_parts(dict(old.get("occupancy") or {}), bev))
        return new
    heads: dict[str, Any] = {"segmentation": {"num_classes": old.get("num_classes", 1)}}
    if old.get("detection") is not None:
        heads["detection"] = dict(old["detection"])
    new.update(decoder=bev, heads=heads)
    if kind == "temporal":
        new["temporal"] = {k: old[k] for k in ("past_frames", "fusion", "fusion_channels", "fusion_kernel") if k in old}
        motion = {k: old[k] for k in ("future_frames", "head_channels", "probabilistic", "latent_dim") if k in old}
        heads["motion"] = motion
    return new


def _occupancy_parts(occ: dict, bev: dict) -> dict:
    kind = occ.get("kind", "voxel3d")
    if kind == "voxel3d":
        channels = occ.get("channels", 32)
        decoder = {
            "kind": "voxel3d",
            "widths": occ.get("widths", [32, 64, 128]),
            "blocks": occ.get("blocks", [1, 2, 4]),
        }
        decoder["channels"] = channels
    else:
        channels, decoder = occ.get("channels", 256), bev
    return {"decoder": decoder, "heads": {"occupancy": {"kind": kind, "channels": channels}}}


def _renames(kind: str) -> tuple[tuple[str, str], ...]:
    """(old prefix, new prefix) pairs under net., the first that matches applies."""
    head = "heads.occupancy.proj." if kind == "occupancy" else "heads.segmentation.conv."
    return (
        ("camera_encoder.", "camera.encoder."),
        ("bev_encoder.up2.3.", head),
        ("bev_encoder.", "decoder."),
        ("voxel_encoder.", "decoder."),
        ("det_head.", "heads.detection."),
        ("occ_head.", "heads.occupancy."),
        ("fusion.mix.", "temporal.mix."),
        ("future.", "heads.motion.future."),
        ("present_dist.", "heads.motion.present_dist."),
        ("future_dist.", "heads.motion.future_dist."),
    )


def upgrade_net_state(state: dict, kind: str) -> dict:
    """A LightningModule state_dict of the earlier layout with its net.* keys renamed, in the same order."""
    renames = _renames(kind)
    out = {}
    for key, value in state.items():
        if key.startswith("net."):
            rest = key[4:]
            for old, new in renames:
                if rest.startswith(old):
                    rest = new + rest[len(old) :]
                    break
            key = "net." + rest
        out[key] = value
    return out


def upgrade_network(ckpt: dict) -> bool:
    """A checkpoint of the earlier layout (its stored model.net) in today's, in place; False if it is not one."""
    config = ckpt.get("bev_config")
    model = config.get("model") if isinstance(config, dict) else None
    net = model.get("net") if isinstance(model, dict) else None
    state = ckpt.get("state_dict") if isinstance(ckpt.get("state_dict"), dict) else {}
    kind = legacy_kind(net) if net is not None else _kind_by_keys(state)
    if kind is None:
        return False
    if net is not None:
        try:
            model["net"] = upgrade_net_config(net)
        except (TypeError, ValueError, AttributeError):
            return False  # not a config bev-train wrote: left as it is, for the trust check to refuse
    ckpt["state_dict"] = upgrade_net_state(state, kind)
    return True


def _kind_by_keys(state: dict) -> str | None:
    """The earlier layout's network of a checkpoint without a stored config, told by its tensor names."""
    if not any(k.startswith("net.camera_encoder.") for k in state):
        return None
    if any(k.startswith("net.occ_head.") for k in state):
        return "occupancy"
    return "temporal" if any(k.startswith("net.future.") for k in state) else "static"


def reorder_optimizer_states(ckpt: dict, param_names: list[str]) -> None:
    """The optimiser states of an upgraded checkpoint in today's parameter order (`param_names`, the order the
    optimiser was given them): a state_dict keeps its module registration order, which is the earlier
    layout's parameter order, under today's names."""
    position = {k: i for i, k in enumerate(ckpt.get("state_dict") or {})}
    if any(n not in position for n in param_names):
        return  # not the same parameters: the optimiser's own check refuses the states
    old_order = sorted(param_names, key=position.__getitem__)
    new_index = {n: i for i, n in enumerate(param_names)}
    perm = {old: new_index[name] for old, name in enumerate(old_order)}  # old optimiser index -> today's
    for opt in ckpt.get("optimizer_states") or []:
        state = opt.get("state")
        if isinstance(state, dict) and len(opt.get("param_groups", [])) == 1:
            opt["state"] = {perm.get(i, i): v for i, v in state.items()}


# The task modules of before one LightningModule trained every task: their stored settings and state.
LEGACY_MODULES = {"bev.lit_temporal.TemporalLitModule": "motion", "bev.lit_occupancy.OccupancyLitModule": "occupancy"}
MOVED_SETTINGS = {
    "motion": {"temporal_loss": "loss", "instance_decoding": "instance_decoding"},
    "occupancy": {"loss": "loss", "metric_mask": "metric_mask"},
}
MODULE = "bev.lit.BEVLitModule"


def upgrade_module(ckpt: dict) -> bool:
    """A checkpoint of a TemporalLitModule or OccupancyLitModule as one of today's BEVLitModule, in place: the task
    it added in model.tasks, its settings under model.<task> (temporal_loss -> motion.loss, ...), its state under
    task_modules.<task>."""
    config = ckpt.get("bev_config")
    model = config.get("model") if isinstance(config, dict) else None
    task = LEGACY_MODULES.get(_target(model))
    if task is None or not isinstance(model.get("tasks") or [], list):
        return False  # not a module bev-train wrote: left as it is, for the trust check to refuse
    model["_target_"] = MODULE
    tasks = [t for t in (model.get("tasks") or ["segmentation"]) if t != task] if task == "motion" else []
    model["tasks"] = [*tasks, task]
    model[task] = {new: model.pop(old) for old, new in MOVED_SETTINGS[task].items() if old in model}
    state = ckpt.get("state_dict")
    if isinstance(state, dict) and task == "motion":
        prefix = "task_modules.motion."
        ckpt["state_dict"] = {(prefix + k if k.startswith("temporal_loss.") else k): v for k, v in state.items()}
    return True


# Segmentation's settings, at the top of model.* before each task had its mapping under model.<task>.
SEGMENTATION_KEYS = ("object_classes", "map_classes", "loss", "focal_gamma", "pos_weight", "class_weight", "threshold")


def moved_segmentation_key(model: Any) -> str | None:
    """The first of SEGMENTATION_KEYS a model config (or override mapping) gives at the top of model.*, or None."""
    return next((k for k in SEGMENTATION_KEYS if k in model), None)


def upgrade_settings(ckpt: dict) -> bool:
    """A stored BEVLitModule config with segmentation's settings at the top of model.* (SEGMENTATION_KEYS) with
    them under model.segmentation, in place; False if there were none."""
    config = ckpt.get("bev_config")
    model = config.get("model") if isinstance(config, dict) else None
    if _target(model) != MODULE or not any(k in model for k in SEGMENTATION_KEYS):
        return False
    seg = model.get("segmentation")
    if seg is not None and not isinstance(seg, dict):
        return False  # not a config bev-train wrote: left for the trust check to refuse
    moved = {k: model.pop(k) for k in SEGMENTATION_KEYS if k in model}
    model["segmentation"] = {**moved, **(seg or {})}
    return True
