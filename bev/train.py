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

from bev.utils.config import CONFIG_DIR, instantiate_list, task_overrides
from bev.utils.errors import report_errors
from bev.utils.io import write_run_metrics
from bev.utils.malloc import tune_malloc_in_process


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit the model described by `cfg`; returns the final metrics (val/iou, val/iou_best, ...)."""
    import lightning as L
    import torch
    from hydra.utils import instantiate
    from lightning.pytorch.utilities import rank_zero_only

    from bev.callbacks import AtomicCheckpointIO, ThreadsFollowLoad, TimeBudget
    from bev.utils.checkpoint import check_compatible, read_checkpoint
    from bev.utils.precision import resolve_precision
    from bev.utils.threads import intra_op_threads

    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    if cfg.get("float32_matmul_precision"):
        torch.set_float32_matmul_precision(cfg.float32_matmul_precision)
    out = Path(cfg.paths.output_dir)
    if str(cfg.trainer.get("precision")) == "auto":  # resolved before the config is stored in checkpoints
        precision, reason = resolve_precision("auto", cfg.trainer.get("accelerator", "auto"))
        cfg.trainer.precision = precision
        if rank_zero_only.rank == 0:
            print(f"precision: {precision} ({reason})", flush=True)

    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    model.run_config = OmegaConf.to_container(cfg, resolve=True)
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path:  # check before Lightning does, for a clear message instead of a state_dict dump
        ckpt = read_checkpoint(ckpt_path)
        check_compatible(model, ckpt, ckpt_path, model.run_config["model"])
        del ckpt
    trainer = instantiate(
        cfg.trainer,
        callbacks=instantiate_list(cfg.get("callbacks")),
        logger=instantiate_list(cfg.get("logger")) or False,
        plugins=[AtomicCheckpointIO()],
    )
    start = time.time()
    threads = (cfg.get("threads"), cfg.data.get("num_workers", 0), str(cfg.trainer.get("accelerator", "cpu")),
               cfg.trainer.get("devices", 1))
    with intra_op_threads(*threads) as n:
        trainer.callbacks.extend(ThreadsFollowLoad.when_auto(n, threads[0], *threads[2:]))
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    wall = time.time() - start

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    metrics["val/iou_best"] = float(model.val_iou_best)
    budget = next((c.summary() for c in trainer.callbacks if isinstance(c, TimeBudget)), None)
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    if trainer.is_global_zero:
        write_run_metrics(out, {
            "status": "ok",
            "metrics": metrics,
            "best_ckpt": best,
            "global_step": trainer.global_step,
            "epochs": trainer.current_epoch,
            "fit_wall_s": round(wall, 1),
            "precision": str(cfg.trainer.get("precision")),
            **({"time_budget": budget} if budget else {}),
            "overrides": task_overrides(),
        })
        print(f"Training done in {wall / 60:.1f} min, {trainer.global_step} steps: val/iou_best={metrics['val/iou_best']:.4f}. "
              f"Best checkpoint: {best or '(none)'}; run dir: {out}")
        if budget and budget["message"]:
            print(budget["message"])
    return metrics


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
@report_errors("bev-train")
def _hydra_main(cfg: DictConfig) -> float | None:
    metrics = train(cfg)
    key = cfg.get("optimized_metric")
    return metrics.get(key) if key else None


def main() -> None:
    tune_malloc_in_process()  # CPU steps: keep freed activations mapped (see bev.utils.malloc)
    _hydra_main()


if __name__ == "__main__":
    main()
