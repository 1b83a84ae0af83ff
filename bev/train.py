"""`bev-train [overrides]` (or `python -m bev.train`): train a BEV model from the Hydra configs.

Thin entry point in the lightning-hydra-template style: compose configs/train.yaml, instantiate
data, model, callbacks, loggers and trainer, fit (resuming from `ckpt_path` when given), and
write <run>/metrics.json (read by the sweep summary). `bev-train -m a=1,2` sweeps.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import hydra
from omegaconf import DictConfig, OmegaConf

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


# ----------------------------------------------------------------------------- process set-up
MALLOC_ENV = {
    # glibc returns freed blocks to the OS (munmap / heap trim) on every large free, so each step
    # page-faults its activations back in; keeping them mapped removes that kernel time on CPU.
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 34),
    "MALLOC_TOP_PAD_": str(1 << 28),
}


def tune_malloc(module: str) -> None:
    """Re-exec the interpreter once with MALLOC_ENV set (glibc reads it only at start-up).

    Set BEV_MALLOC_TUNING=0 to skip. Variables the user set already are kept.
    """
    if not sys.platform.startswith("linux") or os.environ.get("BEV_MALLOC_TUNING", "1") == "0":
        return
    if all(k in os.environ for k in MALLOC_ENV):
        return
    env = {**MALLOC_ENV, **os.environ}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)


# ----------------------------------------------------------------------------- errors
def _one_line(e: BaseException) -> str:
    msg = str(e).strip()
    # Hydra wraps errors raised while instantiating; the cause carries the useful message.
    cause = e.__cause__ or e.__context__
    if type(e).__name__ == "InstantiationException" and cause is not None:
        return f"{msg.splitlines()[0] if msg else ''} {_one_line(cause)}".strip()
    if "Traceback (most recent call last)" in msg:  # errors re-raised from worker processes
        msg = msg.strip().splitlines()[-1]
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def report_errors(prog: str) -> Callable:
    """Turn an exception in a task into one short paragraph on stderr and exit status 1.

    The full traceback goes to <run>/error.txt; HYDRA_FULL_ERROR=1 re-raises instead. In a sweep
    a failed run is recorded (metrics.json status) and the sweep goes on.
    """

    def wrap(task: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
        @functools.wraps(task)
        def run(cfg: DictConfig) -> Any:
            try:
                return task(cfg)
            except KeyboardInterrupt:
                raise
            except Exception as e:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                where = ""
                out = _output_dir(cfg)
                if out is not None:
                    out.mkdir(parents=True, exist_ok=True)
                    (out / "error.txt").write_text(traceback.format_exc())
                    where = f" (traceback in {out / 'error.txt'})"
                print(f"{prog}: error: {_one_line(e)}{where}", file=sys.stderr, flush=True)
                if _is_multirun():
                    if out is not None:
                        _write_run_metrics(out, {"status": f"failed: {_one_line(e)[:300]}", "metrics": {}, "overrides": _task_overrides()})
                    return float("nan")
                sys.exit(1)

        return run

    return wrap


def _output_dir(cfg: DictConfig) -> Path | None:
    try:
        return Path(cfg.paths.output_dir)
    except Exception:
        return None


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _task_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _write_run_metrics(out: Path, record: dict) -> None:
    tmp = out / f".{os.getpid()}.metrics.json.tmp"
    tmp.write_text(json.dumps(record, indent=2, default=str))
    os.replace(tmp, out / "metrics.json")


# ----------------------------------------------------------------------------- training
def instantiate_list(node: DictConfig | None) -> list:
    """Instantiate every entry of a config group dict that has a _target_ (null entries switch one off)."""
    from hydra.utils import instantiate

    if not node:
        return []
    return [instantiate(c) for c in node.values() if c is not None and "_target_" in c]


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit the model described by `cfg`; returns the final metrics (val/iou, val/iou_best, ...)."""
    import lightning as L
    import torch
    from hydra.utils import instantiate

    from bev.callbacks import AtomicCheckpointIO
    from bev.lit import check_compatible, read_checkpoint

    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    if cfg.get("float32_matmul_precision"):
        torch.set_float32_matmul_precision(cfg.float32_matmul_precision)
    out = Path(cfg.paths.output_dir)

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
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    wall = time.time() - start

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    metrics["val/iou_best"] = float(model.val_iou_best)
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    if trainer.is_global_zero:
        _write_run_metrics(out, {
            "status": "ok",
            "metrics": metrics,
            "best_ckpt": best,
            "global_step": trainer.global_step,
            "epochs": trainer.current_epoch,
            "fit_wall_s": round(wall, 1),
            "overrides": _task_overrides(),
        })
        print(f"Training done in {wall / 60:.1f} min, {trainer.global_step} steps: val/iou_best={metrics['val/iou_best']:.4f}. "
              f"Best checkpoint: {best or '(none)'}; run dir: {out}")
    return metrics


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
@report_errors("bev-train")
def _hydra_main(cfg: DictConfig) -> float | None:
    metrics = train(cfg)
    key = cfg.get("optimized_metric")
    return metrics.get(key) if key else None


def main() -> None:
    tune_malloc("bev.train")
    _hydra_main()


if __name__ == "__main__":
    main()
