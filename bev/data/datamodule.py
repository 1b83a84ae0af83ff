"""LightningDataModule over NuScenesBEVDataset (train / val; test = the val split)."""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader

from bev.classes import object_class_names
from bev.data.cbgs import ClassBalancedSampler
from bev.data.config import DataConfig
from bev.data.index import load_indexes
from bev.data.lidar import collate_points
from bev.data.nuscenes import NuScenesBEVDataset
from bev.utils.dist import world


class NuScenesDataModule(L.LightningDataModule):
    """nuScenes (or synthetic nuScenes-format) BEV data for Lift-Splat training.

    Arguments: a DataConfig (`config`), and/or its fields as keyword arguments (bev.data.config
    declares each with its default and meaning; unknown names are refused). Hydra's `data:` node is
    exactly these keyword arguments. Every value is checked here, before any data is read.

    Training uses `augment` (LSS random resize/crop/flip/rotate, random ncams subset); val and test
    (the val split) always use the deterministic validation transform and all cameras.
    persistent_workers only applies when num_workers > 0.
    past_frames / future_frames > 0: items are windows of consecutive key frames (NuScenesBEVDataset,
    bev.data.temporal); batches stack them with B leading and keep sample_tokens as B lists of tokens.
    data.lidar.enabled: items carry "points"; batches hold them as one (sum M, 6) tensor, rows (batch index, x, y,
    z, intensity, time lag), and num_points (B,) (bev.data.lidar.collate_points).
    class_names / num_classes: the target channels (object classes, then map_layers classes); the
    model config reads the same count through the `bev.num_classes` config resolver.
    """

    def __init__(self, dataroot: str | os.PathLike | None = None, *, config: DataConfig | None = None, **options: Any):
        super().__init__()
        if dataroot is not None:
            options["dataroot"] = dataroot
        self.config = DataConfig.build(config, **options)
        self.train_set: NuScenesBEVDataset | None = None
        self.val_set: NuScenesBEVDataset | None = None

    # The settings other code reads from a data module (bev.train's checks, the tests).
    dataroot = property(lambda self: self.config.dataroot)
    grid = property(lambda self: self.config.grid)
    train_split = property(lambda self: self.config.train_split)
    val_split = property(lambda self: self.config.val_split)
    batch_size = property(lambda self: self.config.batch_size)
    num_workers = property(lambda self: self.config.num_workers)

    @property
    def persistent_workers(self) -> bool:
        return self.config.persistent_workers and self.config.num_workers > 0

    @property
    def class_names(self) -> tuple[str, ...]:
        return object_class_names(self.config.categories) + self.config.map_layers

    @property
    def num_object_classes(self) -> int:
        return len(self.config.categories)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def _dataset(self, split: str, augment: bool) -> NuScenesBEVDataset:
        return NuScenesBEVDataset(split=split, augment=augment, config=self.config.dataset)

    def prepare_data(self) -> None:
        # Build (and cache) the split indexes once, in the main process, before workers start: the devkit's
        # tables are read and checked once for both splits.
        c = self.config
        load_indexes(
            c.dataroot, c.version, [self.train_split, self.val_split], c.categories, c.cache_dir, True, c.map_layers
        )

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit") and self.train_set is None:
            self.train_set = self._dataset(self.train_split, self.config.augment)
        if stage in (None, "fit", "validate", "test", "predict") and self.val_set is None:
            self.val_set = self._dataset(self.val_split, False)

    def _loader(self, ds: NuScenesBEVDataset, train: bool) -> DataLoader:
        sampler = (self._cbgs_sampler() if self.config.cbgs else None) if train else _eval_sampler(ds)
        return DataLoader(
            ds,
            batch_size=self.batch_size,
            shuffle=train and sampler is None,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=self.config.pin_memory,
            persistent_workers=self.persistent_workers,
            drop_last=train and len(sampler or ds) >= self.batch_size,
            collate_fn=collate_points,
            worker_init_fn=_worker_init if self.num_workers else None,
        )

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return self._loader(self.train_set, train=True)

    def _cbgs_sampler(self) -> ClassBalancedSampler:
        """CBGS over the training split (data.cbgs=true), its epoch length said once."""
        if not self.config.detection:
            raise ValueError("data.cbgs=true balances detection classes: it needs data.detection=true")
        sampler = ClassBalancedSampler(self.train_set, seed=int(os.environ.get("PL_GLOBAL_SEED", 0)))
        n = len(self.train_set)
        print(
            f"data.cbgs: an epoch draws {len(sampler)} samples of the {n} of {self.train_split} "
            f"({len(sampler) / n:.2f}x: the schedule's epochs are that much longer)",
            file=sys.stderr,
            flush=True,
        )
        return sampler

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        self.setup("test")
        return self._loader(self.val_set, train=False)


def _worker_init(worker_id: int) -> None:
    """Loader processes leave Ctrl-C and SIGTERM to the training process, which stops after its step and saves
    it (a whole process group signalled, as SLURM's scancel does, would otherwise kill them mid-batch); they still
    end with it. Then Lightning's seeding of each worker, which a worker_init_fn of our own replaces."""
    import signal

    from lightning.fabric.utilities.seed import pl_worker_init_function

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pl_worker_init_function(worker_id)


def _eval_sampler(ds: NuScenesBEVDataset) -> UnrepeatedDistributedSampler | None:
    """Under DDP, each evaluation sample on exactly one process: the training sampler's padding would count the
    repeated samples twice in the split's IoU. None in one process (Lightning's default)."""
    rank, size = world()
    return UnrepeatedDistributedSampler(ds, num_replicas=size, rank=rank, shuffle=False) if size > 1 else None
