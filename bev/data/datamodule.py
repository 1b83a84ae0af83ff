"""LightningDataModule over NuScenesBEVDataset (train / val; test = the val split)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import lightning as L
from torch.utils.data import DataLoader

from bev.data.maps import normalize_map_layers
from bev.data.nuscenes import NuScenesBEVDataset, normalize_categories, object_class_names
from bev.data.rasterize import check_raster
from bev.data.temporal import collate
from bev.geometry import Grid


def _tuple(v: Any) -> tuple | None:
    # Hydra hands lists/ListConfig; the dataset wants plain tuples of numbers (None: its default).
    return None if v is None else tuple(v)


class NuScenesDataModule(L.LightningDataModule):
    """nuScenes (or synthetic nuScenes-format) BEV data for Lift-Splat training.

    Training uses `augment` (LSS random resize/crop/flip/rotate, random ncams subset; a range of
    None is LSS's, see NuScenesBEVDataset); val and test (the val split) always use the
    deterministic validation transform and all cameras.
    persistent_workers only applies when num_workers > 0.
    past_frames / future_frames > 0: items are windows of consecutive key frames (NuScenesBEVDataset,
    bev.data.temporal); batches stack them with B leading and keep sample_tokens as B lists of tokens.
    class_names / num_classes: the target channels (object classes, then map_layers classes); the
    model config reads the same count through the `bev.num_classes` config resolver.
    """

    def __init__(
        self,
        dataroot: str | os.PathLike,
        version: str = "v1.0-mini",
        train_split: str = "mini_train",
        val_split: str = "mini_val",
        grid: Grid | dict | None = None,
        final_dim: Sequence[int] = (128, 352),
        augment: bool = True,
        resize_lim: Sequence[float] | None = None,
        bot_pct_lim: Sequence[float] | None = None,
        rot_lim: Sequence[float] | None = None,
        rand_flip: bool = True,
        ncams: int = 6,
        categories: Any = ("vehicle.",),
        map_layers: Any = None,
        raster: str = "center",
        depth_target: bool = False,
        input_memo_mb: float = 0,
        past_frames: int = 0,
        future_frames: int = 0,
        filter_invisible: bool = False,
        label_warp: str = "exact",
        batch_size: int = 4,
        num_workers: int = 2,
        pin_memory: bool = False,
        persistent_workers: bool = True,
        cache_dir: str | os.PathLike | None = None,
    ) -> None:
        super().__init__()
        self.dataroot = str(dataroot)
        self.version = version
        self.train_split, self.val_split = train_split, val_split
        self.grid = Grid.from_any(grid)
        self.groups = normalize_categories(categories)
        self.map_layers = normalize_map_layers(map_layers)
        self.common = dict(
            grid=self.grid,
            final_dim=_tuple(final_dim),
            resize_lim=_tuple(resize_lim),
            bot_pct_lim=_tuple(bot_pct_lim),
            rot_lim=_tuple(rot_lim),
            rand_flip=bool(rand_flip),
            ncams=int(ncams),
            categories=self.groups,
            map_layers=self.map_layers,
            raster=check_raster(raster),
            depth_target=bool(depth_target),
            input_memo_mb=input_memo_mb,
            cache_dir=cache_dir,
            past_frames=past_frames,
            future_frames=future_frames,
            filter_invisible=bool(filter_invisible),
            label_warp=label_warp,
        )
        self.augment = bool(augment)
        self.batch_size = int(batch_size)
        self.num_workers = int(num_workers)
        self.pin_memory = bool(pin_memory)
        self.persistent_workers = bool(persistent_workers) and self.num_workers > 0
        self.train_set: NuScenesBEVDataset | None = None
        self.val_set: NuScenesBEVDataset | None = None

    @property
    def class_names(self) -> tuple[str, ...]:
        return object_class_names(self.groups) + self.map_layers

    @property
    def num_object_classes(self) -> int:
        return len(self.groups)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def _dataset(self, split: str, augment: bool) -> NuScenesBEVDataset:
        return NuScenesBEVDataset(self.dataroot, version=self.version, split=split, augment=augment, **self.common)

    def prepare_data(self) -> None:
        # Build (and cache) the split indexes once, in the main process, before workers start.
        self._dataset(self.train_split, False)
        self._dataset(self.val_split, False)

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit") and self.train_set is None:
            self.train_set = self._dataset(self.train_split, self.augment)
        if stage in (None, "fit", "validate", "test", "predict") and self.val_set is None:
            self.val_set = self._dataset(self.val_split, False)

    def _loader(self, ds: NuScenesBEVDataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            ds,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers,
            drop_last=shuffle and len(ds) >= self.batch_size,
            collate_fn=collate,
        )

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        self.setup("test")
        return self._loader(self.val_set, shuffle=False)
