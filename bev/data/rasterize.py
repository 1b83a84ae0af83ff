"""BEV rasterisation of box footprints.

Definition of "filled": a cell is filled by a box when the cell's CENTRE lies inside the
box footprint or on its boundary (closed polygon, tolerance 1e-9 m). The footprint is the
box's base rectangle (length along its heading, width across it) in the ego xy plane.
Cells follow bev.geometry.Grid: index i covers [lo + i*step, lo + (i+1)*step), arrays are
indexed [x_index, y_index]. This is exact and resolution independent, unlike cv2.fillPoly
on rounded corner pixels (which grows every box by up to a cell).

raster="lss" reproduces lift-splat-shoot's target instead (published LSS-family IoUs use it):
corners go to continuous cell coordinates (p - lo) / step, are rounded to the nearest integer
(np.round, half to even) and the polygon is filled with cv2.fillPoly, boundary cells included.
It grows a box by about one cell per axis; the nuScenes devkit rasterises map polygons the same way.
"""

from __future__ import annotations

import numpy as np

from bev.geometry import Grid

_EPS = 1e-9
RASTERS = ("center", "lss")


def box_footprints(centers: np.ndarray, sizes: np.ndarray, rotations: np.ndarray) -> np.ndarray:
    """(N, 4, 2) ego xy corners of box bases, counter-clockwise.

    centers (N, 3) ego metres; sizes (N, 3) nuScenes (w, l, h); rotations (N, 3, 3) box->ego.
    The box's local x axis is its length (heading), local y its width.
    """
    centers = np.asarray(centers, dtype=np.float64).reshape(-1, 3)
    sizes = np.asarray(sizes, dtype=np.float64).reshape(-1, 3)
    rotations = np.asarray(rotations, dtype=np.float64).reshape(-1, 3, 3)
    w, l = sizes[:, 0], sizes[:, 1]
    sx = np.array([1.0, -1.0, -1.0, 1.0])
    sy = np.array([1.0, 1.0, -1.0, -1.0])
    local = np.stack([sx[None] * l[:, None] / 2, sy[None] * w[:, None] / 2, np.zeros((len(w), 4))], axis=-1)
    corners = np.einsum("nij,nkj->nki", rotations, local) + centers[:, None, :]
    return corners[..., :2]


def polygon_cells(poly: np.ndarray, grid: Grid) -> tuple[np.ndarray, np.ndarray]:
    """(x_index, y_index) arrays of the cells whose centre lies in the closed CONVEX polygon."""
    poly = np.asarray(poly, dtype=np.float64)
    (xlo, _, xs), (ylo, _, ys) = grid.xbound, grid.ybound
    # Candidate cells: those whose centre lies in the polygon's bounding box.
    i0 = max(int(np.ceil((poly[:, 0].min() - xlo) / xs - 0.5 - 1e-6)), 0)
    i1 = min(int(np.floor((poly[:, 0].max() - xlo) / xs - 0.5 + 1e-6)), grid.nx - 1)
    j0 = max(int(np.ceil((poly[:, 1].min() - ylo) / ys - 0.5 - 1e-6)), 0)
    j1 = min(int(np.floor((poly[:, 1].max() - ylo) / ys - 0.5 + 1e-6)), grid.ny - 1)
    if i1 < i0 or j1 < j0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    ii, jj = np.meshgrid(np.arange(i0, i1 + 1), np.arange(j0, j1 + 1), indexing="ij")
    px = xlo + (ii + 0.5) * xs
    py = ylo + (jj + 0.5) * ys
    edges = np.roll(poly, -1, axis=0) - poly  # (K, 2)
    # Cross product of each edge with (centre - edge start): one sign inside a convex polygon.
    cross = edges[:, 0, None, None] * (py[None] - poly[:, 1, None, None]) - edges[:, 1, None, None] * (
        px[None] - poly[:, 0, None, None]
    )
    inside = np.all(cross >= -_EPS, axis=0) | np.all(cross <= _EPS, axis=0)
    area2 = float(np.sum(poly[:, 0] * np.roll(poly[:, 1], -1) - np.roll(poly[:, 0], -1) * poly[:, 1]))
    if abs(area2) <= _EPS:  # degenerate (zero-area) footprint fills nothing
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return ii[inside], jj[inside]


def lss_fill(canvas: np.ndarray, poly: np.ndarray, value: int, grid: Grid) -> None:
    """Set the cells lift-splat-shoot fills for a polygon (corners rounded, cv2.fillPoly) to `value`,
    in place, on an (X, Y) canvas (uint8 or int32). Later fills overwrite earlier ones."""
    import cv2

    lo = np.array([grid.xbound[0], grid.ybound[0]])
    step = np.array([grid.xbound[2], grid.ybound[2]])
    pts = np.round((np.asarray(poly, dtype=np.float64) - lo) / step).astype(np.int32)
    cv2.fillPoly(canvas, [np.ascontiguousarray(pts[:, ::-1])], int(value))  # cv2 (col, row) = (y_index, x_index)


def lss_polygon_mask(poly: np.ndarray, grid: Grid) -> np.ndarray:
    """(X, Y) bool: the cells lift-splat-shoot fills for a polygon (corners rounded, cv2.fillPoly)."""
    mask = np.zeros(grid.bev_shape, dtype=np.uint8)
    lss_fill(mask, poly, 1, grid)
    return mask.astype(bool)


def check_raster(raster: str) -> str:
    if raster not in RASTERS:
        raise ValueError(f"unknown data.raster {raster!r}; choose one of {', '.join(RASTERS)}")
    return raster


def rasterize_boxes(
    footprints: np.ndarray,
    labels: np.ndarray,
    visibility: np.ndarray,
    grid: Grid,
    num_classes: int = 1,
    raster: str = "center",
) -> tuple[np.ndarray, np.ndarray]:
    """Fill box footprints on the grid (raster "center": cell centres inside; "lss": LSS's rule).

    footprints (N, 4, 2) ego xy; labels (N,) class index in [0, num_classes) (others skipped);
    visibility (N,) nuScenes level 1-4. Returns bev (num_classes, X, Y) float32 in {0, 1} and
    visibility (X, Y) uint8: the highest level among the target boxes covering a cell, 0 where
    none (so a cell shared by a hidden and a visible vehicle counts as visible).
    """
    bev = np.zeros((num_classes, grid.nx, grid.ny), dtype=np.float32)
    vis = np.zeros((grid.nx, grid.ny), dtype=np.uint8)
    for poly, k, v in zip(np.asarray(footprints), np.asarray(labels), np.asarray(visibility)):
        if not 0 <= int(k) < num_classes:
            continue
        ii, jj = (
            polygon_cells(poly, grid) if check_raster(raster) == "center" else np.nonzero(lss_polygon_mask(poly, grid))
        )
        bev[int(k), ii, jj] = 1.0
        vis[ii, jj] = np.maximum(vis[ii, jj], np.uint8(v))
    return bev, vis
