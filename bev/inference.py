"""Using a trained model: rebuild it from a checkpoint, run it on batches, make example inputs.

    model = bev.load_model("logs/train/runs/<run>")      # a .ckpt, or a run dir (its best checkpoint)
    probs = bev.predict(model, batch)                     # (B, K, X, Y) float32 probabilities
    model.class_names, model.grid, model.image_size      # what the K channels and X, Y cells mean

load_model returns the BEVLitModule (eval mode, on `device`), not the bare network: it carries
predict_step, the run config (`run_config`, the resolved config bev-train stored in the
checkpoint, its settings that name places on disk set to null: bev.utils.checkpoint.without_places) and
works with `lightning.Trainer.predict`; the network itself is `model.net`.
bev-eval, bev-predict and bev-export all load checkpoints through `load_checkpoint` here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from bev.tasks.task import NPZ_SCALE  # probabilities are stored as uint8 q = round(p * NPZ_SCALE)

# The network's inputs, in the order bev.models.BEVNet.forward takes them (shapes for B samples of N cameras).
CAMERA_INPUTS: dict[str, str] = {
    "images": "(B, N, 3, H, W) float32, ImageNet-normalised",
    "intrinsics": "(B, N, 3, 3) float32",
    "rots": "(B, N, 3, 3) float32, camera->ego rotation",
    "trans": "(B, N, 3) float32, camera->ego translation (m)",
    "post_rots": "(B, N, 3, 3) float32, image augmentation (identity if none)",
    "post_trans": "(B, N, 3) float32, image augmentation (zeros if none)",
}
TEMPORAL_INPUT = "(B, P+1+F, 4, 4) float32, ego motion from each frame to the next (bev.data.temporal)"
# A LiDAR branch's inputs, after the cameras' (none for a LiDAR-only network), as bev.data.lidar.collate_points
# batches them: the rows of sample b are those with batch index b (their order does not matter).
LIDAR_INPUTS: dict[str, str] = {
    "points": "(M, 6) float32 rows (batch index, x, y, z, intensity, time lag s) in the ego frame, M any",
    "num_points": "(B,) int64, the points of each sample (its length is the batch size)",
}

# model.cuda_graph: the captured training step failed on its first GPU run and was removed.
RETIRED_MODEL_KEYS = ("cuda_graph",)


class Loaded(NamedTuple):
    """A model rebuilt from a checkpoint, with the configs it was built from."""

    model: Any  # bev.lit.BEVLitModule, eval mode, on the CPU
    run_config: DictConfig  # the resolved config of the training run (grid, data, model, trainer, ...)
    model_config: DictConfig  # the model config actually instantiated
    checkpoint: dict  # the raw checkpoint (epoch, global_step, callbacks, ...)
    path: Path  # the checkpoint file (a run directory resolves by bev.utils.checkpoint.choose_checkpoint's rule)
    chosen: str = ""  # why that file, when a directory was given ("" for a file)


def load_checkpoint(
    ckpt_path: str | Path,
    model_config: DictConfig | None = None,
    grid: Any = None,
    data: DictConfig | None = None,
    trusted: bool = False,
) -> Loaded:
    """Rebuild the model a checkpoint was trained as, from the config bev-train stored in it.

    model_config overrides the stored model config (grid and image size still come from the
    checkpoint); for a checkpoint without a stored config, model_config, grid and data must all be
    given. Raises bev.utils.checkpoint.CheckpointError (missing, corrupt, incompatible), and its
    subclass bev.utils.trust.UntrustedCheckpointError, before anything is built, for a stored config
    that names code the project's configs do not (unless `trusted`: see bev.utils.trust).
    """
    from hydra.utils import instantiate

    from bev.tasks import task_classes
    from bev.utils.checkpoint import (
        CheckpointError,
        check_compatible,
        check_stored_sections,
        choose_checkpoint,
        read_checkpoint,
        without_places,
    )
    from bev.utils.trust import check_stored_config

    path, reason = choose_checkpoint(ckpt_path)
    ckpt = read_checkpoint(path)
    check_stored_config(ckpt.get("bev_config"), path, trusted)
    # Places on disk (data.dataroot, data.cache_dir, paths.*, ...) come from the user, never from the checkpoint.
    saved = without_places(ckpt.get("bev_config"))
    check_stored_sections(saved, path, model_given=model_config is not None and "_target_" in model_config)
    if saved is None and (model_config is None or grid is None or data is None):
        raise CheckpointError(
            f"{str(path)!r} carries no bev-train config; pass model=..., data=... and grid=... matching how it was trained."
        )
    run_cfg = OmegaConf.create(saved or {"grid": grid, "data": data, "model": model_config, "trainer": {}})
    # model=<group> replaces the checkpoint's model config; +model.<key>=... overrides are applied on top of it
    # (check_compatible names any that no longer fit the weights).
    given = model_config
    if given is not None and "_target_" in given:
        # A whole model config: its ${grid}, ${data.*} and class-count interpolations mean the checkpoint's.
        context = OmegaConf.create({**{k: run_cfg[k] for k in run_cfg if k != "model"}, "model": given})
        model_cfg = OmegaConf.create(OmegaConf.to_container(context.model, resolve=True))
    else:
        _check_moved(given or {})
        model_cfg = OmegaConf.merge(run_cfg.model, given or {})
    model_cfg = OmegaConf.merge(model_cfg, {"net": {"grid": run_cfg.grid, "image_size": run_cfg.data.final_dim}})
    for key in RETIRED_MODEL_KEYS:  # settings older checkpoints stored that no longer exist
        model_cfg.pop(key, None)
    for task in task_classes():  # each task's settings that older checkpoints stored beyond today's rules
        task.upgrade_model_config(model_cfg, path)
    # The checkpoint holds the weights: do not download or read the pretrained backbone again.
    if model_cfg.net.get("camera") is not None:  # a LiDAR-only network has none
        model_cfg.net.camera.weights = None
        model_cfg.net.camera.weights_path = None
    model = instantiate(model_cfg)
    check_compatible(model, ckpt, path, OmegaConf.to_container(model_cfg, resolve=True))
    model.load_state_dict(ckpt["state_dict"])
    model.run_config = OmegaConf.to_container(run_cfg, resolve=True)
    return Loaded(model.eval(), run_cfg, model_cfg, ckpt, path, reason)


def _check_moved(given: Mapping) -> None:
    """+model.<key> overrides of segmentation's settings at their place before model.segmentation: say where."""
    from bev.utils.legacy import moved_segmentation_key

    key = moved_segmentation_key(given)
    if key:
        raise ValueError(f"+model.{key} is now +model.segmentation.{key}: pass that instead")


def say_chosen(loaded: Loaded) -> None:
    """Print which checkpoint a run directory given as ckpt_path resolved to, and why (nothing for a file)."""
    if loaded.chosen:
        print(f"checkpoint: {loaded.path} ({loaded.chosen})", flush=True)


def build_data_config(given: DictConfig, run_config: DictConfig, trained_on: Any = None) -> DictConfig:
    """The checkpoint's data settings, overridden by the non-null keys of `given` (a whole data
    config when it has a _target_); grid and image size always come from the checkpoint, and
    inference never augments. The places on disk (data.dataroot, data.cache_dir) never come from the
    checkpoint (load_checkpoint drops them): a data.dataroot the user did not give is refused, naming
    the one the checkpoint was trained on (`trained_on`) as a hint."""
    from bev.utils.checkpoint import without_places

    keys = {k: v for k, v in OmegaConf.to_container(given, resolve=False).items() if v is not None}
    stored = OmegaConf.create(without_places(OmegaConf.to_container(run_config.data, resolve=False)))
    base = given if "_target_" in keys else OmegaConf.merge(stored, keys)
    if base.get("dataroot") is None:
        from bev.data.config import DataConfig, refuse_unknown

        refuse_unknown(
            {k: v for k, v in base.items() if k != "_target_"}, DataConfig
        )  # a typo is the first thing to say
        hint = f" (this checkpoint was trained on {str(trained_on)!r})" if trained_on else ""
        raise ValueError(
            f"data.dataroot is not set: the data folder comes from the command, never from the checkpoint{hint}. "
            f"Pass data.dataroot=<the folder holding <version>/*.json>"
        )
    if "_target_" not in keys:
        _check_stored_names(base, keys)
    return OmegaConf.merge(base, {"grid": run_config.grid, "final_dim": run_config.data.final_dim, "augment": False})


# Data settings that become parts of paths (<dataroot>/<version>/, the index cache's file name): taken from a
# checkpoint, they must be plain names, so that a stored "../x" cannot lead reads or writes elsewhere.
NAME_KEYS = ("version", "train_split", "val_split")


def _check_stored_names(data: DictConfig, given: Mapping[str, Any]) -> None:
    for key in NAME_KEYS:
        value = data.get(key)
        plain = isinstance(value, str) and value not in ("", ".", "..") and not any(c in value for c in "/\\\0")
        if key not in given and value is not None and not plain:
            raise ValueError(
                f"the checkpoint's data.{key} {str(value)[:80]!r} is not a plain name: it would become part of a path "
                f"under data.dataroot and the index cache. Pass data.{key}=<the {key} you mean>"
            )


def trained_on(loaded: Loaded) -> Any:
    """The data.dataroot the checkpoint's run trained on, as stored (for messages only: it decides nothing)."""
    stored = loaded.checkpoint.get("bev_config")
    data = stored.get("data") if isinstance(stored, dict) else None
    return data.get("dataroot") if isinstance(data, dict) else None


def load_model(ckpt_path: str | Path, device: str | torch.device = "cpu", trusted: bool = False):
    """The eval-mode BEVLitModule of a checkpoint this project wrote (a .ckpt, or a run directory).

    Attributes: .net (the bev.models.BEVNet network), .grid, .image_size, .class_names, .run_config.
    A checkpoint whose stored config names code outside the project's configs is refused unless
    trusted=True (bev.utils.trust).
    """
    return load_checkpoint(ckpt_path, trusted=trusted).model.to(device)


def network(model: nn.Module) -> nn.Module:
    """The bev.models.BEVNet of `model`: what load_model returns (its .net) or, from the Python API, the bare
    network itself. The one place that tells the two apart: a bare network has no task modules, so bev.predict
    asks its heads' task classes instead (bev.tasks.task.Task.head_predictions)."""
    from bev.models import BEVNet

    return model if isinstance(model, BEVNet) else model.net


def is_temporal(model: nn.Module) -> bool:
    """Whether `model` (a LightningModule or its network) takes windows of frames (bev.models.temporal)."""
    return network(model).past_frames is not None


def _batched(batch: Mapping[str, Any], temporal: bool = False, cameras: bool = True) -> dict[str, Any]:
    """Check the camera inputs (none for a network without cameras); add the batch dimension to a single sample
    (or window)."""
    needed = {**(CAMERA_INPUTS if cameras else {}), **({"future_egomotion": TEMPORAL_INPUT} if temporal else {})}
    missing = [k for k in needed if k not in batch]
    if missing:
        want = "; ".join(f"{k} {v}" for k, v in needed.items())
        raise KeyError(f"batch lacks {', '.join(missing)}; a batch needs {want}")
    out = dict(batch)
    if cameras and torch.as_tensor(batch["images"]).dim() == (5 if temporal else 4):  # one sample or window
        out.update({k: torch.as_tensor(batch[k]).unsqueeze(0) for k in needed})
    return out


@torch.no_grad()
def predict(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor | dict[str, torch.Tensor]:
    """Per-class probabilities (B, K, X, Y) float32, on the model's device.

    model: what load_model returns (or a bare BEVNet). batch: a dict with the camera
    inputs of CAMERA_INPUTS (extra keys are ignored); a single sample (no batch dimension) works too.
    A temporal model (bev.models.temporal) takes windows (images (B, P+1, N, 3, H, W), the camera
    tensors with the same time axis, and future_egomotion) and returns a dict: "bev" (B, K, X, Y) and
    "segmentation" (B, T, 1, X, Y) probabilities, the heads' "centerness", "offset" and "flow", and
    "instances" (B, T, X, Y) int64: vehicle ids decoded from them, consistent over the T = F + 1 frames
    (bev.tasks.motion.instances.decode_sequence, by the model's instance_decoding).
    A model that detects (model.tasks has detection) returns {"bev": (B, K, X, Y) probabilities,
    "detections": per sample {"boxes" (M, 9) bev.geometry.BOX_FIELDS in the ego frame of the sample's
    LIDAR_TOP, "scores" (M,), "labels" (M,) into bev.classes.DETECTION_CLASSES}}.
    """
    pred = predictions(model, batch)
    return pred["bev"] if list(pred) == ["bev"] else pred  # the maps alone: the tensor, as ever


@torch.no_grad()
def predictions(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    """Every task's predictions of `batch` by key, as predict's dict (never a bare tensor): each task module's
    (bev.lit.BEVLitModule.predict_step) and what it decodes from them (Task.decoded); a bare network's heads give
    what their task classes can without options (Task.head_predictions)."""
    net = network(model)
    temporal, cameras = net.past_frames is not None, net.camera is not None
    batch = _batched(batch, temporal, cameras)
    device = next(model.parameters()).device
    keys = (list(CAMERA_INPUTS) if cameras else []) + (["future_egomotion"] if temporal else [])
    keys += [k for k in ("points", "num_points") if k in batch]  # a LiDAR branch's input (bev.data.lidar)
    inputs = {k: torch.as_tensor(batch[k]).to(device) for k in keys}
    was_training = model.training
    model.eval()
    try:
        if model is net:
            return _head_predictions(net, inputs)
        pred = model.predict_step(inputs, 0)
        for task in model.task_modules.values():
            pred.update(task.decoded(pred))
        return pred
    finally:
        model.train(was_training)


def _head_predictions(net: nn.Module, inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    from bev.tasks import task_classes

    lidar = {"points": inputs["points"], "batch_size": len(inputs["num_points"])} if "points" in inputs else {}
    out = net(*(inputs.get(k) for k in CAMERA_INPUTS), inputs.get("future_egomotion"), **lidar)
    pred = {}
    for task in task_classes(net.tasks):
        pred.update(task.head_predictions(out))
    if not pred:
        raise ValueError(
            f"a bare network with heads {list(net.tasks)} gives no predictions without its task modules' options: "
            "pass what bev.load_model returns"
        )
    return pred


def per_sample(pred: Mapping[str, Any]) -> list[dict[str, Any]]:
    """predictions' dict as one dict per sample, on the CPU (a list's entries are the samples': "detections")."""
    pred = _on_cpu(pred)  # the whole batch at once
    n = len(next(iter(pred.values())))
    return [{k: v[i] for k, v in pred.items()} for i in range(n)]


def _on_cpu(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _on_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_on_cpu(v) for v in x]
    return x.cpu() if torch.is_tensor(x) else x


def ring_rig(num_cameras: int, image_size: tuple[int, int], batch_size: int = 1) -> dict[str, torch.Tensor]:
    """Camera tensors of N cameras 1.5 m up, looking outwards at evenly spaced yaws (camera axes:
    x right, y down, z forward), 90-degree horizontal field of view, no augmentation."""
    H, W = image_size
    K = torch.tensor([[W / 2, 0, W / 2], [0, W / 2, H / 2], [0, 0, 1.0]])
    rots = []
    for i in range(num_cameras):
        yaw = 2 * math.pi * i / num_cameras
        fwd = torch.tensor([math.cos(yaw), math.sin(yaw), 0.0])
        right = torch.tensor([math.sin(yaw), -math.cos(yaw), 0.0])
        rots.append(torch.stack([right, torch.tensor([0, 0, -1.0]), fwd], dim=1))
    B, N = batch_size, num_cameras
    return {
        "intrinsics": K.expand(B, N, 3, 3).clone(),
        "rots": torch.stack(rots).expand(B, N, 3, 3).clone(),
        "trans": torch.tensor([0, 0, 1.5]).expand(B, N, 3).clone(),
        "post_rots": torch.eye(3).expand(B, N, 3, 3).clone(),
        "post_trans": torch.zeros(B, N, 3),
    }


def input_names(net: nn.Module) -> tuple[str, ...]:
    """The inputs `net` (a BEVNet, what load_model returns, or an ExportedMaps) takes when exported, in order:
    CAMERA_INPUTS with a camera branch, then LIDAR_INPUTS with a LiDAR branch."""
    net = getattr(net, "net", net)  # an ExportedMaps' or a LightningModule's network
    has_camera, has_lidar = getattr(net, "camera", True) is not None, getattr(net, "lidar", None) is not None
    return (*(CAMERA_INPUTS if has_camera else ()), *(LIDAR_INPUTS if has_lidar else ()))


def example_inputs(
    net: nn.Module, num_cameras: int = 6, batch_size: int = 1, seed: int = 0, points_per_sample: int = 3000
) -> tuple[torch.Tensor, ...]:
    """Inputs of the right shapes for tracing / exporting / timing `net`, in input_names(net)'s order: random
    images and a ring rig for a camera branch; for a LiDAR branch random_points' cloud and its num_points."""
    names = input_names(net)
    g = torch.Generator().manual_seed(seed)
    inputs: dict[str, torch.Tensor] = {}
    if "images" in names:
        H, W = net.image_size
        cams = ring_rig(num_cameras, (H, W), batch_size)
        inputs = {"images": torch.randn(batch_size, num_cameras, 3, H, W, generator=g), **cams}
    if "points" in names:
        inputs["points"] = random_points(getattr(net, "net", net).grid, batch_size, points_per_sample, g)
        inputs["num_points"] = torch.full((batch_size,), points_per_sample, dtype=torch.int64)
    return tuple(inputs[k] for k in names)


def random_points(grid: Any, batch_size: int, per_sample: int, generator: torch.Generator | None = None):
    """(batch_size * per_sample, 6) rows (batch index, x, y, z, intensity 0-255, time lag 0-0.5 s), sample by
    sample as bev.data.lidar.collate_points orders them, uniform over the grid's box widened by 5% a side (so
    some fall outside it, as real clouds do)."""
    from bev.geometry import Grid

    grid = Grid.from_any(grid)
    lo = torch.tensor([grid.xbound[0], grid.ybound[0], grid.zbound[0]])
    hi = torch.tensor([grid.xbound[1], grid.ybound[1], grid.zbound[1]])
    lo, hi = lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo)
    n = batch_size * per_sample
    b = torch.arange(batch_size).repeat_interleave(per_sample).float()
    xyz = lo + torch.rand(n, 3, generator=generator) * (hi - lo)
    extra = torch.rand(n, 2, generator=generator) * torch.tensor([255.0, 0.5])
    return torch.cat([b[:, None], xyz, extra], 1)


# ------------------------------------------------------------------------------- prediction files


def save_prediction_npz(path: str | Path, arrays: Mapping[str, Any], **meta: Any) -> Path:
    """One sample's arrays (each task's, bev.tasks.task.Task.npz_arrays: a segmenting model's one uint8 (X, Y)
    array per class, p = q / NPZ_SCALE, indexed [x_index, y_index]; a temporal model's "future_segmentation" and
    "future_instances"; a detecting model's "det_boxes", "det_scores", "det_labels") as a compressed .npz, plus
    `meta` under keys starting with "_" and "_scale" (1 / NPZ_SCALE)."""
    import numpy as np

    from bev.utils.io import atomic_open

    arrays = {**arrays, **{f"_{k}": np.asarray(v) for k, v in meta.items()}}
    arrays["_scale"] = np.asarray(1.0 / NPZ_SCALE, dtype=np.float32)
    with atomic_open(path, "wb") as f:
        np.savez_compressed(f, **arrays)
    return Path(path)


def detects(model: nn.Module) -> bool:
    """Whether `model` (what load_model returns, or a bare network) gives 3D boxes: one of the tasks it has
    (model.tasks: a network's are its heads) gives them."""
    from bev.tasks import task_classes

    return any(task.gives_boxes for task in task_classes(model.tasks))


def boxes_option(value: Any) -> str | bool:
    """The `boxes` setting of bev-predict and bev-export checked: "auto", True or False."""
    if isinstance(value, str) and value.lower() == "auto":
        return "auto"
    if isinstance(value, bool):
        return value
    raise ValueError(f"boxes={value!r}: choose auto (3D boxes when the checkpoint has a detection head), true or false")


def overwrite_option(value: Any) -> bool:
    """The `overwrite` setting of bev-export, bev-predict and bev-eval checked: true replaces the command's
    existing output files, false (the default) refuses them."""
    if isinstance(value, bool):
        return value
    raise ValueError(f"overwrite={value!r}: pass overwrite=true to replace existing output files, or false")


def wants_boxes(value: Any, model: nn.Module, path: str | Path) -> bool:
    """Whether to give 3D boxes (`boxes`: auto, true, false) for the checkpoint at `path` rebuilt as `model`;
    boxes=true on a checkpoint without a trained detection head is refused with the way out."""
    value = boxes_option(value)
    if value == "auto":
        return detects(model)
    if value and not detects(model):
        raise ValueError(
            f"boxes=true but the checkpoint {str(path)!r} has no detection head (model.tasks "
            f"{list(model.tasks)}): it gives BEV maps only. Pass boxes=auto or "
            f"boxes=false, or train a detecting model: data.detection=true model.net.heads.detection={{...}} "
            f"model.tasks=[segmentation,detection]"
        )
    return value


def creatable_dir(path: str | Path, what: str = "out") -> Path:
    """`path` if it is a folder, or could be made one, that files can be written to; nothing is created (a command
    makes its output folder only once its inputs are checked: writable_dir)."""
    import os

    path = Path(path).expanduser()
    existing = next(p for p in (path, *path.absolute().parents) if p.exists() or p == p.parent)
    problem = None
    if not existing.is_dir():
        problem = f"{existing} is not a folder"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"{existing} is not writable"
    if problem:
        raise OSError(
            f"{what}={str(path)!r} is not a writable folder ({problem}); pass {what}=<a folder you can write to>."
        )
    return path


def writable_dir(path: str | Path, what: str = "out") -> Path:
    """Create `path` if needed and check a file can be written there; one clear error otherwise."""
    import tempfile

    path = creatable_dir(path, what)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise OSError(
            f"{what}={str(path)!r} is not a writable folder ({type(e).__name__}: {e.strerror or e}); "
            f"pass {what}=<a folder you can write to>."
        ) from None
    return path


def select_samples(data_cfg: DictConfig, split: str | None = None, scene: str | None = None):
    """(dataset, item indices in (scene, time) order, split) for a split, or one scene of it.

    Without `split` a scene is looked up in data.val_split, then data.train_split; an unknown
    scene raises ValueError listing the scenes there are. A temporal dataset's items are windows,
    ordered by their present frames (present_rows).
    """
    import numpy as np
    from hydra.utils import instantiate

    splits = [split] if split else [data_cfg.val_split] + ([data_cfg.train_split] if scene else [])
    known: dict[str, list[str]] = {}
    for s in dict.fromkeys(splits):
        datamodule = instantiate(OmegaConf.merge(data_cfg, {"val_split": s}))
        datamodule.setup("predict")
        ds = datamodule.val_set
        rows = present_rows(ds)
        names, times = ds.index["scene"][rows], ds.index["timestamp"][rows]
        order = np.lexsort((times, names))
        if scene is None:
            return ds, order, s
        chosen = order[names[order] == scene]
        if len(chosen):
            return ds, chosen, s
        known[s] = sorted(set(names.tolist()))
    listed = "; ".join(f"{s}: {', '.join(v)}" for s, v in known.items())
    raise ValueError(
        f"unknown scene {scene!r}. Scenes found ({listed}); pass scene=<one of them> or split=<the split that has it>."
    )


def present_rows(ds):
    """The dataset index row of each item: the sample itself, or a window's present frame."""
    import numpy as np

    if ds.temporal:
        return ds.windows + ds.past_frames
    return np.arange(len(ds.index["sample_token"]))


# ------------------------------------------------------------------------------------------ export
EXPORT_FORMATS = ("onnx", "torch_export")
# The exported model's outputs: each head's maps (bev.tasks.task.Task.exported), in bev.tasks.TASKS order: the BEV
# logits, and with boxes the detection head's maps (decoded in Python by bev.tasks.detection.decode: heatmap logits
# (B, 10, X, Y), regression (B, G, 10, X, Y)).
SEGMENTATION_OUTPUTS = ("logits",)
DETECTION_OUTPUTS = ("logits", "heatmap", "regression")


class ExportedMaps(nn.Module):
    """The network as bev-export writes it: the maps of each of its heads (Task.exported_maps), those that give
    3D boxes only with boxes; one map alone as a bare tensor, else a dict in the order of `output_names`.
    Decoding boxes stays out of the graph. `sources`: the task of each output. It takes the tensors of
    `input_names` positionally: the cameras' (CAMERA_INPUTS), then with a LiDAR branch points and num_points
    (LIDAR_INPUTS; num_points gives the batch size of a LiDAR-only network, the rows' batch index the sample)."""

    def __init__(self, net: nn.Module, boxes: bool = False):
        from bev.tasks import task_classes

        super().__init__()
        heads = task_classes(net.tasks)
        if boxes and not any(t.gives_boxes for t in heads):
            raise ValueError("boxes=True needs a network with a detection head (model.net.heads.detection)")
        self.net, self.boxes = net, bool(boxes)
        self.image_size = net.image_size
        self._heads = [t for t in heads if self.boxes or not t.gives_boxes]
        self.sources = {name: t.name for t in self._heads for name in t.exported}
        self.output_names = tuple(self.sources)
        self.input_names = input_names(self)

    def exportable(self):
        return self.net.exportable()

    def forward(self, *inputs: torch.Tensor):
        if len(inputs) != len(self.input_names):
            raise ValueError(
                f"the exported network takes {len(self.input_names)} inputs ({', '.join(self.input_names)}), "
                f"got {len(inputs)}"
            )
        given = dict(zip(self.input_names, inputs))
        cams = [given.get(k) for k in CAMERA_INPUTS]
        if "points" in given:
            out = self.net(*cams, points=given["points"], batch_size=given["num_points"].shape[0])
        else:
            out = self.net(*cams)
        maps = {}
        for task in self._heads:
            maps.update(task.exported_maps(out))
        return next(iter(maps.values())) if len(maps) == 1 else maps


def export_onnx(
    net: nn.Module, example: tuple[torch.Tensor, ...], path: str | Path, opset: int = 18, overwrite: bool = False
) -> Path:
    """ONNX model of `net` (an ExportedMaps, or a bare network exported as ExportedMaps(net): the inputs of
    input_names -> "logits"; with boxes -> DETECTION_OUTPUTS), batch size (and a LiDAR model's point count M)
    dynamic, written atomically; an existing file at `path` is replaced only with overwrite=True.

    The splat and the pillar pooling go through BEVNet.exportable() (ScatterND with reduction "add", the pillar
    maxima ScatterElements with reduction "max"), and the geometry only uses elementwise ops, so ONNX Runtime runs
    it on any execution provider. Uses torch.onnx.export's dynamo path (needs the onnx and onnxscript packages:
    pip install bev[export]).
    """
    from bev.utils.io import atomic_open, check_output

    if opset < 17:
        raise ValueError(f"opset must be >= 17, got {opset}")
    net = net if isinstance(net, ExportedMaps) else ExportedMaps(net)  # its inputs and outputs named
    names = net.input_names
    if "points" in names and opset < 18:  # the pillar maxima: ScatterElements reduction "max" came in opset 18
        raise ValueError(f"a LiDAR model exports with opset >= 18 (its pillar max is a scatter-max), got {opset}")
    check_output(path, overwrite)  # before the minutes of tracing
    if len(example[names.index("num_points" if "num_points" in names else "images")]) == 1:
        # torch.export specialises size-1 dims: trace with 2 samples to keep the batch dynamic
        example = _two_samples(example, names)
    batch = torch.export.Dim("batch", min=1, max=1024)
    dims = {"points": {0: _points_dim()}}
    with torch.no_grad(), net.exportable():
        program = torch.onnx.export(
            net.eval(),
            example,
            dynamo=True,
            opset_version=int(opset),
            verbose=False,
            input_names=list(names),
            output_names=list(net.output_names),
            # one entry: forward(*inputs) takes them as one tuple
            dynamic_shapes=(tuple(dims.get(k, {0: batch}) for k in names),),
        )
    with atomic_open(path, "wb", overwrite) as f:  # bytes, not onnx.save_model: that reads f.name, an fd number here
        f.write(program.model_proto.SerializeToString())
    return Path(path)


def _points_dim():
    """The exported graph's dynamic point count M (a LiDAR model's "points" rows)."""
    return torch.export.Dim("points", min=0, max=2**31 - 2)


def _two_samples(example: tuple[torch.Tensor, ...], names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """A one-sample example as two copies of it: the second's points numbered as sample 1."""
    out = []
    for name, t in zip(names, example):
        if name == "points":
            second = t.clone()
            second[:, 0] += 1
            t = torch.cat([t, second])
        else:
            t = torch.cat([t, t])
        out.append(t)
    return tuple(out)


def onnx_outputs(
    path: str | Path, inputs: tuple[torch.Tensor, ...] | Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Every named output of an exported ONNX model ("logits", and a detecting model's "heatmap" and
    "regression") under ONNX Runtime on the CPU. `inputs`: the tensors in the model's input order (input_names:
    the cameras', then a LiDAR model's points and num_points), or a mapping of them by name."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    wanted = [i.name for i in session.get_inputs()]
    if not isinstance(inputs, Mapping):
        if len(inputs) != len(wanted):
            raise ValueError(f"{path} takes {len(wanted)} inputs ({', '.join(wanted)}), got {len(inputs)} tensors")
        inputs = dict(zip(wanted, inputs))
    missing = [k for k in wanted if k not in inputs]
    if missing:
        raise KeyError(f"{path} takes inputs {', '.join(wanted)}; missing {', '.join(missing)}")
    names = [o.name for o in session.get_outputs()]
    got = session.run(names, {k: torch.as_tensor(inputs[k]).numpy() for k in wanted})
    return {n: torch.from_numpy(v) for n, v in zip(names, got)}


def export_program(net: nn.Module, example: tuple[torch.Tensor, ...], path: str | Path, overwrite: bool = False):
    """torch.export ExportedProgram of `net` (an ExportedMaps, or a bare network exported as ExportedMaps(net))
    saved as .pt2 (atomically; an existing file at `path` is replaced only with overwrite=True); returns the program.

    Shapes are those of `example` (bev.ops takes the grid shape as plain ints, so the batch size
    is fixed). The voxel pooling stays one torch.ops.bev.bev_pool node when the native build is
    loaded; `import bev.ops` registers it before torch.export.load in another process. A LiDAR branch pools its
    pillars with plain scatters (LidarEncoder.exportable), so its point count M stays dynamic.
    """
    import contextlib

    from bev.utils.io import atomic_open, check_output

    net = net if isinstance(net, ExportedMaps) else ExportedMaps(net)
    check_output(path, overwrite)  # before the tracing
    lidar = getattr(net.net, "lidar", None)
    dynamic = None
    if lidar is not None:  # one entry: forward(*inputs) takes them as one tuple
        dynamic = (tuple({0: _points_dim()} if k == "points" else None for k in net.input_names),)
    with torch.no_grad(), lidar.exportable() if lidar is not None else contextlib.nullcontext():
        program = torch.export.export(net.eval(), example, dynamic_shapes=dynamic)
    with atomic_open(path, "wb", overwrite) as f:
        torch.export.save(program, f)
    return program
