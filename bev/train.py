"""`bev-train [overrides]` (or `python -m bev.train`): train a BEV model from the Hydra configs.

Thin entry point in the lightning-hydra-template style: compose configs/train.yaml, instantiate
data, model, callbacks, loggers and trainer, fit (resuming from `ckpt_path` when given), and
write <run>/metrics.json (read by the sweep summary). `bev-train -m a=1,2` sweeps.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

import bev.data  # noqa: F401 (registers the data/ config schemas: bev.data.config)
from bev.config_checks import check_settings
from bev.utils.config import (
    CONFIG_DIR,
    check_optimizer,
    instantiate_list,
    resolve_depth_stride,
    task_overrides,
)
from bev.utils.errors import report_errors
from bev.utils.io import remove_stale_temporaries, run_dir_lock, write_run_metrics
from bev.utils.malloc import tune_malloc_in_process


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit the model described by `cfg`; returns the final metrics (val/iou, ..., <headline>_best). The run
    directory is locked meanwhile: a second bev-train into it is refused."""
    from lightning.pytorch.utilities import rank_zero_only

    if rank_zero_only.rank != 0:  # other processes of a multi-process run share rank 0's directory
        return _train(cfg)
    with run_dir_lock(cfg.paths.output_dir):
        return _train(cfg)


def _train(cfg: DictConfig) -> dict[str, Any]:
    from hydra.utils import instantiate

    from bev.utils.checkpoint import warn_of_an_earlier_run

    check_optimizer(cfg)  # a refused setting named now, not after the data is indexed
    check_settings(cfg)  # likewise model.* and the training data settings
    resolve_depth_stride(cfg)
    if not cfg.get("ckpt_path"):
        warn_of_an_earlier_run(cfg.paths.output_dir)  # a forgotten ckpt_path: its checkpoints go beside the old
    if cfg.get("malloc_tuning"):
        tune_malloc_in_process()  # before the model and data allocate: keep freed activations mapped
    _seed_and_matmul_precision(cfg)
    _resolve_auto_accelerator(cfg)
    _resolve_auto_precision(cfg)
    if Path(cfg.paths.output_dir).is_dir():  # files of a killed earlier session (metrics.json, ...)
        remove_stale_temporaries(cfg.paths.output_dir)
    _check_grid_fits_memory(cfg)
    datamodule = instantiate(cfg.data)
    _check_data_fits(cfg, datamodule)
    model = _build_model(cfg)
    ckpt_path = cfg.get("ckpt_path")
    _check_resume_checkpoint(model, ckpt_path)
    trainer = _build_trainer(cfg)
    wall = _fit(cfg, trainer, model, datamodule, ckpt_path)
    metrics = _final_metrics(trainer, model)
    _finish(cfg, trainer, metrics, Path(cfg.paths.output_dir), wall)
    return metrics


def _seed_and_matmul_precision(cfg: DictConfig) -> None:
    """Seed every RNG (loader workers included) and set torch's float32 matmul precision, where configured."""
    import lightning as L
    import torch

    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    if cfg.get("float32_matmul_precision"):
        torch.set_float32_matmul_precision(cfg.float32_matmul_precision)


def _resolve_auto_accelerator(cfg: DictConfig) -> None:
    """Replace `trainer.accelerator: auto` (trainer=auto) by the device found: gpu when CUDA sees one, else
    cpu; said once, and stored so that the precision, thread and memory checks see the device."""
    import torch
    from lightning.pytorch.utilities import rank_zero_only

    if str(cfg.trainer.get("accelerator")) != "auto":
        return
    gpu = torch.cuda.is_available()
    cfg.trainer.accelerator = "gpu" if gpu else "cpu"
    if rank_zero_only.rank == 0:
        where = torch.cuda.get_device_name() if gpu else "no CUDA device visible"
        print(f"trainer.accelerator: {cfg.trainer.accelerator} ({where})", flush=True)


def _resolve_auto_precision(cfg: DictConfig) -> None:
    """Replace `trainer.precision: auto` by what this hardware gets (bev.utils.precision), and say why."""
    from lightning.pytorch.utilities import rank_zero_only

    from bev.utils.precision import resolve_precision

    if str(cfg.trainer.get("precision")) == "auto":  # resolved before the config is stored in checkpoints
        precision, reason = resolve_precision("auto", cfg.trainer.get("accelerator", "auto"))
        cfg.trainer.precision = precision
        if rank_zero_only.rank == 0:
            print(f"precision: {precision} ({reason})", flush=True)


# The BEV encoder keeps several tensors the size of the splat's output for its backward pass.
BEV_COPIES = 4


def _check_grid_fits_memory(cfg: DictConfig) -> None:
    """Before any target or feature map is allocated: one batch's splatted BEV features (B x frames x
    channels x Z x X x Y, fp32, BEV_COPIES of them) must fit the memory of the training device."""
    from bev.geometry import Grid
    from bev.utils.precision import available_memory

    if "grid" not in cfg:
        return
    grid = Grid.from_any(cfg.grid)
    batch = int(cfg.data.get("batch_size") or 1)
    frames = 1 + int(cfg.data.get("past_frames") or 0)
    channels = int(OmegaConf.select(cfg, "model.net.camera.context_channels", default=64) or 64)
    need = 4 * BEV_COPIES * batch * frames * channels * grid.nz * grid.nx * grid.ny
    have = available_memory(str(cfg.trainer.get("accelerator", "cpu")))
    if have is not None and need > have:
        raise ValueError(
            f"the BEV grid of {grid.nx} x {grid.ny} x {grid.nz} cells (grid.xbound {list(grid.xbound)}, grid.ybound "
            f"{list(grid.ybound)}, grid.zbound {list(grid.zbound)}) needs about {need / 2**30:.1f} GiB for one batch's "
            f"BEV features ({batch} samples x {frames} frame(s) x {channels} channels, with the backward's copies), "
            f"more than the {have / 2**30:.1f} GiB available: use larger steps or smaller ranges in grid.xbound / "
            "grid.ybound, or a smaller data.batch_size"
        )


def _check_data_fits(cfg: DictConfig, datamodule) -> None:
    """Before any training process starts: every process gets a batch and a validation sample, and the depth bins
    reach the grid."""
    if not hasattr(datamodule, "train_set"):  # another data module: nothing known to check
        return
    datamodule.setup("fit")  # idempotent: Lightning's own setup reuses the datasets
    _check_batches_per_process(cfg.trainer, len(datamodule.train_set), datamodule.batch_size, datamodule.train_split)
    _check_val_samples_per_process(cfg.trainer, len(datamodule.val_set), datamodule.val_split)
    if len(datamodule.val_set) and getattr(datamodule.val_set, "cameras", True):
        _check_depth_reach(datamodule.grid, datamodule.val_set[0], datamodule.val_split)


def _processes(trainer_cfg: DictConfig) -> tuple[int, int] | None:
    """(processes per node, nodes) of trainer.devices and trainer.num_nodes; None where Lightning counts them."""
    from omegaconf import ListConfig

    devices, nodes = trainer_cfg.get("devices", 1), int(trainer_cfg.get("num_nodes", 1) or 1)
    if isinstance(devices, (list, ListConfig)):
        return len(devices), nodes
    if str(devices).isdigit():
        return int(devices), nodes
    return None  # auto, -1


def _check_batches_per_process(trainer_cfg: DictConfig, samples: int, batch_size: int, split: str) -> None:
    """Refuse a world size that leaves each process less than one full batch (nothing to train: total_steps 0)."""
    import math

    counted = _processes(trainer_cfg)
    if counted is None:
        return
    per_node, nodes = counted
    _warn_processes_over_cores(trainer_cfg, per_node)
    world = per_node * nodes
    each = math.ceil(samples / max(world, 1))
    if samples >= batch_size > each:  # the loader drops the last partial batch
        raise ValueError(
            f"trainer.devices={trainer_cfg.get('devices')} x trainer.num_nodes={nodes} = {world} training processes "
            f"share the {samples} samples of {split!r}: {each} each, less than data.batch_size={batch_size}, so no "
            f"process gets a full batch and there is nothing to train. Use fewer processes (trainer.devices=1 on a "
            f"CPU) or a smaller data.batch_size."
        )


def _check_val_samples_per_process(trainer_cfg: DictConfig, samples: int, split: str) -> None:
    """Refuse more processes than validation samples when validation runs. Each sample is validated on exactly one
    process (no padding: a repeated sample would count twice), so a process would get none, skip the validation
    loop and leave the others waiting in the gathering of the split's scores (devkit, IoU, mIoU)."""
    counted = _processes(trainer_cfg)
    limit = trainer_cfg.get("limit_val_batches")
    if counted is None or samples == 0 or (limit is not None and float(limit) == 0):
        return
    per_node, nodes = counted
    world = per_node * nodes
    if samples < world:
        raise ValueError(
            f"trainer.devices={trainer_cfg.get('devices')} x trainer.num_nodes={nodes} = {world} processes share the "
            f"{samples} validation sample(s) of {split!r}: each sample is validated on one process, so {world - samples} "
            f"would validate none and the others would wait for it. Use at most {samples} process(es) in all "
            f"(trainer.devices x trainer.num_nodes), or a validation split of at least {world} samples (data.val_split)."
        )


def _warn_processes_over_cores(trainer_cfg: DictConfig, per_node: int) -> None:
    """CPU training processes beyond this machine's cores wait on each other: say so, with the fix."""
    import warnings

    from bev.utils.threads import available_cpus

    cores = available_cpus()
    if str(trainer_cfg.get("accelerator", "cpu")) == "cpu" and per_node > cores:
        warnings.warn(
            f"trainer.devices={per_node} starts {per_node} CPU training processes on {cores} core(s): they share the "
            f"cores and train slower than one; use trainer.devices={cores} or fewer",
            stacklevel=2,
        )


def _check_depth_reach(grid, sample: dict, split: str) -> None:
    """Refuse depth bins that put no camera feature inside the grid; warn about bins that never do."""
    import warnings

    from bev.geometry import CAMERA_GEOMETRY, depth_bins_in_grid

    n = sample["rots"].shape[-3]
    # One batch of every camera (and frame, for temporal windows): (1, M, 3, 3) matrices, (1, M, 3) vectors.
    cams = [sample[k].reshape(1, -1, *sample[k].shape[-1 if k.endswith("trans") else -2 :]) for k in CAMERA_GEOMETRY]
    reach = depth_bins_in_grid(grid, tuple(sample["images"].shape[-2:]), *cams)
    depths = grid.depths()[: len(reach)]
    where = (
        f"grid.dbound {list(grid.dbound)} with xbound {list(grid.xbound)}, ybound {list(grid.ybound)}, zbound "
        f"{list(grid.zbound)} (the {n} cameras of the first {split!r} sample)"
    )
    if not reach.any():
        raise ValueError(
            f"no depth bin puts a camera feature inside the BEV grid: {where}. The model would see nothing; "
            f"choose dbound within the grid's reach or widen the grid."
        )
    if not reach.all():
        lost, step = depths[~reach], grid.dbound[2]
        warnings.warn(
            f"{len(lost)} of {len(reach)} depth bins ({float(lost.min()):g}-{float(lost.max()) + step:g} m) put no "
            f"camera feature inside the BEV grid: {where}. They cost compute and learn nothing; trim dbound.",
            stacklevel=2,
        )


def _build_model(cfg: DictConfig):
    """The LightningModule of cfg.model, carrying the resolved run config that its checkpoints store."""
    from hydra.utils import instantiate

    model = instantiate(cfg.model)
    model.run_config = OmegaConf.to_container(cfg, resolve=True)
    return model


def _check_resume_checkpoint(model, ckpt_path: str | None) -> None:
    """Check that the checkpoint to resume from fits the model (nothing to check without one)."""
    from bev.utils.checkpoint import check_compatible, read_checkpoint

    if ckpt_path:  # check before Lightning does, for a clear message instead of a state_dict dump
        ckpt = read_checkpoint(ckpt_path)
        check_compatible(model, ckpt, ckpt_path, model.run_config["model"])


def _build_trainer(cfg: DictConfig):
    """The Trainer of cfg.trainer with the configured callbacks and loggers, saving checkpoints atomically."""
    from hydra.utils import instantiate

    from bev.callbacks import AtomicCheckpointIO

    return instantiate(
        cfg.trainer,
        callbacks=instantiate_list(cfg.get("callbacks")),
        logger=instantiate_list(cfg.get("logger")) or False,
        plugins=[AtomicCheckpointIO()],
    )


def _fit(cfg: DictConfig, trainer, model, datamodule, ckpt_path: str | None) -> float:
    """trainer.fit under the configured intra-op threads (bev.utils.threads); returns its wall time in seconds."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from bev.callbacks.checkpoint import interrupted
    from bev.callbacks.threads import threads_following_load

    start = time.time()
    with threads_following_load(
        cfg.get("threads"),
        cfg.data.get("num_workers", 0),
        str(cfg.trainer.get("accelerator", "cpu")),
        cfg.trainer.get("devices", 1),
    ) as follow:
        trainer.callbacks.extend(follow)
        try:
            trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
        except SIGTERMException:  # SIGTERM or a Ctrl-C: stopped after a finished step, saved in last.ckpt
            raise interrupted(trainer) from None
    return time.time() - start


def _final_metrics(trainer, model) -> dict[str, float]:
    """The scalar metrics logged last, and the best of the run's headline metric (<headline>_best)."""
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    metrics[f"{model.headline}_best"] = float(model.val_headline_best)
    return metrics


def _finish(cfg: DictConfig, trainer, metrics: dict[str, float], out: Path, wall: float) -> None:
    """On global rank 0: write <out>/metrics.json and print the outcome (and the time budget's message)."""
    from bev.callbacks import TimeBudget

    budget = next((c.summary() for c in trainer.callbacks if isinstance(c, TimeBudget)), None)
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    if not trainer.is_global_zero:
        return
    write_run_metrics(out, _run_record(cfg, trainer, metrics, wall, budget, best))
    judged = f"{cfg.get('headline', 'val/iou')}_best"
    print(
        f"Training done in {wall / 60:.1f} min, {trainer.global_step} steps: {judged}={metrics.get(judged, float('nan')):.4f}. "
        f"Best checkpoint: {best or '(none)'}; run dir: {out}"
    )
    if budget and budget["message"]:
        print(budget["message"])


def _run_record(
    cfg: DictConfig, trainer, metrics: dict[str, float], wall: float, budget: dict | None, best: str
) -> dict[str, Any]:
    """The metrics.json record of a finished run (read by the sweep summary)."""
    return {
        "status": "ok",
        "metrics": metrics,
        "best_ckpt": best,
        "global_step": trainer.global_step,
        "epochs": trainer.current_epoch,
        "fit_wall_s": round(wall, 1),
        "precision": str(cfg.trainer.get("precision")),
        **({"time_budget": budget} if budget else {}),
        "overrides": task_overrides(),
    }


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
@report_errors("bev-train")
def _hydra_main(cfg: DictConfig) -> float | None:
    metrics = train(cfg)
    key = cfg.get("optimized_metric")
    return metrics.get(key) if key else None


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
