"""Occupancy pictures: the top-down view shows the highest occupied voxel's class, the side view the first one
seen from the left, oriented as the project's BEV pictures."""

import numpy as np

from bev.tasks.occupancy.grid import CLASS_ID, FREE, OCC_SHAPE
from bev.tasks.occupancy.viz import OCC3D_COLORS, colorize, render_occupancy, side_class, top_class, top_image


def _scene():
    sem = np.full(OCC_SHAPE, FREE, np.uint8)
    sem[:, :, 2] = CLASS_ID["driveable_surface"]  # the ground layer
    sem[150:160, 90:100, 2:6] = CLASS_ID["car"]  # a car ahead, on the road
    sem[150:152, 90:92, 9] = CLASS_ID["manmade"]  # a sign above part of it
    return sem


def test_top_view_takes_the_highest_occupied_voxel():
    sem = _scene()
    top = top_class(sem)
    assert top.shape == OCC_SHAPE[:2]
    assert top[0, 0] == CLASS_ID["driveable_surface"] and top[155, 95] == CLASS_ID["car"]
    assert top[150, 90] == CLASS_ID["manmade"]
    assert (top_class(np.full(OCC_SHAPE, FREE, np.uint8)) == FREE).all()
    # Only what is observed: the unobserved car disappears, the road under it shows.
    observed = np.ones(OCC_SHAPE, bool)
    observed[150:160, 90:100, 3:] = False
    assert top_class(sem, observed)[155, 95] == CLASS_ID["car"]  # its bottom layer (k = 2) is observed
    observed[150:160, 90:100, 2] = False
    assert top_class(sem, observed)[155, 95] == FREE
    sem[0, 0, 5] = 255  # unlabelled voxels are not drawn
    assert top_class(sem)[0, 0] == CLASS_ID["driveable_surface"]


def test_side_view_takes_the_first_voxel_from_the_left():
    sem = _scene()
    side = side_class(sem)
    assert side.shape == (OCC_SHAPE[0], OCC_SHAPE[2])
    assert (
        side[155, 4] == CLASS_ID["car"] and side[155, 2] == CLASS_ID["driveable_surface"]
    )  # the road at y = +40 first
    assert side[10, 4] == FREE and side[151, 9] == CLASS_ID["manmade"]


def test_picture_is_oriented_forward_up_left_left():
    sem = np.full(OCC_SHAPE, FREE, np.uint8)
    sem[190:, 190:, 3] = CLASS_ID["car"]  # the front-left corner of the grid
    top = top_image(sem)
    car = np.all(top == OCC3D_COLORS[CLASS_ID["car"]], axis=-1)
    assert car[:10, :10].all() and car.sum() == 100  # shown at the top left
    img = render_occupancy(sem, sem, np.ones(OCC_SHAPE, bool), cameras=np.zeros((20, 60, 3), np.uint8))
    assert img.dtype == np.uint8 and img.ndim == 3 and np.all(img == OCC3D_COLORS[CLASS_ID["car"]], axis=-1).any()
    assert (colorize(np.array([FREE, 4])) == OCC3D_COLORS[[FREE, 4]]).all()
