"""BEV rasterisation: a cell is filled iff its centre lies in the (closed) box footprint."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib.path import Path as MplPath

from bev.data.rasterize import box_footprints, polygon_cells, rasterize_boxes
from bev.geometry import Grid, quaternion_to_matrix, yaw_to_quaternion


def _rot(yaw: float) -> np.ndarray:
    return quaternion_to_matrix(yaw_to_quaternion(yaw))


def test_known_axis_aligned_box_fills_exactly_its_cells():
    grid = Grid()  # x, y [-50, 50, 0.5] -> 200x200
    # Car at x=10.1, y=-3.3, length 4 (along x), width 2: x in [8.1, 12.1], y in [-4.3, -2.3].
    fp = box_footprints([[10.1, -3.3, 0.8]], [[2.0, 4.0, 1.6]], [_rot(0.0)])
    bev, vis = rasterize_boxes(fp, [0], [3], grid)
    # Centres are -49.75 + 0.5 i: x centres 8.25..11.75 -> i = 116..123, y centres -4.25..-2.75 -> j = 91..94.
    expected = np.zeros((200, 200), np.float32)
    expected[116:124, 91:95] = 1
    assert np.array_equal(bev[0], expected)
    assert np.array_equal(vis, (expected * 3).astype(np.uint8))


def test_small_grid_literal_cells_and_closed_boundary():
    grid = Grid(xbound=(0, 4, 1), ybound=(0, 4, 1))
    # Box x in [1, 3], y in [1.5, 2.5]: centres x 1.5, 2.5; y 1.5 and 2.5 lie ON the edges -> filled.
    fp = box_footprints([[2.0, 2.0, 0.0]], [[1.0, 2.0, 1.0]], [_rot(0.0)])
    ii, jj = polygon_cells(fp[0], grid)
    assert sorted(zip(ii.tolist(), jj.tolist())) == [(1, 1), (1, 2), (2, 1), (2, 2)]


def test_rotation_turns_length_onto_y():
    grid = Grid(xbound=(-5, 5, 1), ybound=(-5, 5, 1))  # centres -4.5 + k
    # Length 5 turned onto y, width 1 on x: x in [-0.3, 0.7], y in [-2.4, 2.6].
    fp = box_footprints([[0.2, 0.1, 0.0]], [[1.0, 5.0, 1.0]], [_rot(math.pi / 2)])
    bev, _ = rasterize_boxes(fp, [0], [4], grid)
    expected = np.zeros((10, 10), np.float32)
    expected[5, 3:8] = 1  # x centre 0.5; y centres -1.5 .. 2.5
    assert np.array_equal(bev[0], expected)


@settings(max_examples=60, deadline=None)
@given(
    cx=st.floats(-60, 60),
    cy=st.floats(-60, 60),
    yaw=st.floats(-math.pi, math.pi),
    w=st.floats(0.3, 4.0),
    l=st.floats(0.3, 15.0),
)
def test_matches_independent_point_in_polygon(cx, cy, yaw, w, l):
    grid = Grid()
    fp = box_footprints([[cx, cy, 0.0]], [[w, l, 1.5]], [_rot(yaw)])
    bev, _ = rasterize_boxes(fp, [0], [1], grid)
    centres = grid.cell_centers().reshape(-1, 2)
    path = MplPath(fp[0])
    # matplotlib's test is exclusive of boundaries; compare only cells clearly in or out.
    inside = path.contains_points(centres, radius=1e-6).reshape(grid.bev_shape)
    inside_grown = path.contains_points(centres, radius=-1e-6).reshape(grid.bev_shape)
    sure_in = inside & inside_grown
    sure_out = ~inside & ~inside_grown
    got = bev[0] > 0
    assert np.all(got[sure_in]) and not np.any(got[sure_out])


def test_boxes_outside_or_straddling_the_grid():
    grid = Grid()
    fp = box_footprints([[80.0, 0.0, 0.0], [-50.0, 49.9, 0.0]], [[2.0, 4.0, 1.0], [2.0, 2.0, 1.0]], [_rot(0), _rot(0)])
    bev, vis = rasterize_boxes(fp, [0, 0], [1, 2], grid)
    # Second box: x in [-51, -49] -> centres -49.75, -49.25 (i = 0, 1); y in [48.9, 50.9] -> centres 49.25, 49.75.
    assert sorted(zip(*[a.tolist() for a in np.nonzero(bev[0])])) == [(0, 198), (0, 199), (1, 198), (1, 199)]
    assert vis.max() == 2


def test_multiclass_labels_and_visibility_max():
    grid = Grid(xbound=(-4, 4, 1), ybound=(-4, 4, 1))
    fp = box_footprints([[0.0, 0.0, 0.0], [0.6, 0.0, 0.0], [3.0, 3.0, 0.0]], [[2.0, 2.0, 1.0]] * 3, [_rot(0)] * 3)
    bev, vis = rasterize_boxes(fp, [0, 1, 5], [1, 3, 4], grid, num_classes=2)
    assert bev.shape == (2, 8, 8) and bev.dtype == np.float32 and vis.dtype == np.uint8
    assert bev[0].sum() == 4 and bev[1].sum() == 4  # label 5 (no class) is skipped
    assert vis[4, 4] == 3 and vis[3, 3] == 1 and vis[7, 7] == 0  # overlap keeps the higher level


def test_degenerate_box_fills_nothing():
    grid = Grid()
    fp = box_footprints([[0.25, 0.25, 0.0]], [[0.0, 4.0, 1.0]], [_rot(0.3)])
    bev, _ = rasterize_boxes(fp, [0], [1], grid)
    assert bev.sum() == 0


def test_lss_raster_matches_a_hand_computed_lss_target():
    grid = Grid()
    # Same car as above: x in [8.1, 12.1], y in [-4.3, -2.3]. LSS: (p - lo) / step rounded ->
    # x 116.2 -> 116, 124.2 -> 124; y 91.4 -> 91, 95.4 -> 95; cv2.fillPoly fills the boundary too.
    fp = box_footprints([[10.1, -3.3, 0.8]], [[2.0, 4.0, 1.6]], [_rot(0.0)])
    bev, vis = rasterize_boxes(fp, [0], [3], grid, raster="lss")
    expected = np.zeros((200, 200), np.float32)
    expected[116:125, 91:96] = 1  # 9 x 5 cells where the centre rule gives 8 x 4
    assert np.array_equal(bev[0], expected) and np.array_equal(vis, (expected * 3).astype(np.uint8))
    # Rounding is NumPy's half-to-even, as LSS's np.round: on 1 m cells a corner at x = 2.5 -> 52.5 -> 52.
    g1 = Grid(xbound=(-50, 50, 1.0), ybound=(-50, 50, 1.0))
    fp = box_footprints([[1.5, 0.0, 0.0]], [[2.0, 2.0, 1.0]], [_rot(0.0)])  # x in [0.5, 2.5] -> 50.5, 52.5
    bev, _ = rasterize_boxes(fp, [0], [1], g1, raster="lss")
    assert sorted(set(np.nonzero(bev[0])[0].tolist())) == [50, 51, 52] and sorted(
        set(np.nonzero(bev[0])[1].tolist())
    ) == [49, 50, 51]


def test_lss_raster_of_a_rotated_box_against_lss_formula():
    import cv2

    grid = Grid()
    fp = box_footprints([[-7.3, 12.9, 0.0]], [[1.9, 4.6, 1.5]], [_rot(0.7)])
    bev, _ = rasterize_boxes(fp, [0], [1], grid, raster="lss")
    # lift-splat-shoot src/data.py get_binimg, literally: bx = lo + step/2, dx = step.
    bx, dx = np.array([-49.75, -49.75]), np.array([0.5, 0.5])
    pts = np.round((fp[0] - bx + dx / 2.0) / dx).astype(np.int32)
    pts[:, [1, 0]] = pts[:, [0, 1]]
    img = np.zeros((200, 200))
    cv2.fillPoly(img, [pts], 1.0)
    assert np.array_equal(bev[0], img.astype(np.float32)) and img.sum() > 40
    with pytest.raises(ValueError, match="unknown data.raster 'corner'"):
        rasterize_boxes(fp, [0], [1], grid, raster="corner")
