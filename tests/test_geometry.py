import math

import numpy as np
import pytest
import torch
from pyquaternion import Quaternion

from bev.data.rig import load_rig
from bev.geometry import (
    CAMERA_NAMES,
    MAX_CELLS_PER_AXIS,
    Grid,
    ego_to_image,
    frustum_to_ego,
    make_frustum,
    quaternion_to_matrix,
    voxel_coords,
)


def rig_tensors():
    rig = load_rig()
    cams = [rig["cameras"][n] for n in CAMERA_NAMES]
    K = torch.tensor([c["camera_intrinsic"] for c in cams], dtype=torch.float64)
    R = torch.tensor(np.stack([quaternion_to_matrix(c["rotation"]) for c in cams]), dtype=torch.float64)
    t = torch.tensor([c["translation"] for c in cams], dtype=torch.float64)
    return K, R, t


def test_camera_order_matches_rig():
    assert list(CAMERA_NAMES) == load_rig()["camera_order"]


@pytest.mark.parametrize("seed", range(5))
def test_quaternion_matches_pyquaternion(seed):
    q = np.random.default_rng(seed).normal(size=4)
    np.testing.assert_allclose(quaternion_to_matrix(q), Quaternion(q / np.linalg.norm(q)).rotation_matrix, atol=1e-12)


def test_grid_defaults_and_validation():
    g = Grid()
    assert g.bev_shape == (200, 200) and g.voxel_shape == (1, 200, 200) and g.depth_bins == 41
    assert Grid.from_any(
        {"xbound": [-10, 10, 1], "ybound": [-5, 5, 0.5], "zbound": [-2, 2, 4], "dbound": [1, 5, 1]}
    ).voxel_shape == (1, 20, 20)
    with pytest.raises(ValueError, match="xbound step"):
        Grid(xbound=(-1, 1, 0))
    with pytest.raises(ValueError, match="ybound needs hi > lo"):
        Grid(ybound=(1, -1, 0.5))
    with pytest.raises(ValueError, match="whole number"):
        Grid(xbound=(0, 1, 0.3))
    with pytest.raises(ValueError, match="bad grid config"):
        Grid.from_any({"xbound": [0, 1, 1], "nonsense": 1})


def test_voxel_coords_floor_not_truncation():
    g = Grid(xbound=(-2, 2, 1), ybound=(-2, 2, 1), zbound=(-1, 1, 2))
    pts = torch.tensor([[-0.5, 0.5, 0.0], [-2.0, 1.999, -1.0], [-2.01, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    zxy = voxel_coords(pts, g)
    # x=-0.5 is in cell 1 ([-1, 0)), not cell 2 as truncation toward zero would give
    assert zxy[0].tolist() == [0, 1, 2]
    assert zxy[1].tolist() == [0, 0, 3]
    assert zxy[2, 1] == -1  # just below lo stays outside
    assert zxy[3, 1] == 4  # hi is outside
    assert zxy[4, 0] == 1  # z hi is outside


def test_voxel_coords_nonfinite_map_outside():
    g = Grid()
    zxy = voxel_coords(torch.tensor([[math.nan, 0.0, 0.0], [math.inf, 0.0, 0.0], [-math.inf, 0.0, 0.0]]), g)
    assert ((zxy[:, 1] < 0) | (zxy[:, 1] >= g.nx)).all()


def test_frustum_centres_and_shape():
    g = Grid(dbound=(4, 8, 1))
    f = make_frustum((32, 64), 16, g)
    assert f.shape == (4, 2, 4, 3)
    assert f[0, 0, 0].tolist() == [7.5, 7.5, 4.0]
    assert f[3, 1, 3].tolist() == [55.5, 23.5, 7.0]
    with pytest.raises(ValueError, match="divisible"):
        make_frustum((30, 64), 16, g)


def test_front_camera_sees_forward():
    """A point 20 m ahead of the ego projects into CAM_FRONT near its principal point, with depth ~18.3 m."""
    K, R, t = rig_tensors()
    i = CAMERA_NAMES.index("CAM_FRONT")
    p = torch.tensor([[20.0, t[i, 1].item(), t[i, 2].item()]], dtype=torch.float64)
    uv, depth = ego_to_image(
        p, K[i], R[i], t[i], torch.eye(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    )
    assert abs(depth.item() - (20.0 - t[i, 0].item())) < 0.2
    assert abs(uv[0, 0].item() - K[i, 0, 2].item()) < 25 and abs(uv[0, 1].item() - K[i, 1, 2].item()) < 25


def test_frustum_roundtrip_with_augmentation():
    """frustum_to_ego followed by an independent projection returns the frustum's pixels and depths."""
    K, R, t = rig_tensors()
    g = Grid(dbound=(4, 45, 5))
    f = make_frustum((128, 352), 16, g).double()
    rng = np.random.default_rng(0)
    post_rots = torch.zeros(1, 6, 3, 3, dtype=torch.float64)
    post_trans = torch.zeros(1, 6, 3, dtype=torch.float64)
    for n in range(6):
        a, s = rng.uniform(-0.1, 0.1), rng.uniform(0.19, 0.23)
        flip = -1.0 if n % 2 else 1.0
        post_rots[0, n, :2, :2] = torch.tensor(
            [[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]]
        ) @ torch.tensor([[s * flip, 0], [0, s]])
        post_rots[0, n, 2, 2] = 1
        post_trans[0, n, :2] = torch.tensor(rng.uniform(-60, 60, size=2))
    pts = frustum_to_ego(f, K[None], R[None], t[None], post_rots, post_trans)
    assert pts.shape == (1, 6, *f.shape)
    for n in range(6):
        uv, depth = ego_to_image(pts[0, n].reshape(-1, 3), K[n], R[n], t[n], post_rots[0, n], post_trans[0, n])
        torch.testing.assert_close(uv, f[..., :2].reshape(-1, 2))
        torch.testing.assert_close(depth, f[..., 2].reshape(-1))


@pytest.mark.parametrize("axis", ["xbound", "ybound", "zbound", "dbound"])
def test_grid_too_large_names_axis_count_and_limit(axis):
    with pytest.raises(ValueError) as e:
        Grid(**{axis: (0.0, 2.0**31 * 1e-3, 1e-3)})  # 2**31 cells: int32 indices would overflow
    msg = str(e.value)
    assert axis in msg and "2147483648 cells" in msg and f"limit of {MAX_CELLS_PER_AXIS}" in msg, msg


def test_grid_total_cells_limited():
    n = MAX_CELLS_PER_AXIS
    with pytest.raises(ValueError, match="voxels"):
        Grid(xbound=(0, n, 1), ybound=(0, n, 1), zbound=(0, n, 1))


@pytest.mark.parametrize("bound", [(0.0, float("inf"), 1.0), (float("nan"), 1.0, 0.5), (0.0, 1.0, float("inf"))])
def test_grid_non_finite_bounds(bound):
    with pytest.raises(ValueError, match="finite"):
        Grid(xbound=bound)


def test_matrix_to_quaternion_inverts_quaternion_to_matrix_and_agrees_with_pyquaternion():
    from pyquaternion import Quaternion

    from bev.geometry import matrix_to_quaternion, quaternion_to_matrix

    rng = np.random.default_rng(0)
    qs = [q / np.linalg.norm(q) for q in rng.normal(size=(200, 4))]
    qs += [
        np.array([0.0, 1.0, 0.0, 0.0]),
        np.array([0.0, 0.0, 0.0, 1.0]),
        np.array([1e-9, 0.6, 0.0, 0.8]),
    ]  # 180 deg turns
    for q in qs:
        R = quaternion_to_matrix(q)
        r = matrix_to_quaternion(R)
        assert r[0] >= 0 and np.allclose(quaternion_to_matrix(r), R, atol=1e-9)
        assert abs(np.dot(Quaternion(matrix=R, atol=1e-7).elements, r)) == pytest.approx(1.0, abs=1e-9)
