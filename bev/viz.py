"""Pictures of samples and predictions: the cameras (nuScenes: 2x3 in camera order; any rig of
1-12 cameras: camera_layout) and BEV panels.

BEV panels are drawn with x forward = up and y left = left, the ego at the centre (white
triangle pointing forward), axes in ego metres. Arrays stay [x_index, y_index] everywhere
else; only `bev_to_display` reorients them for the screen.

With class_names (object classes then map classes, as the dataset's/model's), map layers are
drawn in colour under the objects (a fixed colour per map class, MAP_COLORS, with a legend);
a prediction is drawn the same way, each layer blended by its probability.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Polygon

from bev.data.transforms import denormalize_image
from bev.geometry import CAMERA_NAMES, Grid, box_corners, ego_to_image
from bev.utils.io import atomic_open

# Error-map colours: true positive, false positive, false negative (background stays black).
TP_COLOR, FP_COLOR, FN_COLOR = (0, 200, 0), (230, 40, 40), (40, 110, 255)
# Layer colours, drawn in this order (later on top); objects go over every map layer.
MAP_COLORS: dict[str, tuple[int, int, int]] = {
    "drivable_area": (95, 95, 110),
    "road_segment": (80, 80, 100),
    "road_block": (70, 90, 100),
    "lane": (110, 100, 130),
    "carpark_area": (150, 120, 60),
    "walkway": (60, 140, 90),
    "ped_crossing": (200, 200, 200),
    "stop_line": (230, 50, 50),
    "divider": (250, 210, 40),
    "road_divider": (250, 210, 40),
    "lane_divider": (240, 240, 120),
}
OBJECT_COLORS = ((60, 160, 255), (255, 120, 200), (255, 150, 40), (160, 255, 160))
BACKGROUND = (20, 20, 24)
# One colour per detection class (bev.classes.DETECTION_CLASSES), chosen to stand out from the map
# layers and the object masks (OBJECT_COLORS) they are drawn over.
DETECTION_COLORS: dict[str, tuple[int, int, int]] = {
    "car": (255, 140, 0),
    "truck": (0, 190, 255),
    "construction_vehicle": (255, 220, 0),
    "bus": (255, 50, 50),
    "trailer": (170, 90, 255),
    "barrier": (140, 255, 200),
    "motorcycle": (255, 0, 200),
    "bicycle": (0, 230, 90),
    "pedestrian": (30, 80, 255),
    "traffic_cone": (200, 255, 0),
}
# Boxes drawn in pictures: predictions at score >= this (the decoder keeps boxes down to 0.1, too
# many to read); ground truth always. Files (npz, predictions.json) keep what the decoder gives.
BOX_THRESHOLD = 0.3
ARROW_SECONDS = 1.0  # a velocity arrow is where the box centre will be in this many seconds
MIN_ARROW_SPEED = 0.2  # m/s: slower boxes get no arrow (the devkit's moving/stopped rule)
NEAR_PLANE = 0.5  # metres: box edges are clipped to depth >= this before projection
# The 12 edges of box_corners' 8 corners: the bottom ring, the top ring, the 4 verticals.
BOX_EDGES = ((0, 1), (1, 2), (2, 3), (3, 0), (4, 5), (5, 6), (6, 7), (7, 4), (0, 4), (1, 5), (2, 6), (3, 7))
PRED_STYLE = {"lw": 1.3, "ls": "-"}
GT_STYLE = {"lw": 0.8, "ls": (0, (3, 2))}


def _np(x: Any) -> np.ndarray:
    return x.detach().cpu().float().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float32)


def bev_to_display(bev: np.ndarray) -> np.ndarray:
    """[x_index, y_index, ...] -> screen rows/cols: row 0 = largest x (front), col 0 = largest y (left)."""
    return np.asarray(bev)[::-1, ::-1]


def camera_layout(n: int) -> tuple[int, int]:
    """(rows, cols) of the camera picture for n camera slots: 3 per row up to 9 (nuScenes: 2x3), then 4."""
    cols = min(n, 3) if n <= 9 else 4
    return -(-n // cols), cols


def camera_slots(n: int, cam_ids: Any = None) -> list[int]:
    """Slot of each of n images: cam_ids (indices into the rig's camera list) or 0..n-1."""
    return list(range(n)) if cam_ids is None else [int(c) for c in _np(cam_ids).reshape(-1)]


def camera_grid(images: Any, cam_ids: Any = None) -> np.ndarray:
    """(Ncam, 3, H, W) normalised images -> (rows*H, cols*W, 3) uint8, one slot per camera of the rig.

    cam_ids gives each image's index in the rig's camera list (nuScenes: CAMERA_NAMES; default
    0..Ncam-1); the rig has max(cam_ids) + 1 slots, laid out by camera_layout; missing cameras are black.
    """
    images = images if isinstance(images, torch.Tensor) else torch.as_tensor(np.asarray(images))
    n, _, H, W = images.shape
    ids = camera_slots(n, cam_ids)
    rows, cols = camera_layout(max(ids) + 1)
    out = np.zeros((rows * H, cols * W, 3), dtype=np.uint8)
    for img, c in zip(images, ids):
        r, col = divmod(c, cols)
        out[r * H : (r + 1) * H, col * W : (col + 1) * W] = denormalize_image(img)
    return out


def error_map(prob: np.ndarray, target: np.ndarray, threshold: float = 0.5) -> np.ndarray:
    """(X, Y) probability + {0,1} target -> (X, Y, 3) uint8: TP green, FP red, FN blue."""
    pred = np.asarray(prob) >= threshold
    tgt = np.asarray(target) > 0.5
    out = np.zeros(pred.shape + (3,), dtype=np.uint8)
    out[pred & tgt] = TP_COLOR
    out[pred & ~tgt] = FP_COLOR
    out[~pred & tgt] = FN_COLOR
    return out


def layer_colors(class_names) -> list[tuple[str, tuple[int, int, int]]]:
    """(name, RGB) per channel: map classes by MAP_COLORS, object classes by OBJECT_COLORS in turn."""
    out, k = [], 0
    for name in class_names:
        if name in MAP_COLORS:
            out.append((name, MAP_COLORS[name]))
        else:
            out.append((name, OBJECT_COLORS[k % len(OBJECT_COLORS)]))
            k += 1
    return out


def compose_layers(channels: np.ndarray, class_names) -> np.ndarray:
    """(K, X, Y) values in [0, 1] -> (X, Y, 3) uint8: map layers in MAP_COLORS order, objects on top,
    each blended over what is below by its value (a target's 0/1, a prediction's probability)."""
    colors = layer_colors(class_names)
    order = sorted(
        range(len(colors)),
        key=lambda k: list(MAP_COLORS).index(colors[k][0]) if colors[k][0] in MAP_COLORS else len(MAP_COLORS) + k,
    )
    img = np.empty(channels.shape[1:] + (3,), dtype=np.float32)
    img[:] = BACKGROUND
    for k in order:
        a = np.clip(channels[k], 0, 1)[..., None]
        img = img * (1 - a) + np.asarray(colors[k][1], dtype=np.float32) * a
    return img.round().astype(np.uint8)


def batch_sample(batch: Mapping[str, Any], i: int) -> dict:
    """Sample i of a collated batch, kept batched (size 1), as render_sample and save_sample_png take it. The flat
    "points" rows (batch index first, bev.data.lidar.collate_points) are those of sample i, as batch 0."""
    out = {k: v[i : i + 1] if torch.is_tensor(v) or isinstance(v, list) else v for k, v in batch.items()}
    if torch.is_tensor(batch.get("points")):
        rows = batch["points"][batch["points"][:, 0] == i]
        out["points"] = torch.cat([torch.zeros_like(rows[:, :1]), rows[:, 1:]], 1)
    return out


def _unbatch(sample: Mapping[str, Any]) -> tuple[dict, bool]:
    key, dims = ("images", 5) if "images" in sample else ("bev", 4)  # no images with data.cameras=false
    batched = np.ndim(sample[key]) == dims if not isinstance(sample[key], torch.Tensor) else sample[key].dim() == dims
    if not batched:
        return dict(sample), False
    out = {}
    for k, v in sample.items():
        out[k] = v[0] if isinstance(v, (torch.Tensor, np.ndarray, list, tuple)) else v
    return out, True


def _pred_channels(pred: Any) -> np.ndarray:
    """Prediction (C, X, Y) or (1, C, X, Y) -> (C, X, Y) probabilities (logits pass through a sigmoid)."""
    p = _np(pred)
    while p.ndim > 3:
        p = p[0]
    if p.size and (p.min() < 0 or p.max() > 1):
        p = 1.0 / (1.0 + np.exp(-p))
    return p


def _draw_bev(ax, img: np.ndarray, grid: Grid, title: str, **kw):
    (xlo, xhi, _), (ylo, yhi, _) = grid.xbound, grid.ybound
    im = ax.imshow(bev_to_display(img), extent=(yhi, ylo, xlo, xhi), interpolation="nearest", **kw)
    s = 0.02 * (xhi - xlo)
    ax.add_patch(Polygon([(0, 1.5 * s), (s, -s), (-s, -s)], closed=True, facecolor="white", edgecolor="black", lw=0.8))
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("y (m, left <)", fontsize=7)
    ax.set_ylabel("x (m, forward ^)", fontsize=7)
    ax.tick_params(labelsize=6)
    return im


def _grid_for(shape: tuple[int, int], grid: Grid | None) -> Grid:
    if grid is not None and grid.bev_shape == tuple(shape):
        return grid
    g = Grid()
    if g.bev_shape == tuple(shape):
        return g
    # Unknown bounds: show cell units centred on the ego.
    return Grid(xbound=(-shape[0] / 2, shape[0] / 2, 1.0), ybound=(-shape[1] / 2, shape[1] / 2, 1.0))


def render_figure(
    sample: Mapping[str, Any],
    pred: Any = None,
    grid: Grid | None = None,
    title: str | None = None,
    class_names=None,
    detections: Mapping[str, Any] | None = None,
    box_threshold: float = BOX_THRESHOLD,
) -> Figure:
    """A matplotlib Figure: the cameras on top; BEV target (+ prediction and TP/FP/FN map) below.

    class_names (one per bev channel) turns on the coloured layer view; the TP/FP/FN map is always
    the first channel's (the first object class). 3D boxes: the sample's ground truth (det_boxes,
    det_labels of data.detection=true; dashed) in the target panel and (those centred in the grid) the cameras,
    and `detections` (one sample of predict's "detections": boxes, scores, labels; those at score >= box_threshold)
    in the prediction panel (over the ground truth) and the cameras. With detections and no pred
    (a model that only detects) the prediction panel shows the boxes over the target's map layers."""
    points = sample_points(sample)
    s, _ = _unbatch(sample)
    cams = camera_grid(s["images"], s.get("cam_ids")) if "images" in s else None  # none: the BEV row alone
    channels = _target_channels(s["bev"], class_names)
    layers = (
        class_names if class_names is not None and len(class_names) > 1 else None
    )  # one class: the grey/viridis view
    target = channels[0] if layers is not None else channels.max(axis=0)
    g = _grid_for(target.shape, _sample_grid(s, grid))
    fig = Figure(figsize=(12, 4.2 + (3.2 if cams is not None else 0)), dpi=100)
    FigureCanvasAgg(fig)
    rows = [cams.shape[0] / cams.shape[1] * 3, 1.0] if cams is not None else [1.0]
    gs = fig.add_gridspec(len(rows), 3, height_ratios=rows)
    gt_boxes, pred_boxes = sample_gt_boxes(s), box_detections(detections, box_threshold)
    if cams is not None:
        ax = fig.add_subplot(gs[0, :])
        _draw_cameras(ax, cams, s, title)
        draw_points_cameras(ax, points, s)
        draw_boxes_cameras(ax, _in_grid(gt_boxes, g), s, gt=True)  # those the model could predict
        draw_boxes_cameras(ax, pred_boxes, s)
    elif title:
        fig.suptitle(title, fontsize=10)
    bev = len(rows) - 1  # the BEV row
    ax = fig.add_subplot(gs[bev, 0])
    if layers is not None:
        _draw_bev(ax, compose_layers(channels, layers), g, "BEV target")
    else:
        _draw_bev(ax, target, g, "BEV target", cmap="gray", vmin=0, vmax=1)
    draw_points_bev(ax, points, g)
    draw_boxes_bev(ax, gt_boxes, g, gt=True)
    if pred is not None:
        probs = _pred_channels(pred)
        prob = probs[0] if probs.ndim > 2 else probs  # the first class's, for the error map
        if prob.shape != target.shape:
            raise ValueError(f"prediction shape {prob.shape} does not match the BEV target {target.shape}")
        ax = _draw_prediction(fig, gs[bev, 1], probs, prob, channels, g, layers)
        _draw_errors(fig.add_subplot(gs[bev, 2]), prob, target, g, layers[0] if layers is not None else "vehicle")
    elif pred_boxes is not None:  # boxes only: over the target's map layers (or a blank panel)
        base = _map_base(channels, layers, sum(n not in MAP_COLORS for n in layers)) if layers is not None else None
        ax = fig.add_subplot(gs[bev, 1])
        _draw_bev(ax, base if base is not None else np.full(target.shape + (3,), BACKGROUND, np.uint8), g, "boxes")
    if pred_boxes is not None:
        draw_boxes_bev(ax, gt_boxes, g, gt=True)
        draw_boxes_bev(ax, pred_boxes, g)
        ax.set_title(f"predicted boxes (score >= {box_threshold:g}) over the ground truth", fontsize=9)
    fig.tight_layout()
    box_handles = _box_legend_handles([gt_boxes, pred_boxes])
    if layers is not None or box_handles:
        _add_legend(fig, layers or (), box_handles)
    return fig


def _target_channels(bev: Any, class_names) -> np.ndarray:
    """The sample's BEV target as (K, X, Y), checked against class_names (one name per channel) when given."""
    channels = _np(bev)
    channels = channels[None] if channels.ndim == 2 else channels
    if class_names is not None and len(class_names) != channels.shape[0]:
        raise ValueError(
            f"{len(class_names)} class names {list(class_names)} for a target of {channels.shape[0]} channels"
        )
    return channels


def _sample_grid(s: Mapping[str, Any], grid: Grid | None) -> Grid | None:
    """`grid` if given, else the grid of the sample's bev_bounds (None when it has none)."""
    if grid is not None or s.get("bev_bounds") is None:
        return grid
    b = s["bev_bounds"]
    b = b.detach().cpu().double().numpy() if isinstance(b, torch.Tensor) else np.asarray(b, dtype=np.float64)
    xb, yb = (tuple(float(v) for v in row) for row in b.reshape(2, 3))
    return Grid(xbound=xb, ybound=yb)


def _draw_cameras(ax, cams: np.ndarray, s: Mapping[str, Any], title: str | None) -> None:
    """The camera picture, each slot labelled with its camera's name, under the figure's title."""
    ax.imshow(cams)
    H, W = s["images"].shape[-2:]
    ids = camera_slots(s["images"].shape[0], s.get("cam_ids"))
    cols = camera_layout(max(ids) + 1)[1]
    for c in range(max(ids) + 1):  # cam_ids follow CAMERA_NAMES (nuScenes); a rig without them is numbered
        name = CAMERA_NAMES[c] if s.get("cam_ids") is not None and c < len(CAMERA_NAMES) else f"camera {c}"
        r, col = divmod(c, cols)
        ax.text(
            col * W + 4,
            r * H + 4,
            name,
            color="white",
            fontsize=7,
            va="top",
            bbox=dict(facecolor="black", alpha=0.5, pad=1, lw=0),
        )
    ax.set_axis_off()
    ax.set_title(title or f"sample {s.get('sample_token', '')}", fontsize=9)


def _draw_prediction(fig: Figure, cell, probs: np.ndarray, prob: np.ndarray, channels: np.ndarray, grid: Grid, layers):
    """The prediction panel (returned): every layer blended by its probability (layers given), else P(vehicle)
    with a colorbar."""
    ax = fig.add_subplot(cell)
    if layers is not None:
        if probs.shape != channels.shape:
            raise ValueError(f"prediction shape {probs.shape} does not match the BEV target {channels.shape}")
        _draw_bev(ax, compose_layers(probs, layers), grid, "prediction (blended by probability)")
    else:
        im = _draw_bev(ax, prob, grid, "prediction P(vehicle)", cmap="viridis", vmin=0, vmax=1)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02).ax.tick_params(labelsize=6)
    return ax


def _draw_errors(ax, prob: np.ndarray, target: np.ndarray, grid: Grid, name: str) -> None:
    """The TP/FP/FN map of one class at threshold 0.5, titled with its IoU."""
    tp = int(((prob >= 0.5) & (target > 0.5)).sum())
    fp = int(((prob >= 0.5) & (target <= 0.5)).sum())
    fn = int(((prob < 0.5) & (target > 0.5)).sum())
    iou = tp / max(tp + fp + fn, 1)
    _draw_bev(ax, error_map(prob, target), grid, f"{name} @0.5 TP green, FP red, FN blue (IoU {iou:.3f})")


def _add_legend(fig: Figure, class_names, extra: list | None = None) -> None:
    """A legend of the layer colours (and `extra` handles: the box classes) along the bottom of the figure."""
    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor=np.asarray(c) / 255, edgecolor="black", lw=0.5, label=n) for n, c in layer_colors(class_names)
    ] + list(extra or ())
    fig.subplots_adjust(bottom=0.1)
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), fontsize=7, frameon=False)


def render_sample(
    sample: Mapping[str, Any],
    pred: Any = None,
    grid: Grid | None = None,
    title: str | None = None,
    class_names=None,
    **boxes: Any,
) -> np.ndarray:
    """The figure of `render_figure` as an (H, W, 3) uint8 array (for image loggers); `boxes`: its
    detections= and box_threshold=."""
    fig = render_figure(sample, pred, grid, title, class_names, **boxes)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def save_sample_png(
    path: str | os.PathLike,
    batch_or_sample: Mapping[str, Any],
    pred: Any = None,
    grid: Grid | None = None,
    title: str | None = None,
    class_names=None,
    **boxes: Any,
) -> str:
    """Write ONE PNG: the cameras + BEV target (+ prediction vs target when pred is given).

    A batch (images (B, Ncam, 3, H, W)) shows its first sample. pred: (1, X, Y) probability (or
    logits, or with a batch dim). boxes: render_figure's detections= and box_threshold=.
    Written atomically (temp file + os.replace). Returns the path.
    """
    fig = render_figure(batch_or_sample, pred, grid, title, class_names, **boxes)
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png")
    path = os.fspath(path)
    return path


# --------------------------------------------------------------------------- picture files


def save_png(path: str | os.PathLike, img: np.ndarray) -> str:
    """An (H, W, 3) uint8 picture as a PNG, written atomically. Returns the path."""
    from PIL import Image

    with atomic_open(path, "wb") as f:
        Image.fromarray(img).save(f, format="PNG")
    return os.fspath(path)


def gif_frame(img: np.ndarray, max_width: int) -> np.ndarray:
    """img scaled down to at most max_width pixels wide (aspect kept), keeping GIFs small."""
    from PIL import Image

    h, w = img.shape[:2]
    width = min(max_width, w)
    return np.asarray(Image.fromarray(img).resize((width, round(h * width / w)), Image.Resampling.LANCZOS))


def save_gif(path: str | os.PathLike, frames: list, fps: float = 2.0) -> str:
    """An animated GIF (loops forever) of (H, W, 3) uint8 frames, written atomically. Returns the path."""
    from PIL import Image

    if not frames:
        raise ValueError("a GIF needs at least one frame")
    images = [Image.fromarray(f).convert("P", palette=Image.Palette.ADAPTIVE, colors=255) for f in frames]
    with atomic_open(path, "wb") as f:
        images[0].save(
            f, format="GIF", save_all=True, append_images=images[1:], duration=int(round(1000 / fps)), loop=0
        )
    return os.fspath(path)


# --------------------------------------------------------------------------- temporal windows: instances and futures
INSTANCE_COLORS = (
    (230, 25, 75),
    (60, 180, 75),
    (255, 225, 25),
    (0, 130, 200),
    (245, 130, 48),
    (145, 30, 180),
    (70, 240, 240),
    (240, 50, 230),
    (210, 245, 60),
    (250, 190, 212),
    (0, 128, 128),
    (220, 190, 255),
)


def instance_color(i: int) -> tuple[int, int, int]:
    """The colour of instance id i (> 0), the same in every panel and frame of a picture."""
    return INSTANCE_COLORS[(int(i) - 1) % len(INSTANCE_COLORS)]


def paint_instances(instances: Any, base: np.ndarray | None = None) -> np.ndarray:
    """(X, Y) ids (0 background) -> (X, Y, 3) uint8, each id in its colour over `base` (default background)."""
    ids = _np(instances).astype(np.int64)
    img = np.empty(ids.shape + (3,), dtype=np.uint8) if base is None else base.copy()
    if base is None:
        img[:] = BACKGROUND
    for i in np.unique(ids[ids > 0]):
        img[ids == i] = instance_color(i)
    return img


def _draw_paths(ax, instances: Any, grid: Grid) -> None:
    """Each instance's centre over the frames of `instances` (T, X, Y): a line from the present (dot) onwards."""
    from bev.tasks.motion.instances import instance_paths

    for i, path in instance_paths(torch.as_tensor(_np(instances)).long(), grid).items():
        pts = path[~torch.isnan(path[:, 0])].numpy()
        if len(pts):
            color = np.asarray(instance_color(i)) / 255
            ax.plot(pts[:, 1], pts[:, 0], "-", color=color, lw=1.2)
            ax.plot(pts[:1, 1], pts[:1, 0], "o", color=color, ms=2.5, mec="white", mew=0.4)
    (xlo, xhi, _), (ylo, yhi, _) = grid.xbound, grid.ybound
    ax.set_xlim(yhi, ylo)
    ax.set_ylim(xlo, xhi)


def _map_base(channels: np.ndarray | None, class_names, n_objects: int) -> np.ndarray | None:
    """The map layers of (K, X, Y) channels (object channels left out) as an RGB picture, or None."""
    if channels is None or class_names is None or len(class_names) <= n_objects:
        return None
    return compose_layers(channels[n_objects:], list(class_names)[n_objects:])


def render_temporal_figure(
    window: Mapping[str, Any],
    pred: Mapping[str, Any],
    pred_instances: Any,
    grid: Grid | None = None,
    title: str | None = None,
    class_names=None,
    n_objects: int = 1,
) -> Figure:
    """A temporal window's picture: the present frame's cameras on top; below, the target and the prediction,
    each with map layers (when class_names has map classes), the present frame's vehicles in their instance
    colours and each vehicle's path over the future frames, and the predicted occupancy of every frame.

    window: one item (or a batch of one) with images (P+1, N, 3, H, W), instance (T, X, Y) and bev (K, X, Y);
    pred: "bev" (K, X, Y) and "segmentation" (T, X, Y) probabilities; pred_instances (T, X, Y) ids."""
    batched = _np(window["images"]).ndim == 6
    s = {k: (v[0] if batched and isinstance(v, (torch.Tensor, np.ndarray, list)) else v) for k, v in window.items()}
    present = s["images"][-1]
    cams = camera_grid(present, s.get("cam_ids"))
    gt_inst, pred_inst = _np(s["instance"]), _np(pred_instances)
    while pred_inst.ndim > 3:
        pred_inst = pred_inst[0]
    g = _grid_for(gt_inst.shape[-2:], _sample_grid(s, grid))
    seg = _np(pred["segmentation"]).reshape((-1,) + gt_inst.shape[-2:])
    fig = Figure(figsize=(12, 4.2 + 3.4), dpi=100)
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(2, 3, height_ratios=[cams.shape[0] / cams.shape[1] * 3, 1.0])
    _draw_cameras(fig.add_subplot(gs[0, :]), cams, {**s, "images": present}, title)
    target_map = _map_base(_target_channels(s["bev"], class_names), class_names, n_objects) if "bev" in s else None
    pred_map = _map_base(_pred_channels(pred["bev"]), class_names, n_objects) if pred.get("bev") is not None else None
    for col, (inst, base, name) in enumerate(((gt_inst, target_map, "target"), (pred_inst, pred_map, "prediction"))):
        ax = fig.add_subplot(gs[1, col])
        _draw_bev(
            ax,
            paint_instances(inst[0], base),
            g,
            f"{name}: vehicles now and their paths ({inst.shape[0] - 1} future frames)",
        )
        _draw_paths(ax, inst, g)
    ax = fig.add_subplot(gs[1, 2])
    occupied = seg >= 0.5
    first = np.where(occupied.any(axis=0), np.argmax(occupied, axis=0), np.nan)
    im = _draw_bev(
        ax, first, g, "predicted occupancy: first frame occupied", cmap="plasma", vmin=0, vmax=max(seg.shape[0] - 1, 1)
    )
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02, label="frame (0 = present)").ax.tick_params(labelsize=6)
    fig.tight_layout()
    return fig


def render_temporal(window: Mapping[str, Any], pred: Mapping[str, Any], pred_instances: Any, **kw) -> np.ndarray:
    """render_temporal_figure as an (H, W, 3) uint8 array (a GIF frame)."""
    fig = render_temporal_figure(window, pred, pred_instances, **kw)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def save_temporal_png(
    path: str | os.PathLike, window: Mapping[str, Any], pred: Mapping[str, Any], pred_instances: Any, **kw: Any
) -> str:
    """Write render_temporal_figure's picture of a window as ONE PNG, atomically. Returns the path."""
    fig = render_temporal_figure(window, pred, pred_instances, **kw)
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png")
    return os.fspath(path)


# --------------------------------------------------------------------------- a predicted sample's picture


def sample_picture(
    batch: Mapping[str, Any],
    i: int,
    layers: Mapping[str, Any],
    title: str | None = None,
    class_names=None,
    n_objects: int = 1,
):
    """Sample i of a batch drawn with the layers its model's tasks give (bev.tasks.task.Task.picture_layers), a
    Figure or an RGB array: a voxel volume ("volume": class ids) as top-down and side views beside the cameras;
    a window's predictions ("window", with "instances") as render_temporal_figure's vehicles and paths; else
    render_figure's cameras and BEV with the maps ("pred") and 3D boxes ("detections", "box_threshold")."""
    if "volume" in layers:
        return _volume_picture(batch, i, layers["volume"], title)
    if "window" in layers:
        window = layers["window"]
        return render_temporal_figure(
            batch_sample(batch, i),
            window,
            window["instances"],
            title=title,
            class_names=class_names,
            n_objects=n_objects,
        )
    return render_figure(batch_sample(batch, i), title=title, class_names=class_names, **layers)


def _volume_picture(batch: Mapping[str, Any], i: int, labels: Any, title: str | None) -> np.ndarray:
    """The cameras above the top-down and side views of the class ids `labels`, beside the camera-visible ground
    truth when the batch carries Occ3D labels (data.occupancy=true)."""
    from bev.tasks.occupancy.viz import render_occupancy

    cams = camera_grid(batch["images"][i], batch["cam_ids"][i] if "cam_ids" in batch else None)
    gt, seen = batch.get("occ_semantics"), batch.get("occ_mask_camera")
    return render_occupancy(labels, None if gt is None else gt[i], None if seen is None else seen[i], cams, title=title)


def picture_array(picture) -> np.ndarray:
    """A Figure (drawn) or an RGB array as an (H, W, 3) uint8 array."""
    if not isinstance(picture, Figure):
        return picture
    picture.canvas.draw()
    return np.asarray(picture.canvas.buffer_rgba())[..., :3].copy()


def save_picture(path: str | os.PathLike, picture) -> str:
    """Write a Figure (savefig) or an RGB array as ONE PNG, atomically. Returns the path."""
    if not isinstance(picture, Figure):
        return save_png(path, picture)
    with atomic_open(path, "wb") as f:
        picture.savefig(f, format="png")
    return os.fspath(path)


# --------------------------------------------------------------------------- 3D boxes (detection)


def detection_color(label: int) -> tuple[int, int, int]:
    """The RGB colour of DETECTION_CLASSES[label]."""
    from bev.classes import DETECTION_CLASSES

    return DETECTION_COLORS[DETECTION_CLASSES[int(label)]]


def box_detections(det: Mapping[str, Any] | None, threshold: float | None = None) -> dict[str, np.ndarray] | None:
    """One sample's boxes as numpy: {"boxes" (K, 9), "labels" (K,), "scores" (K,) or absent (ground truth),
    "velocity_valid" (K,) bool}; padding rows (label < 0) and, with a threshold, lower scores are left out."""
    if det is None:
        return None
    boxes = _np(det["boxes"]).reshape(-1, 9)
    labels = np.asarray(det["labels"].cpu() if torch.is_tensor(det["labels"]) else det["labels"]).reshape(-1)
    keep = labels >= 0
    out = {"boxes": boxes, "labels": labels.astype(np.int64)}
    if det.get("scores") is not None:
        out["scores"] = _np(det["scores"]).reshape(-1)
        if threshold is not None:
            keep &= out["scores"] >= threshold
    valid = det.get("velocity_valid")
    out["velocity_valid"] = np.ones(len(labels), bool) if valid is None else _np(valid).reshape(-1) > 0
    return {k: v[keep] for k, v in out.items()}


def _in_grid(det: dict[str, np.ndarray] | None, grid: Grid) -> dict[str, np.ndarray] | None:
    """The boxes of `det` whose centre lies in the BEV grid."""
    if det is None:
        return None
    (xlo, xhi, _), (ylo, yhi, _) = grid.xbound, grid.ybound
    x, y = det["boxes"][:, 0], det["boxes"][:, 1]
    keep = (x >= xlo) & (x < xhi) & (y >= ylo) & (y < yhi)
    return {k: v[keep] for k, v in det.items()}


def sample_gt_boxes(s: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
    """The ground-truth boxes an (unbatched) item carries with data.detection=true, else None."""
    if s.get("det_boxes") is None or s.get("det_labels") is None:
        return None
    return box_detections(
        {"boxes": s["det_boxes"], "labels": s["det_labels"], "velocity_valid": s.get("det_velocity_valid")}
    )


def draw_boxes_bev(ax, det: Mapping[str, np.ndarray] | None, grid: Grid, gt: bool = False) -> None:
    """Boxes of box_detections in a BEV panel of _draw_bev (horizontal = ego y, left positive; up = ego x):
    the footprint, a heading tick from the centre to the front, a velocity arrow (ARROW_SECONDS ahead) and,
    for predictions, the score. Ground truth is dashed and thinner."""
    from matplotlib.collections import LineCollection
    from matplotlib.patches import FancyArrowPatch

    if det is None or not len(det["boxes"]):
        return
    style = GT_STYLE if gt else PRED_STYLE
    boxes = det["boxes"].astype(np.float64)
    colors = np.asarray([detection_color(label) for label in det["labels"]]) / 255
    corners = box_corners(boxes)[:, :4, :2]
    rings = np.concatenate([corners, corners[:, :1]], axis=1)[..., ::-1]  # (K, 5, 2) as (y, x): screen order
    half = boxes[:, 4:5] / 2 * np.concatenate([np.cos(boxes[:, 6:7]), np.sin(boxes[:, 6:7])], axis=1)
    ticks = np.stack([boxes[:, :2], boxes[:, :2] + half], axis=1)[..., ::-1]  # centre -> middle of the front
    ax.add_collection(LineCollection(list(rings), colors=colors, linewidths=style["lw"], linestyles=style["ls"]))
    ax.add_collection(LineCollection(list(ticks), colors=colors, linewidths=style["lw"]))
    speed = np.hypot(boxes[:, 7], boxes[:, 8])
    for k in np.flatnonzero(det["velocity_valid"] & (speed >= MIN_ARROW_SPEED)):
        x, y, vx, vy = boxes[k, [0, 1, 7, 8]]
        tip = (y + vy * ARROW_SECONDS, x + vx * ARROW_SECONDS)
        ax.add_patch(FancyArrowPatch((y, x), tip, arrowstyle="->", mutation_scale=6, color=colors[k], lw=style["lw"]))
    if "scores" in det and not gt:
        for k in range(len(boxes)):
            y, x = rings[k, 0]
            ax.text(y, x, f"{det['scores'][k]:.2f}", color=colors[k], fontsize=5, clip_on=True)
    (xlo, xhi, _), (ylo, yhi, _) = grid.xbound, grid.ybound
    ax.set_xlim(yhi, ylo)
    ax.set_ylim(xlo, xhi)


def box_edges_in_image(boxes: Any, intrinsics, rots, trans, post_rots, post_trans, near: float = NEAR_PLANE):
    """(N, 9) ego boxes -> (N, 12, 2, 2) pixel (u, v) of both ends of each edge of BOX_EDGES in one camera
    (its calibration and augmentation, as the model takes them), each edge clipped to depth >= near; edges
    wholly behind that plane are NaN. Pixels are those of the augmented image (bev.geometry.ego_to_image)."""

    corners = box_corners(boxes)
    ends = corners[:, np.asarray(BOX_EDGES)]  # (N, 12, 2, 3)
    cam = [torch.as_tensor(_np(t), dtype=torch.float64) for t in (intrinsics, rots, trans, post_rots, post_trans)]
    _, depth = ego_to_image(torch.from_numpy(ends.reshape(-1, 3)), *cam)
    depth = depth.numpy().reshape(ends.shape[:3])  # (N, 12, 2)
    # Depth is affine along an edge: an end behind the near plane moves to where the edge crosses it.
    d0, d1 = depth[..., 0:1], depth[..., 1:2]
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.clip((near - d0) / (d1 - d0), 0.0, 1.0)  # 0 at end 0, 1 at end 1
    p0, p1 = ends[..., 0, :], ends[..., 1, :]
    clipped = np.stack([np.where(d0 < near, p0 + t * (p1 - p0), p0), np.where(d1 < near, p0 + t * (p1 - p0), p1)], 2)
    uv, _ = ego_to_image(torch.from_numpy(np.nan_to_num(clipped).reshape(-1, 3)), *cam)
    uv = uv.numpy().reshape(ends.shape[:3] + (2,))
    uv[(depth < near).all(-1)] = np.nan
    return uv


def draw_boxes_cameras(ax, det: Mapping[str, np.ndarray] | None, s: Mapping[str, Any], gt: bool = False) -> None:
    """Boxes of box_detections projected into the camera picture of _draw_cameras (the 12 edges, clipped to
    the near plane and to each camera's slot); ground truth dashed and thinner."""
    from matplotlib.collections import LineCollection
    from matplotlib.patches import Rectangle

    if det is None or not len(det["boxes"]) or any(s.get(k) is None for k in _CAMERA_KEYS):
        return
    H, W = s["images"].shape[-2:]
    ids = camera_slots(s["images"].shape[0], s.get("cam_ids"))
    cols = camera_layout(max(ids) + 1)[1]
    colors = np.asarray([detection_color(label) for label in det["labels"]]) / 255
    style = GT_STYLE if gt else PRED_STYLE
    for n, slot in enumerate(ids):
        uv = box_edges_in_image(det["boxes"], *(s[k][n] for k in _CAMERA_KEYS))  # (K, 12, 2, 2)
        seen = np.isfinite(uv).all(axis=(2, 3))
        if not seen.any():
            continue
        r, col = divmod(slot, cols)
        segs = uv[seen] + np.array([col * W, r * H])
        lines = LineCollection(
            segs, colors=np.repeat(colors, 12, axis=0)[seen.reshape(-1)], linewidths=style["lw"], linestyles=style["ls"]
        )
        ax.add_collection(lines)  # first: add_collection clips to the axes, replacing an earlier clip box
        lines.set_clip_path(Rectangle((col * W - 0.5, r * H - 0.5), W, H, transform=ax.transData))
    rows = camera_layout(max(ids) + 1)[0]
    ax.set_xlim(-0.5, cols * W - 0.5)
    ax.set_ylim(rows * H - 0.5, -0.5)


_CAMERA_KEYS = ("intrinsics", "rots", "trans", "post_rots", "post_trans")
MAX_DRAWN_POINTS = 30_000  # a random subset beyond this: the picture is the same, matplotlib much faster


def sample_points(sample: Mapping[str, Any]) -> np.ndarray | None:
    """The LiDAR points (M, 3) x, y, z in the ego frame of a sample (its "points": batch_sample's rows, or an
    item's (M, 5)), at most MAX_DRAWN_POINTS of them; None without points."""
    pts = sample.get("points")
    if pts is None:
        return None
    pts = _np(pts).astype(np.float64)
    xyz = pts[:, 1:4] if pts.shape[1] == 6 else pts[:, :3]  # collated rows start with the batch index
    xyz = xyz[np.isfinite(xyz).all(1)]
    if len(xyz) > MAX_DRAWN_POINTS:
        xyz = xyz[np.random.default_rng(0).choice(len(xyz), MAX_DRAWN_POINTS, replace=False)]
    return xyz


def draw_points_bev(ax, points: np.ndarray | None, grid: Grid) -> None:
    """LiDAR points as small white dots in a BEV panel of _draw_bev (over the layers' colours)."""
    if points is None or not len(points):
        return
    ax.scatter(points[:, 1], points[:, 0], c="white", s=0.4, lw=0, alpha=0.6)
    (xlo, xhi, _), (ylo, yhi, _) = grid.xbound, grid.ybound
    ax.set_xlim(yhi, ylo)
    ax.set_ylim(xlo, xhi)


def draw_points_cameras(ax, points: np.ndarray | None, s: Mapping[str, Any]) -> None:
    """LiDAR points projected into each camera of the picture of _draw_cameras, coloured by depth (near warm)."""
    if points is None or not len(points) or any(s.get(k) is None for k in _CAMERA_KEYS):
        return
    H, W = s["images"].shape[-2:]
    ids = camera_slots(s["images"].shape[0], s.get("cam_ids"))
    cols = camera_layout(max(ids) + 1)[1]
    xyz = torch.from_numpy(points)
    for n, slot in enumerate(ids):
        cam = [torch.as_tensor(_np(s[k][n]), dtype=torch.float64) for k in _CAMERA_KEYS]
        uv, depth = (t.numpy() for t in ego_to_image(xyz, *cam))
        keep = (depth > NEAR_PLANE) & (uv[:, 0] >= 0) & (uv[:, 0] < W) & (uv[:, 1] >= 0) & (uv[:, 1] < H)
        if keep.any():
            r, col = divmod(slot, cols)
            u, v = uv[keep, 0] + col * W, uv[keep, 1] + r * H
            ax.scatter(u, v, c=depth[keep], cmap="turbo_r", s=0.8, lw=0, vmin=0, vmax=50)
    rows = camera_layout(max(ids) + 1)[0]
    ax.set_xlim(-0.5, cols * W - 0.5)
    ax.set_ylim(rows * H - 0.5, -0.5)


def _box_legend_handles(dets) -> list:
    """Legend entries: the classes of the boxes drawn, then what solid and dashed lines mean."""
    from matplotlib.lines import Line2D

    from bev.classes import DETECTION_CLASSES

    labels = sorted({int(label) for d in dets if d is not None for label in d["labels"]})
    handles = [
        Line2D([], [], color=np.asarray(detection_color(k)) / 255, lw=2, label=DETECTION_CLASSES[k]) for k in labels
    ]
    if handles:
        handles.append(Line2D([], [], color="black", label="prediction (score)", **PRED_STYLE))
        handles.append(Line2D([], [], color="black", label="ground truth", **GT_STYLE))
    return handles
