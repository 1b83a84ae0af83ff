"""`bev-eval ckpt_path=PATH [data=... | data.dataroot=...]`: evaluate a checkpoint on the val split.

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

from bev.utils.config import CONFIG_DIR
from bev.utils.errors import report_errors
from bev.utils.io import atomic_write


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    import lightning as L
    from hydra.utils import instantiate

    from bev.inference import build_data_config, load_checkpoint
    from bev.utils.checkpoint import logged_val_iou
    from bev.metrics import format_table
    from bev.callbacks import ThreadsFollowLoad
    from bev.utils.threads import intra_op_threads

    if OmegaConf.is_missing(cfg, "ckpt_path"):
        raise ValueError("no checkpoint given: bev-eval ckpt_path=<a .ckpt file, or a run directory for its best checkpoint>")
    loaded = load_checkpoint(cfg.ckpt_path, cfg.get("model"), cfg.grid, cfg.data)
    model, run_cfg, model_cfg, ckpt, ckpt_path = loaded
    with open_dict(cfg):
        cfg.grid = run_cfg.grid
    data_cfg = build_data_config(cfg.data, run_cfg)
    datamodule = instantiate(data_cfg)

    precision = cfg.get("precision") or OmegaConf.select(run_cfg, "trainer.precision", default="32-true")
    threads, accelerator = cfg.get("threads"), str(cfg.accelerator)
    with intra_op_threads(threads, data_cfg.get("num_workers", 0), accelerator) as n:
        # On a busy machine threads: auto gives way to the other processes.
        follow = ThreadsFollowLoad.when_auto(n, threads, accelerator)
        trainer = L.Trainer(accelerator=cfg.accelerator, devices=1, precision=precision, logger=False, callbacks=follow,
                            enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
        trainer.test(model, datamodule=datamodule, verbose=False)
    metrics = {k.removeprefix("test/"): float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")}

    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    logged = logged_val_iou(ckpt)
    record = {
        "checkpoint": str(ckpt_path),
        "epoch": ckpt.get("epoch"),
        "global_step": ckpt.get("global_step"),
        "data": OmegaConf.to_container(OmegaConf.masked_copy(data_cfg, ["dataroot", "version", "val_split", "final_dim"]), resolve=True),
        "grid": OmegaConf.to_container(run_cfg.grid),
        "threshold": float(model_cfg.get("threshold", 0.5)),
        "visibility_filter": "iou_vis*: cells of vehicles with nuScenes visibility level 1 (0-40%) ignored",
        "distance_bands_m": "cell-centre distance from the ego origin: [0,20), [20,35), [35,50)",
        "object_classes": list(model.object_classes),
        "map_classes": list(model.map_classes),
        "map_protocol": "BEVFusion: IoU of p >= t over the split for t in 0.35..0.65 step 0.05; iou_<class> at the "
                        "best t (thr_<class>); miou_map their mean",
        "metrics": metrics,
        "logged_val_iou": logged,
    }
    atomic_write(out / "metrics.json", json.dumps(record, indent=2))
    pngs = save_pngs(model, datamodule, out, int(cfg.num_pngs))

    print(f"Checkpoint {ckpt_path} (epoch {ckpt.get('epoch')}, step {ckpt.get('global_step')}) on "
          f"{data_cfg.dataroot} {data_cfg.version}/{data_cfg.val_split}, threshold {record['threshold']}:")
    print(format_table(metrics, model.object_classes, model.map_classes))
    if logged is not None:
        print(f"val/iou logged by the run for this checkpoint: {logged:.4f} (this evaluation: {metrics['iou']:.4f})")
    print(f"Metrics: {out / 'metrics.json'}  Pictures: {len(pngs)} PNGs in {out}")
    return record


def save_pngs(model, datamodule, out: Path, n: int) -> list[Path]:
    """Cameras + prediction vs target for the first n validation samples."""
    import torch

    from bev.viz import save_sample_png

    if n <= 0:
        return []
    model.eval()
    device = model.device
    paths: list[Path] = []
    with torch.no_grad():
        for batch in datamodule.test_dataloader():
            pred = model({k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}).float().sigmoid().cpu()
            for i in range(pred.shape[0]):
                if len(paths) >= n:
                    return paths
                sample = {k: v[i : i + 1] if torch.is_tensor(v) or isinstance(v, list) else v for k, v in batch.items()}
                path = out / f"sample_{len(paths):03d}.png"
                save_sample_png(path, sample, pred=pred[i : i + 1], class_names=model.class_names)
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
