"""`bev-predict ckpt_path=PATH data.dataroot=DIR [split=... | scene=...] [out=DIR]`: run a model over data.

Writes per sample <out>/<scene>/NNN_<token>.npz (probabilities, bev.inference.save_prediction_npz)
and .png (cameras + prediction over target), per scene <out>/<scene>.gif (the drive, 2 Hz),
and <out>/predictions.json. With a temporal checkpoint each sample is the window ending at it (its
present frame): the npz adds the future frames' segmentation and vehicle ids, and the pictures show
the vehicles in their instance colours with their predicted paths (bev.viz.render_temporal). With a
checkpoint that detects (boxes=auto, the default, or boxes=true) the npz adds the decoded 3D boxes
(det_boxes, det_scores, det_labels: bev.inference.save_prediction_npz; velocities from the boxes' tracks
over the key frames before when the checkpoint scores them so, model.detection.track_velocity), each
predictions.json record lists those at score >= box_threshold, and the pictures draw them (bev.viz.render_figure) over the
ground truth. With an occupancy checkpoint (model.tasks ("occupancy",)) each sample's
prediction is written in the Occ3D challenge's format instead, <out>/predictions/<sample token>.npz (one
(200, 200, 16) uint8 array of class ids, bev.tasks.occupancy.io.write_prediction), and the pictures show the
cameras above the top-down and side views of the prediction beside the camera-visible ground truth
(bev.tasks.occupancy.viz.render_occupancy). The module is not bev/predict.py because `bev.predict` is the Python API
function (bev.inference.predict).

Each of the model's tasks says what it writes and draws (bev.tasks.task.Task's bev-predict hooks): this module
composes them, asking no task by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

import bev.data  # noqa: F401 (registers the data/ config schemas: bev.data.config)
from bev.utils.config import CONFIG_DIR
from bev.utils.errors import report_errors


def predict_dataset(cfg: DictConfig) -> dict[str, Any]:
    """Predict the chosen split or scene, writing the files listed above; returns predictions.json's content."""
    import json

    from bev.inference import (
        build_data_config,
        creatable_dir,
        load_checkpoint,
        present_rows,
        say_chosen,
        select_samples,
        trained_on,
        writable_dir,
    )
    from bev.utils.io import atomic_write

    _check_options(cfg)
    out = creatable_dir(cfg.out, "out")  # made below, once the checkpoint and the data are checked
    loaded = load_checkpoint(cfg.ckpt_path, trusted=bool(cfg.get("trust_checkpoint")))
    say_chosen(loaded)
    options = _task_options(cfg, loaded)
    model = loaded.model.to(_device(cfg.device))
    data_cfg = build_data_config(cfg.data, loaded.run_config, trained_on(loaded))
    dataset, indices, split = select_samples(data_cfg, cfg.split, cfg.scene)
    rows = present_rows(dataset)[indices]  # each item's row in the dataset index (a window's present frame)
    identity = _index_identity(loaded, model)
    tasks = [t for t in model.task_modules.values() if t.start_predicting(options)]  # those that write
    _check_outputs(cfg, out, dataset.index, rows, identity, tasks)  # before any sample is predicted
    writable_dir(out, "out")
    files = _PredictionFiles(cfg, out, tasks, options)
    desc = f"predicting {split}" + (f" {cfg.scene}" if cfg.scene else "")
    records = _predict_samples(model, _loader(cfg, data_cfg, dataset, indices), rows, dataset.index, files, desc)
    summary = {
        **identity,
        "split": split,
        "scene": cfg.scene,
        **_prediction_format(tasks, options),
        "gifs": files.gifs,
        "samples": records,
    }
    summary = _merged_with_earlier(out / "predictions.json", summary)
    atomic_write(out / "predictions.json", json.dumps(summary, indent=2))
    print(
        f"Predicted {len(records)} samples of {split}{' ' + cfg.scene if cfg.scene else ''} with {loaded.path}: "
        f"{len(files.gifs)} GIF(s), files in {out}"
    )
    return summary


NPZ_FORMAT = (
    "uint8 q per class, probability = q / 255 (arrays indexed [x_index, y_index]); _-prefixed keys are metadata"
)


def _task_options(cfg: DictConfig, loaded) -> dict[str, Any]:
    """What the tasks' bev-predict hooks read: boxes (checked against the checkpoint: bev.inference.wants_boxes),
    box_threshold, and the class names and object-class count the pictures name."""
    from bev.inference import wants_boxes

    model = loaded.model
    return {
        "boxes": wants_boxes(cfg.boxes, model, loaded.path),
        "box_threshold": float(cfg.box_threshold),
        "class_names": model.class_names,
        "n_objects": len(model.object_classes),
    }


def _prediction_format(tasks, options: dict[str, Any]) -> dict[str, Any]:
    """What predictions.json says of the files: the npz's format unless a task writes its own, and each task's
    fields."""
    described: dict[str, Any] = {"npz_format": NPZ_FORMAT}
    for task in tasks:
        described.update(task.prediction_format(options))
    return described


def _sample_files(out: Path, stem: Path, token: str, tasks) -> list[Path]:
    """A sample's prediction files: those of the tasks that write a format of their own (Occ3D's
    <out>/predictions/<token>.npz), else its npz beside its PNG (<stem>.npz)."""
    own = [path for task in tasks if (path := task.sample_file(out, token)) is not None]
    return own or [stem.with_suffix(".npz")]


def _index_identity(loaded, model) -> dict[str, Any]:
    """What predictions.json records of the predictions it indexes: the checkpoint, the classes and the grid."""
    return {
        "checkpoint": str(loaded.path),
        "class_names": list(model.class_names),
        "grid": OmegaConf.to_container(loaded.run_config.grid),
    }


def _fits_index(path: Path, identity: dict[str, Any]) -> bool:
    """Whether the predictions.json at `path` indexes predictions of the same checkpoint, classes and grid."""
    import json

    try:
        earlier = json.loads(path.read_text())
        return all(earlier.get(k) == json.loads(json.dumps(v)) for k, v in identity.items())
    except (OSError, ValueError, AttributeError):
        return False


def _sample_stem(out: Path, scene: str, nth: int, token: str) -> Path:
    """<out>/<scene>/NNN_<token> (the sample's npz and png without suffix); names from the dataset's tables are
    made safe so that every file stays inside out=."""
    from bev.utils.io import inside, safe_name

    return inside(out, out / safe_name(scene) / f"{nth:03d}_{safe_name(token)}")


def _planned_files(cfg: DictConfig, out: Path, index, rows, tasks) -> list[Path]:
    """Every npz, png and GIF this run will write (the names _PredictionFiles gives), in order."""
    from bev.utils.io import inside, safe_name

    files, counts = [], {}
    for k in rows:
        scene = str(index["scene"][k])
        counts[scene] = counts.get(scene, 0) + 1
        token = index["sample_token"][k]
        stem = _sample_stem(out, scene, counts[scene] - 1, token)
        files += _sample_files(out, stem, token, tasks) + ([stem.with_suffix(".png")] if cfg.png else [])
    return files + [inside(out, out / f"{safe_name(s)}.gif") for s in counts if cfg.gif]


def _check_outputs(cfg: DictConfig, out: Path, index, rows, identity: dict[str, Any], tasks) -> None:
    """Refuse, before predicting, to replace anything but a regular file, and (without overwrite=true) files of an
    earlier run or another checkpoint's predictions.json; predictions.json of the same checkpoint is merged."""
    from bev.inference import overwrite_option
    from bev.utils.io import check_output

    overwrite, index_file = overwrite_option(cfg.overwrite), out / "predictions.json"
    planned = _planned_files(cfg, out, index, rows, tasks)
    for path in [*planned, index_file]:
        check_output(path)  # a link, a device node, a folder: never
    existing = [p for p in planned if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(
            f"out={str(out)!r} already holds {len(existing)} of the files this run would write (e.g. {existing[0]}): "
            f"pass overwrite=true to replace them, or another out="
        )
    if index_file.exists() and not overwrite and not _fits_index(index_file, identity):
        raise FileExistsError(
            f"{index_file} indexes predictions of another checkpoint, class list or grid (or is unreadable): pass "
            f"overwrite=true to replace that index (the files it lists stay), or another out="
        )


def _merged_with_earlier(path, summary: dict[str, Any]) -> dict[str, Any]:
    """summary plus the samples and GIFs of the scenes this run did not predict, from an earlier bev-predict
    into the same out= with the same checkpoint, classes and grid (another one's index is replaced, with a warning:
    only with overwrite=true)."""
    import json
    import warnings

    if not path.is_file():
        return summary
    if not _fits_index(path, {k: summary[k] for k in ("checkpoint", "class_names", "grid")}):
        warnings.warn(
            f"{path} indexed predictions of another checkpoint, class list or grid (or was unreadable): "
            f"replaced by this run's; the files it listed stay in {path.parent}",
            stacklevel=2,
        )
        return summary
    earlier = json.loads(path.read_text())
    scenes = {s["scene"] for s in summary["samples"]}
    kept = [s for s in earlier.get("samples", []) if s.get("scene") not in scenes]
    samples = sorted(kept + summary["samples"], key=lambda s: (s["scene"], s["timestamp"]))
    gifs = sorted(set(summary["gifs"]) | {g for g in earlier.get("gifs", []) if Path(g).is_file()})
    merged = {s["scene"] for s in samples}
    return {
        **summary,
        "split": summary["split"] if earlier.get("split") == summary["split"] or not kept else None,
        "scene": summary["scene"] if len(merged) == 1 else None,
        "gifs": gifs,
        "samples": samples,
    }


def _check_options(cfg: DictConfig) -> None:
    """Refuse bad picture and batch options before any model is loaded or any sample predicted."""
    _check_positive("gif_fps", cfg.gif_fps, "the GIFs' frames per second; nuScenes key frames are 2 Hz", whole=False)
    _check_positive("gif_width", cfg.gif_width, "the GIFs' width in pixels, e.g. 800")
    if cfg.batch_size is not None:
        _check_positive("batch_size", cfg.batch_size, "samples per batch, or null for the checkpoint's")
    from bev.inference import boxes_option, overwrite_option

    boxes_option(cfg.boxes)
    overwrite_option(cfg.overwrite)
    try:
        threshold = float(cfg.box_threshold)
    except (TypeError, ValueError):
        threshold = float("nan")
    if not 0 <= threshold <= 1:
        raise ValueError(
            f"box_threshold={cfg.box_threshold!r}: must be a score in [0, 1] (boxes drawn and listed at score >= it)"
        )


def _check_positive(key: str, value, what: str, whole: bool = True) -> None:
    import math

    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number > 0 and (not whole or number == int(number))):
        kind = "a whole number >= 1" if whole else "a number > 0"
        raise ValueError(f"{key}={value!r}: must be {kind} ({what}); pass {key}=<{kind}>")


def _device(device: str) -> str:
    """The `device` setting, with auto meaning cuda when available, else cpu."""
    import torch

    return device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def _loader(cfg: DictConfig, data_cfg: DictConfig, dataset, indices):
    """A DataLoader over the selected samples, in their (scene, time) order."""
    from torch.utils.data import DataLoader, Subset

    from bev.data.lidar import collate_points

    return DataLoader(
        Subset(dataset, indices.tolist()),
        batch_size=int(cfg.batch_size or data_cfg.batch_size),
        num_workers=int(data_cfg.num_workers),
        shuffle=False,
        collate_fn=collate_points,  # as training batches them: LiDAR points flat, window tokens per item
    )


def _predict_samples(model, loader, rows, index, files: _PredictionFiles, desc: str) -> list[dict[str, Any]]:
    """Predict every sample of the loader and write its files; returns their predictions.json records."""
    from tqdm import tqdm

    from bev.inference import per_sample, predictions
    from bev.tasks.task import SampleContext

    scenes, times = index["scene"], index["timestamp"]
    records, position, last = [], 0, None
    bar = tqdm(total=len(rows), desc=desc, unit="sample")
    for batch in loader:
        for i, item in enumerate(per_sample(predictions(model, batch))):
            k = int(rows[position])  # the sample's row in the dataset index
            position += 1
            sample = SampleContext(index, k, follows=last == k - 1 and scenes[k] == scenes[k - 1])
            last = k
            records.append(files.add(batch, i, item, sample, scenes[k], int(times[k])))
            bar.update(1)
    bar.close()
    files.end_scene()
    return records


class _PredictionFiles:
    """Writes the files of one sample after another: npz (+ png) per sample, a GIF per scene, numbered per scene;
    each task gives its part of them (bev.tasks.task.Task's bev-predict hooks)."""

    def __init__(self, cfg: DictConfig, out, tasks, options: dict[str, Any]):
        self.cfg, self.out, self.tasks, self.options = cfg, out, list(tasks), options
        self.scene, self.nth = None, 0  # the scene being written and the number of its next sample
        self.frames: list = []  # that scene's GIF frames so far
        self.gifs: list[str] = []

    def add(self, batch, i: int, item, sample, scene, timestamp: int) -> dict[str, Any]:
        """Write sample i of the batch (its predictions `item`) as the next of `scene`; returns its record."""
        if scene != self.scene:  # samples come in (scene, time) order: the previous scene is complete
            self.end_scene()
            self.scene, self.nth = str(scene), 0
        token = batch["sample_token"][i]
        stem = _sample_stem(self.out, self.scene, self.nth, token)
        title = f"{self.scene} #{self.nth}  {token}"
        self.nth += 1
        for task in self.tasks:
            item = task.sample_prediction(item, sample)
        meta = {"sample_token": token, "scene": self.scene, "timestamp": timestamp}
        rec = {"scene": self.scene, "sample_token": token, "timestamp": timestamp}
        rec["npz"] = str(self._write(batch, i, item, stem, meta))
        for task in self.tasks:
            rec.update(task.sample_record(item, self.options))
        if self.cfg.png or self.cfg.gif:
            self._pictures(rec, stem, title, batch, i, item)
        return rec

    def _write(self, batch, i: int, item, stem: Path, meta: dict[str, Any]) -> Path:
        """The sample's prediction file: the tasks' own format where one writes it, else the npz of every task's
        arrays (_sample_files names the same)."""
        from bev.inference import save_prediction_npz

        own = [
            path for task in self.tasks if (path := task.write_sample(self.out, meta["sample_token"], item)) is not None
        ]
        if own:
            return own[0]
        arrays: dict[str, Any] = {}
        for task in self.tasks:
            arrays.update(task.npz_arrays(item))
        return save_prediction_npz(stem.with_suffix(".npz"), arrays, **meta, bev_bounds=batch["bev_bounds"][i].numpy())

    def _pictures(self, rec: dict[str, Any], stem, title: str, batch, i: int, item) -> None:
        """Render sample i once, with every task's layers, for its PNG (named in rec) and its scene's GIF frame."""
        from bev.viz import gif_frame, picture_array, sample_picture, save_png

        layers: dict[str, Any] = {}
        for task in self.tasks:
            layers.update(task.picture_layers(item, self.options))
        names, n_objects = self.options["class_names"], self.options["n_objects"]
        img = picture_array(sample_picture(batch, i, layers, title, names, n_objects))
        if self.cfg.png:
            rec["png"] = save_png(stem.with_suffix(".png"), img)
        if self.cfg.gif:
            self.frames.append(gif_frame(img, int(self.cfg.gif_width)))

    def end_scene(self) -> None:
        """Write the current scene's GIF (when GIFs are on and it has frames) and start with no frames."""
        from bev.utils.io import inside, safe_name
        from bev.viz import save_gif

        if self.cfg.gif and self.frames:
            gif = inside(self.out, self.out / f"{safe_name(self.scene)}.gif")
            self.gifs.append(save_gif(gif, self.frames, float(self.cfg.gif_fps)))
        self.frames.clear()


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="predict")
@report_errors("bev-predict")
def _hydra_main(cfg: DictConfig) -> None:
    predict_dataset(cfg)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
