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
from bev.tasks.occupancy.io import PREDICTIONS_DIR
from bev.utils.config import CONFIG_DIR, check_flags
from bev.utils.errors import report_errors
from bev.utils.io import atomic_write


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Evaluate cfg.ckpt_path on the val split: print the IoU table, write metrics.json and PNGs; returns the record."""
    from hydra.utils import instantiate

    from bev.data.temporal import WindowTooLongError
    from bev.inference import build_data_config, load_checkpoint, say_chosen, trained_on

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
    occupancy = loaded.model.tasks == ("occupancy",)
    _check_output_folders(cfg, out, loaded.model, occupancy)  # before the data is read and the model runs
    with open_dict(cfg):
        cfg.grid = loaded.run_config.grid
    data_cfg = build_data_config(cfg.data, loaded.run_config, trained_on(loaded))
    datamodule = instantiate(data_cfg)
    out.mkdir(parents=True, exist_ok=True)
    if occupancy:
        return _evaluate_occupancy(cfg, loaded, data_cfg, datamodule, out)
    loaded.model.output_dir = str(out)  # results_nusc.json and the devkit's summary, if it detects
    try:
        metrics = _test_metrics(cfg, loaded, data_cfg, datamodule)
    except WindowTooLongError as e:  # the checkpoint fixes the window: its data cannot be shortened here
        raise ValueError(
            f"{e.window}. This checkpoint's temporal model takes exactly that window: evaluate it on scenes at least "
            f"that long (data.dataroot / data.version / data.val_split)"
        ) from None

    record = _eval_record(loaded, data_cfg, metrics)
    atomic_write(out / "metrics.json", json.dumps(record, indent=2))
    pngs = save_pngs(loaded.model, datamodule, out, int(cfg.num_pngs))
    _print_report(loaded, data_cfg, record, out, len(pngs))
    return record


def _evaluate_occupancy(cfg: DictConfig, loaded, data_cfg: DictConfig, datamodule, out: Path) -> dict[str, Any]:
    """An occupancy checkpoint: Occ3D's mIoU (per class, mean over 0-16, per distance band) and, unless rayiou=false,
    SparseOcc's RayIoU at 1, 2, 4 m and their mean, printed and in metrics.json, and the predictions in the challenge's
    format in <out>/predictions/<sample token>.npz."""
    import time

    from bev.tasks.occupancy import rayiou
    from bev.tasks.occupancy.metric import format_table

    pred_dir = out / PREDICTIONS_DIR
    for path in _earlier_predictions(pred_dir):  # a submission folder holds this evaluation's samples only
        path.unlink()
    loaded.model.output_dir = str(out)  # its predictions go to <out>/predictions
    metrics = _test_metrics(cfg, loaded, data_cfg, datamodule)
    bev_only = ("threshold", "visibility_filter", "object_classes", "map_classes", "map_protocol")
    record = {k: v for k, v in _eval_record(loaded, data_cfg, metrics).items() if k not in bev_only}
    record["predictions"] = str(pred_dir)
    record["distance_bands_m"] = "voxel-column centre distance from the ego origin: [0,20), [20,40), [40,inf)"
    record["metric"] = (
        "Occ3D's Metric_mIoU: 18x18 confusion over the voxels of mask_camera, per-class IoU, mIoU = mean over "
        "classes 0-16 (fractions here; x 100 printed)"
    )
    rays = None
    if cfg.get("rayiou", True):  # of the files just written, against the split's labels
        start, index = time.perf_counter(), datamodule.val_set.index
        rays = rayiou.score_predictions(index, data_cfg.dataroot, pred_dir, rayiou.device_for(str(cfg.accelerator)))
        seconds = time.perf_counter() - start
        print(f"RayIoU: {len(index['sample_token'])} samples, {rays.rays} scored rays, {seconds:.1f} s", flush=True)
        record["metrics"].update(rays.as_dict())
        record["rayiou_per_class"] = rays.per_class()
        record["rayiou_metric"] = rayiou.DEFINITION
    atomic_write(out / "metrics.json", json.dumps(record, indent=2))
    mask = str(loaded.model.task_modules.occupancy.metric_mask)
    print(f"Checkpoint {loaded.path} on {data_cfg.dataroot} {data_cfg.version}/{data_cfg.val_split}:")
    print(format_table(metrics, mask=mask))
    if rays is not None:
        print(rayiou.format_table(rays))
    pngs = _occupancy_pngs(loaded.model, datamodule, out, int(cfg.num_pngs))
    print(f"Metrics: {out / 'metrics.json'}  Predictions (challenge format): {pred_dir}  Pictures: {len(pngs)} PNGs")
    return record


def _occupancy_pngs(model, datamodule, out: Path, n: int) -> list[Path]:
    """Cameras, then top-down and side views of the prediction beside the camera-visible ground truth, for the first
    n validation samples (bev.tasks.occupancy.viz)."""
    from bev.inference import predict
    from bev.tasks.occupancy.viz import render_occupancy
    from bev.viz import camera_grid, save_png

    paths: list[Path] = []
    for batch in datamodule.test_dataloader() if n > 0 else ():
        pred = predict(model, batch)["occupancy"].cpu()
        for i in range(min(len(pred), n - len(paths))):
            cams = camera_grid(batch["images"][i], batch["cam_ids"][i])
            img = render_occupancy(pred[i], batch["occ_semantics"][i], batch["occ_mask_camera"][i], cams)
            paths.append(Path(save_png(out / f"sample_{len(paths):03d}.png", img)))
        if len(paths) >= n:
            break
    return paths


def output_files(out: Path, num_pngs: int) -> list[Path]:
    """The files bev-eval writes in its output folder: metrics.json, a detecting model's results and devkit
    summary, and the sample PNGs."""
    from bev.tasks.detection.nusc_eval import RESULTS_FILE, SUMMARY_FILE

    names = ["metrics.json", RESULTS_FILE, SUMMARY_FILE, *(f"sample_{i:03d}.png" for i in range(max(num_pngs, 0)))]
    return [out / n for n in names]


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


PLOTS_DIR = "plots"  # made by the devkit's DetectionEval beside the results


def _check_output_folders(cfg: DictConfig, out: Path, model, occupancy: bool) -> None:
    """The folders bev-eval writes in (or has made) for this model stay inside the output folder and are folders;
    an occupancy model's earlier predictions there are replaced only with overwrite=true."""
    from bev.inference import overwrite_option
    from bev.utils.io import check_output_folder

    if occupancy:
        pred_dir = check_output_folder(out, out / PREDICTIONS_DIR, "challenge-format predictions")
        earlier = _earlier_predictions(pred_dir)
        if earlier and not overwrite_option(cfg.get("overwrite", False)):
            raise FileExistsError(
                f"{str(pred_dir)!r} already holds {len(earlier)} predictions of an earlier evaluation: pass "
                "overwrite=true to replace them, or another folder (hydra.run.dir=...)"
            )
    elif "detection" in model.tasks:
        check_output_folder(out, out / PLOTS_DIR, "devkit's plots")


def _earlier_predictions(pred_dir: Path) -> list[Path]:
    return sorted(p for p in pred_dir.glob("*.npz") if not p.is_dir()) if pred_dir.is_dir() else []


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
    """The metrics.json record: what was evaluated, how the metrics are defined, and the metrics."""
    from bev.utils.checkpoint import logged_val_iou

    ckpt, model = loaded.checkpoint, loaded.model
    return {
        "checkpoint": str(loaded.path),
        "epoch": ckpt.get("epoch"),
        "global_step": ckpt.get("global_step"),
        "data": OmegaConf.to_container(
            OmegaConf.masked_copy(data_cfg, ["dataroot", "version", "val_split", "final_dim"]), resolve=True
        ),
        "grid": OmegaConf.to_container(loaded.run_config.grid),
        "threshold": float(loaded.model_config.get("threshold", 0.5)),
        "visibility_filter": "iou_vis*: cells of vehicles with nuScenes visibility level 1 (0-40%) ignored",
        "distance_bands_m": "cell-centre distance from the ego origin: [0,20), [20,35), [35,50)",
        "object_classes": list(model.object_classes),
        "map_classes": list(model.map_classes),
        "map_protocol": "BEVFusion: IoU of p >= t over the split for t in 0.35..0.65 step 0.05; iou_<class> at the "
        "best t (thr_<class>); miou_map their mean",
        "metrics": metrics,
        "logged_val_iou": logged_val_iou(ckpt),
    }


def _print_report(loaded, data_cfg: DictConfig, record: dict[str, Any], out: Path, num_pngs: int) -> None:
    """What was evaluated, the IoU table, the run's own val/iou for comparison, and where the files are."""
    from bev.tasks.detection.nusc_eval import RESULTS_FILE
    from bev.tasks.detection.nusc_eval import format_table as detection_table
    from bev.tasks.motion.metric import format_table as motion_table
    from bev.tasks.segmentation.metric import format_table

    ckpt, metrics, logged = loaded.checkpoint, record["metrics"], record["logged_val_iou"]
    tasks = loaded.model.tasks
    print(
        f"Checkpoint {loaded.path} (epoch {ckpt.get('epoch')}, step {ckpt.get('global_step')}) on "
        f"{data_cfg.dataroot} {data_cfg.version}/{data_cfg.val_split}, threshold {record['threshold']}:"
    )
    if "detection" in tasks:
        print(f"3D detection, scored by the nuScenes devkit's DetectionEval (results: {out / RESULTS_FILE}):")
        print(detection_table(metrics))
    if "segmentation" not in tasks:
        print(f"Metrics: {out / 'metrics.json'}  Pictures: {num_pngs} PNGs in {out}")
        return
    print(format_table(metrics, loaded.model.object_classes, loaded.model.map_classes))
    if "future_iou_long" in metrics:  # a temporal model: FIERY's scores over the present and future frames
        print("\n" + motion_table(metrics))
    if logged is not None:
        print(f"val/iou logged by the run for this checkpoint: {logged:.4f} (this evaluation: {metrics['iou']:.4f})")
    print(f"Metrics: {out / 'metrics.json'}  Pictures: {num_pngs} PNGs in {out}")


def save_pngs(model, datamodule, out: Path, n: int) -> list[Path]:
    """Cameras + prediction vs target for the first n validation samples (a temporal model's: its windows,
    with the vehicles' instances and future paths; a detecting model's: its 3D boxes over the ground truth,
    in the BEV and the cameras)."""

    from bev.inference import predict
    from bev.viz import batch_sample, save_sample_png, save_temporal_png

    paths: list[Path] = []
    for batch in datamodule.test_dataloader() if n > 0 else ():
        pred = predict(model, batch)
        for i in range(len(batch["sample_token"])):
            if len(paths) >= n:
                return paths
            path = out / f"sample_{len(paths):03d}.png"
            if isinstance(pred, dict) and "detections" in pred:
                maps = "segmentation" in model.tasks  # else untrained
                save_sample_png(
                    path,
                    batch_sample(batch, i),
                    pred=pred["bev"][i : i + 1].cpu() if maps else None,
                    class_names=model.class_names,
                    detections={k: v.cpu() for k, v in pred["detections"][i].items()},
                )
            elif isinstance(pred, dict):
                item = {k: v[i].cpu() for k, v in pred.items()}
                save_temporal_png(
                    path,
                    batch_sample(batch, i),
                    item,
                    item["instances"],
                    class_names=model.class_names,
                    n_objects=len(model.object_classes),
                )
            else:
                save_sample_png(path, batch_sample(batch, i), pred=pred[i : i + 1].cpu(), class_names=model.class_names)
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
