"""`bev-predict ckpt_path=PATH [data.dataroot=DIR] [split=... | scene=...] [out=DIR]`: run a model over data.

Writes per sample <out>/<scene>/NNN_<token>.npz (probabilities, bev.inference.save_prediction_npz)
and .png (cameras + prediction over target), per scene <out>/<scene>.gif (the drive, 2 Hz),
and <out>/predictions.json. The module is not bev/predict.py because `bev.predict` is the
Python API function (bev.inference.predict).
"""
from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from bev.utils.config import CONFIG_DIR
from bev.utils.errors import report_errors


def predict_dataset(cfg: DictConfig) -> dict[str, Any]:
    import json

    import numpy as np
    import torch
    from PIL import Image
    from torch.utils.data import DataLoader, Subset
    from tqdm import tqdm

    from bev.inference import build_data_config, load_checkpoint, predict, save_gif, save_prediction_npz, select_samples, writable_dir
    from bev.utils.io import atomic_open, atomic_write
    from bev.viz import render_sample

    out = writable_dir(cfg.out, "out")
    loaded = load_checkpoint(cfg.ckpt_path)
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model = loaded.model.to(device)
    data_cfg = build_data_config(cfg.data, loaded.run_config)
    dataset, indices, split = select_samples(data_cfg, cfg.split, cfg.scene)
    scenes, times = dataset.index["scene"], dataset.index["timestamp"]
    loader = DataLoader(Subset(dataset, indices.tolist()), batch_size=int(cfg.batch_size or data_cfg.batch_size),
                        num_workers=int(data_cfg.num_workers), shuffle=False)

    records, frames, gifs = [], [], []
    def flush_gif(scene: str) -> None:
        if cfg.gif and frames:
            gifs.append(str(save_gif(out / f"{scene}.gif", frames, float(cfg.gif_fps))))
        frames.clear()

    position, scene, nth = 0, None, 0
    bar = tqdm(total=len(indices), desc=f"predicting {split}" + (f" {cfg.scene}" if cfg.scene else ""), unit="sample")
    for batch in loader:
        probs = predict(model, batch).cpu()
        for i in range(probs.shape[0]):
            k = int(indices[position])
            position += 1
            if scenes[k] != scene:
                if scene is not None:
                    flush_gif(scene)
                scene, nth = str(scenes[k]), 0
            token = batch["sample_token"][i]
            stem = out / scene / f"{nth:03d}_{token}"
            nth += 1
            rec = {"scene": scene, "sample_token": token, "timestamp": int(times[k]),
                   "npz": str(save_prediction_npz(stem.with_suffix(".npz"), probs[i], model.class_names, sample_token=token,
                                                  scene=scene, timestamp=int(times[k]), bev_bounds=batch["bev_bounds"][i].numpy()))}
            if cfg.png or cfg.gif:
                sample = {key: v[i : i + 1] for key, v in batch.items() if torch.is_tensor(v) or isinstance(v, list)}
                img = render_sample(sample, pred=probs[i : i + 1], title=f"{scene} #{nth - 1}  {token}",
                                    class_names=model.class_names)
                if cfg.png:
                    with atomic_open(stem.with_suffix(".png"), "wb") as f:
                        Image.fromarray(img).save(f, format="PNG")
                    rec["png"] = str(stem.with_suffix(".png"))
                if cfg.gif:
                    h, w = img.shape[:2]
                    width = min(int(cfg.gif_width), w)
                    frames.append(np.asarray(Image.fromarray(img).resize((width, round(h * width / w)), Image.Resampling.LANCZOS)))
            records.append(rec)
            bar.update(1)
    bar.close()
    if scene is not None:
        flush_gif(scene)
    summary = {"checkpoint": str(loaded.path), "split": split, "scene": cfg.scene, "class_names": model.class_names,
               "npz_format": "uint8 q per class, probability = q / 255 (arrays indexed [x_index, y_index]); _-prefixed keys are metadata",
               "grid": OmegaConf.to_container(loaded.run_config.grid), "gifs": gifs, "samples": records}
    atomic_write(out / "predictions.json", json.dumps(summary, indent=2))
    print(f"Predicted {len(records)} samples of {split}{' ' + cfg.scene if cfg.scene else ''} with {loaded.path}: "
          f"{len(gifs)} GIF(s), files in {out}")
    return summary


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="predict")
@report_errors("bev-predict")
def _hydra_main(cfg: DictConfig) -> None:
    predict_dataset(cfg)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
