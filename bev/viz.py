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
from bev.geometry import CAMERA_NAMES, Grid
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
    """Sample i of a collated batch, kept batched (size 1), as render_sample and save_sample_png take it."""
    return {k: v[i : i + 1] if torch.is_tensor(v) or isinstance(v, list) else v for k, v in batch.items()}


def _unbatch(sample: Mapping[str, Any]) -> tuple[dict, bool]:
    batched = (
        sample["images"].dim() == 5 if isinstance(sample["images"], torch.Tensor) else np.ndim(sample["images"]) == 5
    )
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
    sample: Mapping[str, Any], pred: Any = None, grid: Grid | None = None, title: str | None = None, class_names=None
) -> Figure:
    """A matplotlib Figure: the cameras on top; BEV target (+ prediction and TP/FP/FN map) below.

    class_names (one per bev channel) turns on the coloured layer view; the TP/FP/FN map is always
    the first channel's (the first object class)."""
    s, _ = _unbatch(sample)
    cams = camera_grid(s["images"], s.get("cam_ids"))
    channels = _target_channels(s["bev"], class_names)
    layers = (
        class_names if class_names is not None and len(class_names) > 1 else None
    )  # one class: the grey/viridis view
    target = channels[0] if layers is not None else channels.max(axis=0)
    g = _grid_for(target.shape, _sample_grid(s, grid))
    fig = Figure(figsize=(12, 4.2 + 3.2), dpi=100)
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(2, 3, height_ratios=[cams.shape[0] / cams.shape[1] * 3, 1.0])
    _draw_cameras(fig.add_subplot(gs[0, :]), cams, s, title)
    if layers is not None:
        _draw_bev(fig.add_subplot(gs[1, 0]), compose_layers(channels, layers), g, "BEV target")
    else:
        _draw_bev(fig.add_subplot(gs[1, 0]), target, g, "BEV target", cmap="gray", vmin=0, vmax=1)
    if pred is not None:
        probs = _pred_channels(pred)
        prob = probs[0] if probs.ndim > 2 else probs  # the first class's, for the error map
        if prob.shape != target.shape:
            raise ValueError(f"prediction shape {prob.shape} does not match the BEV target {target.shape}")
        _draw_prediction(fig, gs[1, 1], probs, prob, channels, g, layers)
        _draw_errors(fig.add_subplot(gs[1, 2]), prob, target, g, layers[0] if layers is not None else "vehicle")
    fig.tight_layout()
    if layers is not None:
        _add_legend(fig, layers)
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


def _draw_prediction(
    fig: Figure, cell, probs: np.ndarray, prob: np.ndarray, channels: np.ndarray, grid: Grid, layers
) -> None:
    """The prediction panel: every layer blended by its probability (layers given), else P(vehicle) with a colorbar."""
    if layers is not None:
        if probs.shape != channels.shape:
            raise ValueError(f"prediction shape {probs.shape} does not match the BEV target {channels.shape}")
        _draw_bev(fig.add_subplot(cell), compose_layers(probs, layers), grid, "prediction (blended by probability)")
    else:
        im = _draw_bev(fig.add_subplot(cell), prob, grid, "prediction P(vehicle)", cmap="viridis", vmin=0, vmax=1)
        fig.colorbar(im, ax=fig.axes[-1], fraction=0.046, pad=0.02).ax.tick_params(labelsize=6)


def _draw_errors(ax, prob: np.ndarray, target: np.ndarray, grid: Grid, name: str) -> None:
    """The TP/FP/FN map of one class at threshold 0.5, titled with its IoU."""
    tp = int(((prob >= 0.5) & (target > 0.5)).sum())
    fp = int(((prob >= 0.5) & (target <= 0.5)).sum())
    fn = int(((prob < 0.5) & (target > 0.5)).sum())
    iou = tp / max(tp + fp + fn, 1)
    _draw_bev(ax, error_map(prob, target), grid, f"{name} @0.5 TP green, FP red, FN blue (IoU {iou:.3f})")


def _add_legend(fig: Figure, class_names) -> None:
    """A legend of the layer colours along the bottom of the figure."""
    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor=np.asarray(c) / 255, edgecolor="black", lw=0.5, label=n) for n, c in layer_colors(class_names)
    ]
    fig.subplots_adjust(bottom=0.1)
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), fontsize=7, frameon=False)


def render_sample(
    sample: Mapping[str, Any], pred: Any = None, grid: Grid | None = None, title: str | None = None, class_names=None
) -> np.ndarray:
    """The figure of `render_figure` as an (H, W, 3) uint8 array (for image loggers)."""
    fig = render_figure(sample, pred, grid, title, class_names)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def save_sample_png(
    path: str | os.PathLike,
    batch_or_sample: Mapping[str, Any],
    pred: Any = None,
    grid: Grid | None = None,
    title: str | None = None,
    class_names=None,
) -> str:
    """Write ONE PNG: the cameras + BEV target (+ prediction vs target when pred is given).

    A batch (images (B, Ncam, 3, H, W)) shows its first sample. pred: (1, X, Y) probability (or
    logits, or with a batch dim). Written atomically (temp file + os.replace). Returns the path.
    """
    fig = render_figure(batch_or_sample, pred, grid, title, class_names)
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png")
    path = os.fspath(path)
    return path


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
    from bev.instances import instance_paths

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
