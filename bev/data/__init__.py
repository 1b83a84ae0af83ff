"""nuScenes data for Lift-Splat: reader, transforms, BEV rasterisation, LightningDataModule.

make_synthetic (the synthetic nuScenes-format writer in bev.data.synthetic) is imported
lazily so `import bev.data` stays cheap and works without it.
"""
from bev.data.datamodule import NuScenesDataModule
from bev.data.nuscenes import NuScenesBEVDataset

__all__ = ["NuScenesBEVDataset", "NuScenesDataModule", "make_synthetic"]


def make_synthetic(*args, **kwargs):
    """Write a synthetic nuScenes-format dataset; see bev.data.synthetic.make_synthetic."""
    from bev.data.synthetic import make_synthetic as _make_synthetic

    return _make_synthetic(*args, **kwargs)
