"""Pictures of Occ3D volumes: a top-down view (the class of the highest occupied voxel of each column) and a side
view (the class of the first occupied voxel seen from the left, +y), prediction beside ground truth, optionally
beside the cameras. Orientation as bev.viz: forward (+x) up, left (+y) to the left of the picture."""

from __future__ import annotations

from typing import Any

import numpy as np

from bev.tasks.occupancy.grid import FREE, OCC3D_CLASSES, OCC_RANGE

# One colour per Occ3D class (RGB); free space is drawn as the background.
OCC3D_COLORS = np.array(
    [
        (0, 0, 0),  # others
        (255, 120, 50),  # barrier
        (255, 192, 203),  # bicycle
        (255, 255, 0),  # bus
        (0, 150, 245),  # car
        (0, 255, 255),  # construction_vehicle
        (200, 180, 0),  # motorcycle
        (255, 0, 0),  # pedestrian
        (255, 240, 150),  # traffic_cone
        (135, 60, 0),  # trailer
        (160, 32, 240),  # truck
        (255, 0, 255),  # driveable_surface
        (139, 137, 137),  # other_flat
        (75, 0, 75),  # sidewalk
        (150, 240, 80),  # terrain
        (230, 230, 250),  # manmade
        (0, 175, 0),  # vegetation
        (255, 255, 255),  # free
    ],
    dtype=np.uint8,
)


def _volume(semantics: Any, observed: Any = None) -> np.ndarray:
    """(200, 200, 16) uint8 ids as numpy; voxels not `observed` (and ids >= 18, e.g. 255) count as free."""
    sem = np.array(semantics.cpu() if hasattr(semantics, "cpu") else semantics, dtype=np.uint8)
    sem[sem > FREE] = FREE
    if observed is not None:
        obs = np.asarray(observed.cpu() if hasattr(observed, "cpu") else observed, dtype=bool)
        sem[~obs] = FREE
    return sem


def top_class(semantics: Any, observed: Any = None) -> np.ndarray:
    """(200, 200) uint8 [x, y]: the class of the highest occupied voxel of each column, FREE where none."""
    sem = _volume(semantics, observed)
    occupied = sem != FREE
    k = sem.shape[2] - 1 - np.argmax(occupied[:, :, ::-1], axis=2)  # highest occupied layer
    top = np.take_along_axis(sem, k[..., None], axis=2)[..., 0]
    return np.where(occupied.any(2), top, FREE).astype(np.uint8)


def side_class(semantics: Any, observed: Any = None) -> np.ndarray:
    """(200, 16) uint8 [x, z]: the class of the first occupied voxel along -y (seen from the left), FREE where none."""
    sem = _volume(semantics, observed)
    occupied = sem != FREE
    j = sem.shape[1] - 1 - np.argmax(occupied[:, ::-1, :], axis=1)  # the largest y occupied
    first = np.take_along_axis(sem, j[:, None, :], axis=1)[:, 0, :]
    return np.where(occupied.any(1), first, FREE).astype(np.uint8)


def colorize(ids: np.ndarray) -> np.ndarray:
    """Class ids -> RGB uint8 with OCC3D_COLORS."""
    return OCC3D_COLORS[np.minimum(np.asarray(ids), FREE)]


def top_image(semantics: Any, observed: Any = None) -> np.ndarray:
    """(200, 200, 3) uint8 top-down picture as shown: row 0 the front (largest x), column 0 the left (largest y)."""
    return colorize(top_class(semantics, observed))[::-1, ::-1]


def render_occupancy(
    pred: Any, gt: Any = None, observed: Any = None, cameras: np.ndarray | None = None, title: str | None = None
) -> np.ndarray:
    """An (H, W, 3) uint8 picture: top-down and side views of the prediction (and of the ground truth, both
    restricted to `observed` voxels, e.g. mask_camera, when given), a class legend, `cameras` (an RGB camera
    grid, e.g. bev.viz.camera_grid) above them when given, and `title` at the top when given."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    views = [("prediction", pred)] + ([("ground truth", gt)] if gt is not None else [])
    rows = 3 if cameras is not None else 2
    fig = Figure(figsize=(4.2 * len(views) + 2.2, 2.6 * rows + 1.4), dpi=100)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(rows, len(views), height_ratios=([2.2] if cameras is not None else []) + [4, 1])
    if cameras is not None:
        ax = fig.add_subplot(grid[0, :])
        ax.imshow(cameras)
        ax.set_axis_off()
    (xlo, ylo, zlo), (xhi, yhi, zhi) = OCC_RANGE[:3], OCC_RANGE[3:]
    for c, (name, vol) in enumerate(views):
        shown = observed if (observed is not None and name == "ground truth") else None
        ax = fig.add_subplot(grid[rows - 2, c])
        ax.imshow(top_image(vol, shown), extent=(yhi, ylo, xlo, xhi), interpolation="nearest")
        ax.set_title(f"{name}: top-down (highest voxel)", fontsize=8)
        ax.set_xlabel("y (m, left <)", fontsize=7)
        ax.set_ylabel("x (m, forward ^)", fontsize=7)
        ax.tick_params(labelsize=6)
        side = fig.add_subplot(grid[rows - 1, c])
        side.imshow(
            colorize(side_class(vol, shown)).transpose(1, 0, 2)[::-1],
            extent=(xlo, xhi, zlo, zhi),
            aspect="auto",
            interpolation="nearest",
        )
        side.set_title(f"{name}: side view from the left", fontsize=8)
        side.set_xlabel("x (m, forward >)", fontsize=7)
        side.tick_params(labelsize=6)
    handles = [Patch(color=OCC3D_COLORS[i] / 255.0, label=OCC3D_CLASSES[i]) for i in range(FREE)]
    fig.legend(handles=handles, loc="center right", fontsize=6, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.subplots_adjust(right=1 - 2.0 / fig.get_figwidth(), hspace=0.35)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
