"""data.occupancy=true: items carry the Occ3D labels of their sample, a missing download is one clear error, and a
BEV augmentation moves the voxel labels with everything else."""

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from bev.data.bev_aug import bev_matrix
from bev.tasks.occupancy.data import IGNORE, warp_voxels
from bev.tasks.occupancy.grid import FREE, OCC_SHAPE
from bev.tasks.occupancy.io import labels_path, read_labels


def _samples_of(root: Path) -> list[tuple[str, int, list[str]]]:
    """(scene name, scene number in the writer's order, sample tokens in time order) of a synthetic set."""
    from bev.synthetic.writer import scene_names
    from helpers.synthetic import SCENES

    tables = root / "v1.0-mini"
    scenes = json.loads((tables / "scene.json").read_text())
    samples = json.loads((tables / "sample.json").read_text())
    order = scene_names(SCENES)
    out = []
    for sc in scenes:
        own = sorted((s for s in samples if s["scene_token"] == sc["token"]), key=lambda s: s["timestamp"])
        out.append((sc["name"], order.index(sc["name"]), [s["token"] for s in own]))
    return out


def link_copy(src: Path, dst: Path) -> Path:
    """A dataroot at dst that links to every entry of src but its index cache and occupancy labels: the synthetic set
    without copying it, and without labels whether its writer wrote them or not."""
    dst.mkdir(parents=True)
    for entry in src.iterdir():
        if entry.name not in (".bev_cache", "gts"):
            (dst / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    return dst


@pytest.fixture(scope="session")
def occ_root(synthetic_root, tmp_path_factory) -> Path:
    """The session's synthetic set with Occ3D labels for every sample (the synthetic writer's own, written here
    with write_sample_occupancy from the rebuilt worlds). Read-only."""
    from bev.data.rig import MINI_LOCATIONS
    from bev.synthetic.occupancy import write_sample_occupancy
    from bev.synthetic.world import SAMPLE_DT, build_world
    from helpers.synthetic import RENDER_SCALE, SAMPLES, SEED

    root = link_copy(Path(synthetic_root), tmp_path_factory.mktemp("occ") / "nuscenes")
    for name, si, tokens in _samples_of(root):
        world = build_world(SEED, si, SAMPLES, MINI_LOCATIONS[name])
        for k, token in enumerate(tokens):
            write_sample_occupancy(root, name, token, world, k * SAMPLE_DT, None, RENDER_SCALE)
    return root


def _dataset(root, split="mini_val", **kw):
    from bev.data.nuscenes import NuScenesBEVDataset

    return NuScenesBEVDataset(root, split=split, final_dim=(32, 96), occupancy=True, **kw)


def test_items_carry_the_sample_labels(occ_root):
    ds = _dataset(occ_root, augment=False)
    for i in range(len(ds)):
        item = ds[i]
        scene = str(ds.index["scene"][i])
        with np.load(occ_root / "gts" / scene / item["sample_token"] / "labels.npz") as z:  # read independently
            want = {k: z[k] for k in z.files}
        assert item["occ_semantics"].dtype == torch.uint8 and tuple(item["occ_semantics"].shape) == OCC_SHAPE
        assert item["occ_mask_camera"].dtype == torch.bool and item["occ_mask_lidar"].dtype == torch.bool
        np.testing.assert_array_equal(item["occ_semantics"].numpy(), want["semantics"])
        np.testing.assert_array_equal(item["occ_mask_camera"].numpy(), want["mask_camera"].astype(bool))
        np.testing.assert_array_equal(item["occ_mask_lidar"].numpy(), want["mask_lidar"].astype(bool))
        assert (want["semantics"][want["mask_camera"] > 0] != FREE).any()  # the camera sees occupied voxels


def test_without_the_option_items_have_no_labels(occ_root):
    from bev.data.nuscenes import NuScenesBEVDataset

    item = NuScenesBEVDataset(occ_root, split="mini_val", final_dim=(32, 96))[0]
    assert not any(k.startswith("occ_") for k in item)


def test_a_missing_download_is_one_clear_error(synthetic_root, occ_root, tmp_path):
    bare = link_copy(Path(synthetic_root), tmp_path / "bare")
    with pytest.raises(FileNotFoundError) as e:
        _dataset(bare)
    msg = str(e.value)
    assert str(bare / "gts") in msg and "Occ3D" in msg and "gts.tar.gz" in msg and "\n" not in msg
    # A gts folder without the split's scenes: their names are said.
    part = link_copy(Path(synthetic_root), tmp_path / "part")
    (part / "gts").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no folder for 1 of the 1 scenes of split 'mini_val' \(e.g. scene-"):
        _dataset(part)


def test_a_bad_labels_file_names_itself(synthetic_root, occ_root, tmp_path):
    from bev.tasks.occupancy.io import OccupancyFileError

    root = link_copy(Path(synthetic_root), tmp_path / "bad")
    shutil.copytree(occ_root / "gts", root / "gts")
    ds = _dataset(root, augment=False)
    path = labels_path(root, str(ds.index["scene"][0]), str(ds.index["sample_token"][0]))
    labels = read_labels(path)
    np.savez(path, semantics=labels.semantics.astype(np.int32), mask_camera=labels.mask_camera)
    with pytest.raises(OccupancyFileError, match="missing array"):
        ds[0]


def test_a_named_pipe_as_labels_fails_the_item_at_once(synthetic_root, occ_root, tmp_path):
    """Training's first item: a fifo at labels.npz is one clear error, not a read that waits for a writer."""
    from bev.tasks.occupancy.io import OccupancyFileError
    from helpers.occupancy_files import run_guarded

    root = link_copy(Path(synthetic_root), tmp_path / "fifo")
    shutil.copytree(occ_root / "gts", root / "gts")
    ds = _dataset(root, augment=False)
    path = labels_path(root, str(ds.index["scene"][0]), str(ds.index["sample_token"][0]))
    path.unlink()
    os.mkfifo(path)
    hung, raised = run_guarded(lambda: ds[0], path)
    assert not hung and isinstance(raised, OccupancyFileError), raised
    assert str(path) in str(raised) and "a named pipe, not a regular file" in str(raised)


# ----------------------------------------------------------------------------- BEV augmentation


def _random_labels(seed=0):
    g = np.random.default_rng(seed)
    return g.integers(0, 18, OCC_SHAPE, dtype=np.uint8), g.random(OCC_SHAPE) < 0.5


def test_warp_flips_and_quarter_turns_move_voxels_exactly():
    sem, mask = _random_labels()
    out, m = warp_voxels(bev_matrix(0.0, 1.0, -1.0, 1.0), sem, mask)  # x -> -x
    np.testing.assert_array_equal(out, sem[::-1])
    np.testing.assert_array_equal(m, mask[::-1])
    out, _ = warp_voxels(bev_matrix(0.0, 1.0, 1.0, -1.0), sem, mask)  # y -> -y
    np.testing.assert_array_equal(out, sem[:, ::-1])
    # A quarter turn: (x, y) -> (-y, x); the voxel at the new (x', y') came from (y', -x').
    out, _ = warp_voxels(bev_matrix(math.pi / 2), sem, mask)
    i, j = np.meshgrid(np.arange(200), np.arange(200), indexing="ij")
    np.testing.assert_array_equal(out, sem[j, 199 - i])


def test_warp_scales_about_the_ego_and_fills_what_came_from_outside():
    sem, mask = _random_labels(1)
    out, m = warp_voxels(bev_matrix(0.0, 2.0), sem, mask)  # everything twice as far from the ego
    # Voxel (150, 100, 6) has its centre at (20.2, 0.2, 1.6); halved, (10.1, 0.1, 0.8) lies in voxel (125, 100, 4).
    assert out[150, 100, 6] == sem[125, 100, 4] and m[150, 100, 6] == mask[125, 100, 4]
    assert out[100, 100, 2] == sem[100, 100, 2]  # the voxel above the origin stays
    # Shrunk to 0.4, the outer voxels come from outside: unlabelled and unobserved.
    out, m = warp_voxels(bev_matrix(0.0, 0.4), sem, mask)
    assert (out[0] == IGNORE).all() and not m[0].any() and (out[:, :, 15] == IGNORE).all()
    # (0.2, 0.2, 0.8) / 0.4 = (0.5, 0.5, 2.0): voxel (101, 101, 7); z 0.2 / 0.4 = 0.5: layer 2 stays layer 2.
    assert out[100, 100, 4] == sem[101, 101, 7] and out[100, 100, 2] == sem[101, 101, 2]


def test_augmented_items_carry_the_labels_in_the_augmented_frame(occ_root):
    ds = _dataset(occ_root, split="mini_train", augment=True, bev_aug="bevdet")
    torch.manual_seed(3)
    item = ds[1]
    A = item["bev_aug"].double().numpy()
    assert not np.allclose(A, np.eye(3))
    labels = read_labels(labels_path(occ_root, str(ds.index["scene"][1]), item["sample_token"]))
    sem, cam, lidar = warp_voxels(A, labels.semantics, labels.mask_camera, labels.mask_lidar)
    np.testing.assert_array_equal(item["occ_semantics"].numpy(), sem)
    np.testing.assert_array_equal(item["occ_mask_camera"].numpy(), cam)
    np.testing.assert_array_equal(item["occ_mask_lidar"].numpy(), lidar)


def test_labels_share_the_frame_of_the_annotations(occ_root):
    """Each annotated box's centre column holds its class: labels (from the world) and boxes (from the nuScenes
    tables, through the devkit and the index) agree on the ego frame and the [x, y, z] order."""
    from bev.classes import DETECTION_CLASSES
    from bev.tasks.occupancy.grid import DETECTION_TO_OCC3D, points_to_voxels

    ds = _dataset(occ_root, split="mini_train", augment=False, detection=True)
    hits = total = 0
    for i in range(len(ds)):
        sem = ds[i]["occ_semantics"].numpy()
        boxes = ds.detection_boxes(i)
        idx, inside = points_to_voxels(boxes["boxes"][:, :3])
        for (x, y, _), label in zip(idx[inside], boxes["labels"][inside]):
            total += 1
            hits += int((sem[x, y] == DETECTION_TO_OCC3D[DETECTION_CLASSES[label]]).any())
    assert total > 20 and hits == total
