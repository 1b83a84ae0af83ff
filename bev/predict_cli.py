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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

import bev.data  # noqa: F401 (registers the data/ config schemas: bev.data.config)
from bev.tasks.occupancy.io import PREDICTIONS_DIR
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
        wants_boxes,
        writable_dir,
    )
    from bev.utils.io import atomic_write

    _check_options(cfg)
    out = creatable_dir(cfg.out, "out")  # made below, once the checkpoint and the data are checked
    loaded = load_checkpoint(cfg.ckpt_path, trusted=bool(cfg.get("trust_checkpoint")))
    say_chosen(loaded)
    boxes = wants_boxes(cfg.boxes, loaded.model, loaded.path)
    model = loaded.model.to(_device(cfg.device))
    data_cfg = build_data_config(cfg.data, loaded.run_config, trained_on(loaded))
    dataset, indices, split = select_samples(data_cfg, cfg.split, cfg.scene)
    rows = present_rows(dataset)[indices]  # each item's row in the dataset index (a window's present frame)
    identity = _index_identity(loaded, model)
    occupancy = _is_occupancy(model)
    _check_outputs(cfg, out, dataset.index, rows, identity, occupancy)  # before any sample is predicted
    writable_dir(out, "out")
    files = _PredictionFiles(
        cfg, out, model.class_names, len(model.object_classes), boxes, _draws_maps(model), occupancy
    )
    desc = f"predicting {split}" + (f" {cfg.scene}" if cfg.scene else "")
    records = _predict_samples(model, _loader(cfg, data_cfg, dataset, indices), rows, dataset.index, files, desc)
    summary = {
        **identity,
        "split": split,
        "scene": cfg.scene,
        "npz_format": OCCUPANCY_FORMAT if occupancy else NPZ_FORMAT,
        **(_boxes_format(float(cfg.box_threshold)) if boxes else {}),
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
OCCUPANCY_FORMAT = (
    "Occ3D challenge format: predictions/<sample token>.npz holds one (200, 200, 16) uint8 array (key arr_0) of "
    "Occ3D class ids (class_names; 17 free), indexed [x, y, z] over [-40, 40] x [-40, 40] x [-1, 5.4] m at 0.4 m "
    "in the ego frame of the sample's LIDAR_TOP (bev.tasks.occupancy.grid)"
)


def _is_occupancy(model) -> bool:
    """Whether the model predicts Occ3D occupancy only (model.tasks is ("occupancy",))."""
    return model.tasks == ("occupancy",)


def _npz_path(out: Path, stem: Path, token: str, occupancy: bool) -> Path:
    """A sample's npz: beside its PNG (<stem>.npz), or for occupancy the challenge's <out>/predictions/<token>.npz."""
    from bev.tasks.occupancy.io import prediction_path
    from bev.utils.io import inside

    return inside(out, prediction_path(out / PREDICTIONS_DIR, token)) if occupancy else stem.with_suffix(".npz")


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


def _planned_files(cfg: DictConfig, out: Path, index, rows, occupancy: bool = False) -> list[Path]:
    """Every npz, png and GIF this run will write (the names _PredictionFiles gives), in order."""
    from bev.utils.io import inside, safe_name

    files, counts = [], {}
    for k in rows:
        scene = str(index["scene"][k])
        counts[scene] = counts.get(scene, 0) + 1
        token = index["sample_token"][k]
        stem = _sample_stem(out, scene, counts[scene] - 1, token)
        files += [_npz_path(out, stem, token, occupancy)] + ([stem.with_suffix(".png")] if cfg.png else [])
    return files + [inside(out, out / f"{safe_name(s)}.gif") for s in counts if cfg.gif]


def _check_outputs(cfg: DictConfig, out: Path, index, rows, identity: dict[str, Any], occupancy: bool = False) -> None:
    """Refuse, before predicting, to replace anything but a regular file, and (without overwrite=true) files of an
    earlier run or another checkpoint's predictions.json; predictions.json of the same checkpoint is merged."""
    from bev.inference import overwrite_option
    from bev.utils.io import check_output

    overwrite, index_file = overwrite_option(cfg.overwrite), out / "predictions.json"
    planned = _planned_files(cfg, out, index, rows, occupancy)
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


def _boxes_format(threshold: float) -> dict[str, Any]:
    """What predictions.json says of the boxes of its records and npz files."""
    from bev.classes import DETECTION_CLASSES
    from bev.geometry import BOX_FIELDS

    return {
        "box_fields": list(BOX_FIELDS),
        "box_frame": "ego frame of the sample's LIDAR_TOP: x forward, y left, z up (m); yaw counter-clockwise "
        "from x (rad); velocity (vx, vy) m/s (bev.geometry)",
        "detection_classes": list(DETECTION_CLASSES),
        "box_threshold": threshold,
        "boxes_format": "each sample's 'boxes' lists the boxes at score >= box_threshold; its npz holds every "
        "decoded box: det_boxes (M, 9) box_fields, det_scores (M,), det_labels (M,) into detection_classes",
    }


def _draws_maps(model) -> bool:
    """Whether the model's BEV maps are trained (model.tasks has segmentation), so worth drawing."""
    return "segmentation" in model.tasks


def _cpu(pred):
    """predict's tensor or dict (a temporal model's tensors, a detecting model's "detections" per sample) on the
    CPU."""
    if not isinstance(pred, dict):
        return pred.cpu()
    out = {k: v.cpu() for k, v in pred.items() if k != "detections"}
    if "detections" in pred:
        out["detections"] = [{k: v.cpu() for k, v in d.items()} for d in pred["detections"]]
    return out


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

    return DataLoader(
        Subset(dataset, indices.tolist()),
        batch_size=int(cfg.batch_size or data_cfg.batch_size),
        num_workers=int(data_cfg.num_workers),
        shuffle=False,
    )


def _predict_samples(model, loader, indices, index, files: _PredictionFiles, desc: str) -> list[dict[str, Any]]:
    """Predict every sample of the loader and write its files; returns their predictions.json records."""
    from tqdm import tqdm

    from bev.inference import predict

    scenes, times = index["scene"], index["timestamp"]
    tracks = _box_tracks(model)
    records, position, last = [], 0, None
    bar = tqdm(total=len(indices), desc=desc, unit="sample")
    for batch in loader:
        probs = _cpu(predict(model, batch))
        dets = probs.pop("detections", None) if isinstance(probs, dict) else None  # a detecting model's boxes
        if files.occupancy:  # (B, 200, 200, 16) uint8 class ids, the argmax over the classes
            probs = probs["occupancy"]
        elif isinstance(probs, dict) and list(probs) == ["bev"]:  # the maps alone (a static model that detects)
            probs = probs["bev"]
        for i in range(len(batch["sample_token"])):
            k = int(indices[position])  # the sample's row in the dataset index
            position += 1
            det = dets[i] if dets is not None and files.boxes else None
            if det is not None and tracks is not None:
                det = _tracked(tracks, det, index, k, consecutive=last == k - 1 and scenes[k] == scenes[k - 1])
            last = k
            records.append(files.add(batch, i, probs, scenes[k], int(times[k]), det))
            bar.update(1)
    bar.close()
    files.end_scene()
    return records


def _box_tracks(model):
    """A Tracker when the checkpoint scores velocities from tracks (model.detection.track_velocity), else None."""
    from bev.tasks.detection.tracking import Tracker

    options = model.task_modules.detection.track if "detection" in model.tasks else None
    return None if options is None else Tracker(options)


def _tracked(tracker, det: dict, index, k: int, consecutive: bool) -> dict:
    """The sample's boxes with the velocities of their tracks over the key frames before (as bev-eval scores them);
    `consecutive`: the sample predicted before this one is its previous key frame."""
    import torch

    from bev.tasks.detection.tracking import track_ego_boxes

    token = str(index["sample_token"][k])
    prev = str(index["sample_token"][k - 1]) if consecutive else ""
    boxes = track_ego_boxes(
        tracker,
        token,
        prev,
        int(index["timestamp"][k]) / 1e6,
        det["boxes"],  # on the CPU (_cpu): numpy reads them as they are
        det["scores"],
        det["labels"],
        index["ego_rotation"][k],
        index["ego_translation"][k],
    )
    return {**det, "boxes": torch.as_tensor(boxes, dtype=torch.as_tensor(det["boxes"]).dtype)}


class _PredictionFiles:
    """Writes the files of one sample after another: npz (+ png) per sample, a GIF per scene, numbered per scene."""

    def __init__(
        self,
        cfg: DictConfig,
        out,
        class_names: list[str],
        n_objects: int = 1,
        boxes: bool = False,
        maps: bool = True,
        occupancy: bool = False,
    ):
        self.cfg, self.out, self.class_names, self.n_objects = cfg, out, class_names, n_objects
        self.boxes, self.maps = boxes, maps  # write and draw 3D boxes; draw the BEV maps (trained)
        self.occupancy = occupancy  # Occ3D class ids in the challenge's format and pictures
        self.scene, self.nth = None, 0  # the scene being written and the number of its next sample
        self.frames: list = []  # that scene's GIF frames so far
        self.gifs: list[str] = []

    def add(self, batch, i: int, probs, scene, timestamp: int, det=None) -> dict[str, Any]:
        """Write sample i of the batch (probabilities probs[i], boxes det) as the next of `scene`; returns its record."""
        from bev.inference import save_prediction_npz

        if scene != self.scene:  # samples come in (scene, time) order: the previous scene is complete
            self.end_scene()
            self.scene, self.nth = str(scene), 0
        token = batch["sample_token"][i]
        stem = _sample_stem(self.out, self.scene, self.nth, token)
        title = f"{self.scene} #{self.nth}  {token}"
        self.nth += 1
        if self.occupancy:
            return self._add_occupancy(batch, i, probs, timestamp, stem, title)
        future = {k: v[i] for k, v in probs.items()} if isinstance(probs, dict) else None
        present = future["bev"] if future else probs[i]
        rec = {
            "scene": self.scene,
            "sample_token": token,
            "timestamp": timestamp,
            "npz": str(
                save_prediction_npz(
                    stem.with_suffix(".npz"),
                    present,
                    self.class_names,
                    future,
                    det,
                    sample_token=token,
                    scene=self.scene,
                    timestamp=timestamp,
                    bev_bounds=batch["bev_bounds"][i].numpy(),
                )
            ),
        }
        if det is not None:
            rec.update(_box_records(det, float(self.cfg.box_threshold)))
        if self.cfg.png or self.cfg.gif:
            self._pictures(rec, stem, title, batch, i, probs, det)
        return rec

    def _add_occupancy(self, batch, i: int, labels, timestamp: int, stem, title: str) -> dict[str, Any]:
        """Write sample i's class ids labels[i] in the challenge's format (and its pictures); returns its record."""
        from bev.tasks.occupancy.io import write_prediction

        token = batch["sample_token"][i]
        path = write_prediction(self.out / PREDICTIONS_DIR, token, labels[i].numpy())
        rec = {"scene": self.scene, "sample_token": token, "timestamp": timestamp, "npz": str(path)}
        if self.cfg.png or self.cfg.gif:
            self._pictures(rec, stem, title, batch, i, labels)
        return rec

    def _pictures(self, rec: dict[str, Any], stem, title: str, batch, i: int, probs, det=None) -> None:
        """Render sample i once for its PNG (named in rec) and its scene's GIF frame, as configured."""
        from bev.viz import batch_sample, gif_frame, render_sample, render_temporal, save_png

        if self.occupancy:
            img = _occupancy_picture(batch, i, probs[i], title)
        elif isinstance(probs, dict):
            pred = {k: v[i] for k, v in probs.items()}
            img = render_temporal(
                batch_sample(batch, i),
                pred,
                pred["instances"],
                title=title,
                class_names=self.class_names,
                n_objects=self.n_objects,
            )
        else:
            img = render_sample(
                batch_sample(batch, i),
                pred=probs[i : i + 1] if self.maps else None,
                title=title,
                class_names=self.class_names,
                detections=det,
                box_threshold=float(self.cfg.box_threshold),
            )
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


def _occupancy_picture(batch, i: int, labels, title: str):
    """The cameras above the top-down and side views of the predicted class ids, beside the camera-visible ground
    truth when the items carry Occ3D labels (data.occupancy=true)."""
    from bev.tasks.occupancy.viz import render_occupancy
    from bev.viz import camera_grid

    cams = camera_grid(batch["images"][i], batch["cam_ids"][i] if "cam_ids" in batch else None)
    gt, seen = batch.get("occ_semantics"), batch.get("occ_mask_camera")
    return render_occupancy(labels, None if gt is None else gt[i], None if seen is None else seen[i], cams, title=title)


def _box_records(det, threshold: float) -> dict[str, Any]:
    """A sample's boxes for predictions.json: how many were decoded, and those at score >= threshold."""
    from bev.classes import DETECTION_CLASSES
    from bev.geometry import BOX_FIELDS

    keep = det["scores"] >= threshold
    boxes = [
        {"label": DETECTION_CLASSES[int(label)], "score": round(float(score), 4)}
        | {k: round(float(v), 4) for k, v in zip(BOX_FIELDS, box)}
        for box, score, label in zip(det["boxes"][keep].tolist(), det["scores"][keep], det["labels"][keep])
    ]
    return {"num_boxes": int(len(det["scores"])), "boxes": boxes}


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="predict")
@report_errors("bev-predict")
def _hydra_main(cfg: DictConfig) -> None:
    predict_dataset(cfg)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
