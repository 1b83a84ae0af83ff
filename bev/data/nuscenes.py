"""The nuScenes Dataset: multi-camera images + BEV targets for Lift-Splat training.

It reads the split index (bev.data.index: built once through the devkit, then cached) and the image,
LiDAR and map files it names. Target channels (`class_names`): the object classes (one per category
group, see normalize_categories) then the map classes of `map_layers` (bev.data.maps), all on the same
grid and ego frame.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from bev.classes import object_class_names
from bev.data import temporal
from bev.data.bev_aug import apply_to_geometry, warp_raster
from bev.data.config import DatasetConfig
from bev.data.depth import depth_targets, load_lidar
from bev.data.detection import detection_boxes, detection_item
from bev.data.index import load_index
from bev.data.lidar import item_points, load_sweep_index, sample_points
from bev.data.maps import rasterize_map
from bev.data.rasterize import rasterize_boxes
from bev.data.tables import HOWTO, check_image_size
from bev.data.transforms import (
    LSS_BOT_PCT_LIM,
    LSS_ROT_LIM,
    ImageAug,
    float_range,
    normalize_array,
    resize_range,
    sample_augmentation,
    warp_image,
)
from bev.geometry import CAMERA_GEOMETRY, CAMERA_NAMES, FEATURE_STRIDE
from bev.tasks.occupancy.data import check_gts, occupancy_item

# Per process, for NuScenesBEVDataset.targets: the synthetic set needs ~15 MB, trainval at 200x200 would
# need ~2 GB and keeps only its first samples.
TARGET_MEMO_BYTES = 256 * 2**20


class NuScenesBEVDataset(Dataset):
    """Six surround-camera images + BEV targets of the key-frame samples of one split.

    Arguments: the dataset's own `split`, `augment` (training augmentation) and `verbose`, and the
    settings every dataset of a run shares: a DatasetConfig (`config`) and/or its fields as keyword
    arguments (bev.data.config declares each with its default and meaning; unknown names are refused),
    e.g. NuScenesBEVDataset(root, split="mini_val", map_layers="lss").

    ds[i] is a dict:
      images (Ncam, 3, H, W) float32, ImageNet-normalised; intrinsics (Ncam, 3, 3);
      rots (Ncam, 3, 3), trans (Ncam, 3) camera->ego; post_rots (Ncam, 3, 3), post_trans
      (Ncam, 3) the image augmentation (bev.geometry convention); cam_ids (Ncam,) int64 indices
      into CAMERA_NAMES; bev (K, X, Y) float32 {0, 1} (K = 1 for a list of prefixes, K groups
      for a list of lists); visibility (X, Y) uint8, highest nuScenes visibility level (1-4)
      of the target boxes covering a cell, 0 where none; bev_bounds (2, 3) float64 the grid's
      x and y [lo, hi, step]; sample_token str.
    bev has len(class_names) channels: the object classes, then the map classes of map_layers
    (a preset name, a list of bev.data.maps.MAP_CLASSES names, or None).
    raster="center": a cell is filled when its centre lies in a box footprint; raster="lss":
    lift-splat-shoot's rounded-corner fill (bev.data.rasterize). Map channels follow the
    devkit's get_map_mask rule (bev.data.maps), which is the "lss" rule for polygons.
    depth_target=True adds depth (Ncam, H/s, W/s) int64: the depth bin of the nearest LIDAR_TOP point in each
    camera feature cell at stride s = depth_stride (the model's model.net.camera.downsample; 16 when null), -1 where
    none (bev.data.depth), for depth supervision.
    lidar={enabled: true, sweeps: S, max_points: M} adds points (P, 5) float32: x, y, z, intensity, time lag of
    the LIDAR_TOP key frame and its S earlier sweeps in the ego frame, after the BEV augmentation, in the grid, at
    most M (bev.data.lidar); batches hold them flat (bev.data.lidar.collate_points).
    occupancy=True adds occ_semantics (200, 200, 16) uint8 Occ3D class ids and occ_mask_camera, occ_mask_lidar
    (200, 200, 16) bool, from <dataroot>/gts/<scene name>/<sample token>/labels.npz (bev.tasks.occupancy.data).
    cameras=False: no images and no camera geometry (nothing decoded: a LiDAR-only network's data).
    With augment=False images get the deterministic LSS resize + crop and all 6 cameras;
    with augment=True and ncams < 6 a random subset of ncams cameras (kept in camera order).
    resize_lim, bot_pct_lim, rot_lim: None gives Lift-Splat-Shoot's ranges (bev.data.transforms);
    resize_lim is absolute, and None scales the LSS range to final_dim.

    past_frames=P, future_frames=F (either > 0): ds[i] is window i, P + 1 + F consecutive key frames of
    one scene (bev.data.temporal; scenes too short are skipped and counted on stderr), T = P + 1 + F:
      sample_tokens list of T tokens, oldest first, the present at index P; images, intrinsics, rots,
      trans, post_rots, post_trans (and depth) of the P + 1 input frames with a leading time axis
      ((P + 1, Ncam, ...); in training each camera's augmentation is the same in every frame);
      future_egomotion (T, 4, 4) float32, entry t maps frame t's ego coordinates into frame t+1's
      (x, y, yaw only), the last the identity; labels of the present and F future frames in the
      present frame's grid: instance (F + 1, X, Y) int64 (0 background, ids over the whole window),
      segmentation (F + 1, X, Y) int64 (instance > 0), centerness (F + 1, 1, X, Y), offset and flow
      (F + 1, 2, X, Y) float32 in cells, IGNORE (255, bev.tasks.motion) where undefined (channel 0 along x, 1 along y);
      cam_ids, bev, visibility, bev_bounds and sample_token of the present frame, as for P = F = 0.
    Labels are FIERY's (bev.data.temporal): filter_invisible drops boxes of visibility level 1;
    label_warp="fiery" reproduces FIERY's label warp, lateral sign error included.
    """

    use_draft = True  # decode JPEGs at 1/2, 1/4, 1/8 DCT scale when the output allows (exact geometry)

    def __init__(
        self,
        dataroot: str | os.PathLike | None = None,
        *,
        split: str = "mini_train",
        augment: bool = False,
        verbose: bool = True,
        config: DatasetConfig | None = None,
        **options: Any,
    ) -> None:
        if dataroot is not None:
            options["dataroot"] = dataroot
        self.config = cfg = DatasetConfig.build(config, **options)
        self.dataroot, self.version, self.split = cfg.dataroot, cfg.version, split
        self.grid, self.final_dim = cfg.grid, cfg.final_dim
        self.augment = bool(augment)
        self.resize_lim = resize_range(cfg.resize_lim, self.final_dim, self.augment)
        self.bot_pct_lim = float_range(cfg.bot_pct_lim, LSS_BOT_PCT_LIM)
        self.rot_lim = float_range(cfg.rot_lim, LSS_ROT_LIM)
        self.rand_flip, self.ncams = cfg.rand_flip, cfg.ncams
        self.groups, self.map_layers = cfg.categories, cfg.map_layers
        self.raster, self.depth_target, self.detection = cfg.raster, cfg.depth_target, cfg.detection
        self.cameras = cfg.cameras
        if self.depth_target and not self.cameras:
            raise ValueError(
                "data.depth_target=true is the cameras' depth: set data.cameras=true or depth_target=false"
            )
        self.depth_stride = cfg.depth_stride or FEATURE_STRIDE
        self.det_range, self.bev_aug = cfg.det_range, cfg.bev_aug if self.augment else None
        self.index = load_index(
            self.dataroot, self.version, split, self.groups, cfg.cache_dir, verbose=verbose, map_layers=self.map_layers
        )
        self.lidar = cfg.lidar
        self.sweeps = None  # with data.lidar.enabled: each sample's key frame and sweeps (bev.data.lidar)
        if self.lidar.enabled:
            tokens = [str(t) for t in self.index["sample_token"]]
            self.sweeps = load_sweep_index(
                self.dataroot, self.version, split, tokens, self.lidar.sweeps, cfg.cache_dir, verbose
            )
        self.occupancy = cfg.occupancy
        if self.occupancy:  # before any item: a missing Occ3D download is one clear error
            check_gts(self.dataroot, self.index["scene"], split)
        self._init_windows(cfg.past_frames, cfg.future_frames, cfg.filter_invisible, cfg.label_warp)
        self._memo: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # sample -> packed targets (targets())
        self._memo_bytes = 0
        self._inputs_limit = int(cfg.input_memo_mb * 2**20)
        self._inputs: dict[tuple[str, int, int], Any] = {}  # see remember_input()
        self._inputs_bytes = 0

    @property
    def class_names(self) -> tuple[str, ...]:
        """One name per target channel: object classes, then map classes."""
        return object_class_names(self.groups) + self.map_layers

    @property
    def num_object_classes(self) -> int:
        return len(self.groups)

    @property
    def num_classes(self) -> int:
        return len(self.groups) + len(self.map_layers)

    def map_target(self, i: int) -> np.ndarray:
        """(len(map_layers), X, Y) uint8 map channels of sample i (bev.data.maps.rasterize_map)."""
        return rasterize_map(
            self.index,
            str(self.index["location"][i]),
            self.index["ego_rotation"][i],
            self.index["ego_translation"][i],
            self.grid,
            len(self.map_layers),
        )

    def targets(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """bev (K, X, Y) float32 and visibility (X, Y) uint8 of sample i.

        Targets do not depend on the image augmentation, so each is rasterised once per process
        and kept bit-packed (about K * X * Y / 8 bytes) while the memo stays under TARGET_MEMO_BYTES:
        from the second epoch on, (persistent) workers only decode images.
        """
        if i in self._memo:
            bits, vis = self._memo[i]
            bev = np.unpackbits(bits, count=self.num_classes * self.grid.nx * self.grid.ny)
            return bev.reshape(self.num_classes, self.grid.nx, self.grid.ny).astype(np.float32), vis.copy()
        box = self.boxes(i)
        bev, vis = rasterize_boxes(
            box["footprint"], box["label"], box["visibility"], self.grid, self.num_object_classes, self.raster
        )
        if self.map_layers:
            bev = np.concatenate([bev, self.map_target(i).astype(np.float32)])
        entry = (np.packbits(bev.astype(bool)), vis.copy())  # callers may write into what they get
        size = entry[0].nbytes + vis.nbytes
        if self._memo_bytes + size <= TARGET_MEMO_BYTES:
            self._memo[i], self._memo_bytes = entry, self._memo_bytes + size
        return bev, vis

    def __len__(self) -> int:
        return len(self.windows) if self.temporal else len(self.index["sample_token"])

    def _init_windows(self, past_frames: int, future_frames: int, filter_invisible: bool, label_warp: str) -> None:
        """The window index (bev.data.temporal) when past_frames or future_frames > 0; scenes too short are counted."""
        self.past_frames, self.future_frames = temporal.check_frames(past_frames, future_frames)
        self.filter_invisible = bool(filter_invisible)
        self.label_warp = temporal.check_label_warp(label_warp)
        self.temporal = self.past_frames + self.future_frames > 0
        self.windows = np.zeros(0, np.int64)
        # Scored boxes need every sample: a detection set that does not train pads the past (bev.data.temporal).
        self.pad_past = self.temporal and self.detection and not self.augment
        self._first_rows = temporal.scene_first_rows(self.index["scene"])
        if self.temporal:
            self.windows, short = temporal.window_index(
                self.index["scene"], self.past_frames, self.future_frames, self.pad_past
            )
            if short:
                presents = self.index["scene"][self.windows + self.past_frames]
                print(
                    f"{self.split}: skipped {len(short)} of {len(short) + len(set(presents))} scenes shorter than a "
                    f"window of {self.future_frames + 1 if self.pad_past else self.window_length} key frames",
                    file=sys.stderr,
                    flush=True,
                )

    @property
    def window_length(self) -> int:
        return self.past_frames + 1 + self.future_frames

    def window_frames(self, w: int) -> np.ndarray:
        """Sample (index row) numbers of window w, oldest first; the present is at position past_frames."""
        return temporal.window_rows(self.windows[w], self.past_frames, self.window_length, self._first_rows)

    def choose_cams(self) -> np.ndarray:
        n = len(CAMERA_NAMES)
        if self.augment and self.ncams < n:
            return np.sort(torch.randperm(n)[: self.ncams].numpy())
        return np.arange(n)

    def boxes(self, i: int) -> dict[str, np.ndarray]:
        """Target boxes of sample i in the ego frame (centre, size wlh, rotation, footprint, label, ...)."""
        a, b = self.index["box_offsets"][i], self.index["box_offsets"][i + 1]
        out = {k[4:]: self.index[k][a:b] for k in self.index if k.startswith("box_") and k != "box_offsets"}
        out["category"] = self.index["category_names"][out["category"]] if len(out["category"]) else np.zeros(0, str)
        out["instance"] = np.asarray([t.decode() for t in out["instance"]], dtype=str)
        return out

    def detection_boxes(self, i: int) -> dict[str, np.ndarray]:
        """Sample i's detection boxes (bev.data.detection.detection_boxes)."""
        return detection_boxes(self.index, i)

    def image_path(self, i: int, cam: int) -> str:
        """Absolute path of sample i's image from camera CAMERA_NAMES[cam]."""
        return os.path.join(self.dataroot, self.index["image_path"][i, cam].decode())

    def remember_input(self, key: tuple[str, int, int], make: Callable[[], Any], nbytes: Callable[[Any], int]) -> Any:
        """make(), memoised under key while the memo stays under input_memo_mb, for inputs that
        never change: without augmentation a camera crop (uint8, 0.13 MB at 128x352) and a depth
        target are the same every epoch, and decoding the crops is most of a loader's time."""
        if key in self._inputs:
            return self._inputs[key]
        value = make()
        size = nbytes(value)
        if self._inputs_bytes + size <= self._inputs_limit:
            self._inputs[key], self._inputs_bytes = value, self._inputs_bytes + size
        return value

    def load_image(
        self, i: int, cam: int, train: bool, aug: ImageAug | None = None
    ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        if train:
            pixels, post_rot, post_tran = self.decode_image(i, cam, train, aug)
        else:
            pixels, post_rot, post_tran = self.remember_input(
                ("image", i, cam), lambda: self.decode_image(i, cam, train), lambda v: v[0].nbytes
            )
        return normalize_array(pixels), post_rot.clone(), post_tran.clone()

    def decode_image(
        self, i: int, cam: int, train: bool, aug: ImageAug | None = None
    ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """(H, W, 3) uint8 crop of sample i's camera `cam`, with its post_rot and post_tran (`aug`, or one drawn)."""
        path = self.image_path(i, cam)
        try:
            with Image.open(path) as img:  # reads the header only: the size is checked before any pixel is decoded
                check_image_size(img.size, self.index["image_hw"][i, cam], path)
                if aug is None:
                    aug = self.draw_augmentation((img.size[1], img.size[0]), train)
                pixels = np.asarray(warp_image(img, aug, self.use_draft))
        except FileNotFoundError:
            raise FileNotFoundError(
                f"camera image {path!r} is missing (listed in {self.version} sample_data). {HOWTO}"
            ) from None
        except OSError as e:  # truncated / corrupt JPEG: name the file
            raise OSError(f"cannot decode camera image {path!r} ({e}); re-download or regenerate it") from e
        post_rot, post_tran = aug.post_rot_tran()
        return pixels, post_rot, post_tran

    def draw_augmentation(self, raw_hw: tuple[int, int], train: bool) -> ImageAug:
        """A random training augmentation (train) or the deterministic validation one, for a raw (H, W) image."""
        return sample_augmentation(
            raw_hw, self.final_dim, train, self.resize_lim, self.bot_pct_lim, self.rot_lim, self.rand_flip
        )

    def lidar_points(self, i: int) -> torch.Tensor:
        """(P, 3) LIDAR_TOP points of sample i in the ego frame."""
        path = os.path.join(self.dataroot, self.index["lidar_path"][i].decode())
        R, t = self.index["lidar_rotation"][i], self.index["lidar_translation"][i]
        return torch.from_numpy((load_lidar(path) @ R.T + t).astype(np.float32))

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(
                f"{'window' if self.temporal else 'sample'} index {i} out of range for {len(self)} "
                f"{'windows' if self.temporal else 'samples'}"
            )
        i = i % len(self)
        if self.temporal:
            return self.window_item(i)
        return self.frame_item(i, self.choose_cams())

    def window_item(self, w: int) -> dict[str, Any]:
        """Window w (keys: the class doc): the present frame's item (frame_item) with the P + 1 input frames'
        inputs, plus the window's labels (bev.data.temporal.window_labels, moved by the item's BEV augmentation).

        Only the P + 1 input frames' images are decoded; the future frames give labels from boxes alone.
        In training every camera draws one augmentation, shared by all the window's frames."""
        frames, past = self.window_frames(w), self.past_frames
        present = int(frames[past])
        cams = self.choose_cams()
        augs = None
        if self.augment:
            hw = self.index["image_hw"][present]
            augs = [self.draw_augmentation(tuple(int(v) for v in hw[c]), True) for c in cams]
        item = self.frame_item(present, cams, frames[: past + 1], augs)
        item["sample_tokens"] = [str(t) for t in self.index["sample_token"][frames]]
        labels = temporal.window_labels(self.index, frames, past, self.grid, self.filter_invisible, self.label_warp)
        if "bev_aug" in item:  # the frames' geometry moved with it (frame_item): the labels follow
            labels = temporal.augment_labels(labels, item["bev_aug"].double().numpy(), self.grid)
        item.update({k: torch.from_numpy(v) for k, v in labels.items()})
        return item

    @property
    def bev_bounds(self) -> torch.Tensor:
        """(2, 3) float64 [[xlo, xhi, xstep], [ylo, yhi, ystep]] of the grid: in every item, so that pictures
        need no grid plumbing."""
        return torch.tensor([self.grid.xbound, self.grid.ybound], dtype=torch.float64)

    def frame_item(
        self,
        i: int,
        cams: np.ndarray,
        input_frames: Sequence[int] | None = None,
        augs: Sequence[ImageAug] | None = None,
    ) -> dict[str, Any]:
        """The item of sample i (class doc): its cameras' inputs (frame_inputs) and its targets.

        input_frames: samples (oldest first, ending with i: a window's P + 1 input frames) whose inputs are
        stacked along a leading time axis instead of sample i's alone. augs: as frame_inputs."""
        if input_frames is None:
            inputs = self.frame_inputs(i, cams, augs)
        else:
            frames = [self.frame_inputs(int(j), cams, augs) for j in input_frames]
            inputs = {k: torch.stack([x[k] for x in frames]) for k in frames[0]}
        depth = inputs.pop("depth", None)
        bev, vis = self.targets(i)
        item = {
            **inputs,
            "cam_ids": torch.from_numpy(cams.astype(np.int64)),
            "bev": torch.from_numpy(bev),
            "visibility": torch.from_numpy(vis),
            "bev_bounds": self.bev_bounds,
            "sample_token": str(self.index["sample_token"][i]),
        }
        if depth is not None:
            item["depth"] = depth
        bev_aug = self.bev_aug.draw() if self.bev_aug is not None else None
        if bev_aug is not None:
            self._augment_bev(item, i, bev_aug)
        if self.detection:
            where = f"sample {item['sample_token']}"
            item.update(detection_item(self.detection_boxes(i), self.grid, self.det_range, bev_aug, where))
        if self.occupancy:  # occ_semantics, occ_mask_camera, occ_mask_lidar (bev.tasks.occupancy.data)
            item.update(occupancy_item(self.dataroot, str(self.index["scene"][i]), item["sample_token"], bev_aug))
        if self.sweeps is not None:  # drawn after bev_aug: the draws without data.lidar stay the same
            item["points"] = self.lidar_item(i, bev_aug)
        return item

    def lidar_item(self, i: int, bev_aug: np.ndarray | None) -> torch.Tensor:
        """(M, 5) float32 points of sample i (bev.data.lidar.POINT_COLUMNS): key frame and sweeps in its ego
        frame, moved by the item's BEV augmentation, in the grid, at most data.lidar.max_points (a random subset
        in training, the same one every epoch otherwise)."""
        points = sample_points(self.dataroot, self.sweeps, i)
        return item_points(points, self.grid, bev_aug, self.lidar.max_points, None if self.augment else i)

    def _augment_bev(self, item: dict[str, Any], i: int, A: np.ndarray) -> None:
        """Sample i's item in the BEV frame A maps to (bev.data.bev_aug), in place: the lift geometry, the object
        targets rasterised anew from the moved footprints, the map targets resampled."""
        if "rots" in item:
            apply_to_geometry(item, A)
        box, k = self.boxes(i), self.num_object_classes
        footprints = box["footprint"] @ A[:2, :2].T
        objects, vis = rasterize_boxes(footprints, box["label"], box["visibility"], self.grid, k, self.raster)
        item["bev"] = torch.cat([torch.from_numpy(objects), warp_raster(item["bev"][k:], A, self.grid)])
        item["visibility"] = torch.from_numpy(vis)
        item["bev_aug"] = torch.from_numpy(A.astype(np.float32))

    def frame_inputs(self, i: int, cams: np.ndarray, augs: Sequence[ImageAug] | None = None) -> dict[str, torch.Tensor]:
        """Sample i's images and CAMERA_GEOMETRY tensors of cameras `cams`, and depth with depth_target; nothing
        with data.cameras=false.

        augs: one augmentation per camera (a training window uses the same ones for all its frames),
        None to draw one per image."""
        if not self.cameras:
            return {}
        imgs, post_rots, post_trans = [], [], []
        for k, c in enumerate(cams):
            img, pr, pt = self.load_image(i, int(c), self.augment, None if augs is None else augs[k])
            imgs.append(img)
            post_rots.append(pr)
            post_trans.append(pt)
        out = {
            "images": torch.from_numpy(np.stack(imgs)),
            "intrinsics": torch.from_numpy(self.index["intrinsics"][i, cams]),
            "rots": torch.from_numpy(self.index["rots"][i, cams]),
            "trans": torch.from_numpy(self.index["trans"][i, cams]),
            "post_rots": torch.stack(post_rots),
            "post_trans": torch.stack(post_trans),
        }
        if self.depth_target:

            def depth():
                return depth_targets(
                    self.lidar_points(i),
                    *(out[k] for k in CAMERA_GEOMETRY),
                    self.final_dim,
                    self.depth_stride,
                    self.grid,
                    torch.from_numpy(self.index["image_hw"][i, cams]),
                )

            if self.augment:
                out["depth"] = depth()
            else:  # all cameras, fixed crops: the same target every epoch
                out["depth"] = self.remember_input(
                    ("depth", i, -1), depth, lambda t: t.numel() * t.element_size()
                ).clone()
        return out
