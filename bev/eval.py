"""`bev-eval ckpt_path=PATH data.dataroot=DIR [data.*=...]`: evaluate a checkpoint on the val split.

Rebuilds the model, grid and data settings from the config bev-train stored in the checkpoint
(bev.inference.load_checkpoint, the loader bev-predict and bev-export use too),
runs the deterministic validation transform (no augmentation, the fixed LSS crop), prints the
IoU table (overall, visibility-filtered, distance bands), and writes <run>/metrics.json and
PNGs of a few samples.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

import bev.data  # noqa: F401 (registers the data/ config schemas: bev.data.config)
from bev.utils.config import CONFIG_DIR, check_flags
from bev.utils.errors import report_errors
from bev.utils.io import atomic_write


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Evaluate cfg.ckpt_path on the val split: print the IoU table, write metrics.json and PNGs; returns the record."""
    from hydra.utils import instantiate

    from bev.data.temporal import WindowTooLongError
    from bev.inference import build_data_config, load_checkpoint, overwrite_option, say_chosen, trained_on

    if OmegaConf.is_missing(cfg, "ckpt_path"):
        raise ValueError(
            "no checkpoint given: bev-eval ckpt_path=<a .ckpt file, or a run directory for its best checkpoint>"
        )
    check_flags(cfg, ("rayiou", "trust_checkpoint"))  # "maybe" is not read as true
    out = _checked_output_dir(cfg)
    loaded = load_checkpoint(
        cfg.ckpt_path, cfg.get("model"), cfg.grid, cfg.data, trusted=bool(cfg.get("trust_checkpoint"))
    )
    say_chosen(loaded)
    tasks = list(loaded.model.task_modules.values())
    overwrite = overwrite_option(cfg.get("overwrite", False))
    for task in tasks:  # before the data is read and the model runs
        task.check_eval_folders(out, overwrite)
    with open_dict(cfg):
        cfg.grid = loaded.run_config.grid
    data_cfg = build_data_config(cfg.data, loaded.run_config, trained_on(loaded))
    datamodule = instantiate(data_cfg)
    out.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        task.before_test(out)
    loaded.model.output_dir = str(out)  # where each task writes its files of the test
    try:
        metrics = _test_metrics(cfg, loaded, data_cfg, datamodule)
    except WindowTooLongError as e:  # the checkpoint fixes the window: its data cannot be shortened here
        raise ValueError(
            f"{e.window}. This checkpoint's temporal model takes exactly that window: evaluate it on scenes at least "
            f"that long (data.dataroot / data.version / data.val_split)"
        ) from None
    record = _eval_record(loaded, data_cfg, metrics)
    options = {"rayiou": cfg.get("rayiou", True), "accelerator": str(cfg.accelerator)}
    for task in tasks:
        task.after_test(record, out, datamodule.val_set.index, data_cfg.dataroot, options)
    atomic_write(out / "metrics.json", json.dumps(record, indent=2))
    pngs = save_pngs(loaded.model, datamodule, out, int(cfg.num_pngs))
    _print_report(loaded, data_cfg, record, out, len(pngs))
    return record


def output_files(out: Path, num_pngs: int) -> list[Path]:
    """The files bev-eval writes in its output folder: metrics.json, those every task may write (checked before the
    checkpoint says which tasks it has: a detecting model's results and devkit summary), and the sample PNGs."""
    from bev.tasks import task_classes

    files = [out / "metrics.json", *(path for task in task_classes() for path in task.eval_files(out))]
    return files + [out / f"sample_{i:03d}.png" for i in range(max(num_pngs, 0))]


def _checked_output_dir(cfg: DictConfig) -> Path:
    """The output folder (hydra.run.dir), once nothing there would be replaced that must not be: never a link,
    a device or a folder, and files of an earlier evaluation only with overwrite=true."""
    from bev.inference import overwrite_option
    from bev.utils.io import check_output, inside

    out, overwrite = Path(cfg.paths.output_dir), overwrite_option(cfg.get("overwrite", False))
    files = output_files(out, int(cfg.num_pngs))
    for path in files:
        check_output(inside(out, path))
    existing = [p for p in files if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(
            f"the output folder {str(out)!r} already holds {', '.join(p.name for p in existing[:3])}"
            f"{' ...' if len(existing) > 3 else ''} of an earlier evaluation: pass overwrite=true to replace them, "
            f"or another folder (hydra.run.dir=...)"
        )
    return out


def _test_metrics(cfg: DictConfig, loaded, data_cfg: DictConfig, datamodule) -> dict[str, float]:
    """One trainer.test pass of the model over the data; returns its metrics without the "test/" prefix."""
    import lightning as L

    from bev.callbacks.threads import threads_following_load

    precision = cfg.get("precision") or OmegaConf.select(loaded.run_config, "trainer.precision", default="32-true")
    threads, accelerator = cfg.get("threads"), str(cfg.accelerator)
    # On a busy machine threads: auto gives way to the other processes.
    with threads_following_load(threads, data_cfg.get("num_workers", 0), accelerator) as follow:
        trainer = L.Trainer(
            accelerator=cfg.accelerator,
            devices=1,
            precision=precision,
            logger=False,
            callbacks=follow,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=False,
        )
        trainer.test(loaded.model, datamodule=datamodule, verbose=False)
    return {k.removeprefix("test/"): float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")}


def _eval_record(loaded, data_cfg: DictConfig, metrics: dict[str, float]) -> dict[str, Any]:
    """The metrics.json record: what was evaluated, how each task's metrics are defined, and the metrics."""
    from bev.utils.checkpoint import logged_val_iou

    ckpt, model = loaded.checkpoint, loaded.model
    record = {
        "checkpoint": str(loaded.path),
        "epoch": ckpt.get("epoch"),
        "global_step": ckpt.get("global_step"),
        "tasks": list(model.tasks),
        "data": OmegaConf.to_container(
            OmegaConf.masked_copy(data_cfg, ["dataroot", "version", "val_split", "final_dim"]), resolve=True
        ),
        "grid": OmegaConf.to_container(loaded.run_config.grid),
    }
    for task in model.task_modules.values():
        record.update(task.record())
    return {**record, "metrics": metrics, "logged_val_iou": logged_val_iou(ckpt)}


def _print_report(loaded, data_cfg: DictConfig, record: dict[str, Any], out: Path, num_pngs: int) -> None:
    """What was evaluated, each task's report, and where the files are."""
    ckpt = loaded.checkpoint
    print(
        f"Checkpoint {loaded.path} (epoch {ckpt.get('epoch')}, step {ckpt.get('global_step')}) on "
        f"{data_cfg.dataroot} {data_cfg.version}/{data_cfg.val_split}:"
    )
    for task in loaded.model.task_modules.values():
        print(task.report(record, out))
    print(f"Metrics: {out / 'metrics.json'}  Pictures: {num_pngs} PNGs in {out}")


def save_pngs(model, datamodule, out: Path, n: int) -> list[Path]:
    """Cameras + prediction vs target for the first n validation samples, each drawn with its model's tasks'
    layers (bev.viz.sample_picture: a temporal model's windows with the vehicles' instances and future paths; a
    detecting model's 3D boxes over the ground truth, in the BEV and the cameras; an occupancy model's views)."""
    from bev.inference import per_sample, predictions
    from bev.viz import sample_picture, save_picture

    tasks = list(model.task_modules.values())
    options = {"class_names": model.class_names, "n_objects": len(model.object_classes)}  # no box_threshold: viz's
    paths: list[Path] = []
    for batch in datamodule.test_dataloader() if n > 0 else ():
        for i, item in enumerate(per_sample(predictions(model, batch))):
            if len(paths) >= n:
                return paths
            layers: dict[str, Any] = {}
            for task in tasks:
                layers.update(task.picture_layers(item, options))
            path = out / f"sample_{len(paths):03d}.png"
            save_picture(path, sample_picture(batch, i, layers, None, options["class_names"], options["n_objects"]))
            paths.append(path)
    return paths


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="eval")
@report_errors("bev-eval")
def _hydra_main(cfg: DictConfig) -> None:
    evaluate(cfg)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
