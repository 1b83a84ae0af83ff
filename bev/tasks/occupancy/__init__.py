"""3D semantic occupancy in Occ3D-nuScenes's format: its grid and classes (grid), reading and writing its
files (io), its mIoU (metric), SparseOcc's RayIoU (rayiou). See docs/occupancy.md."""

from bev.tasks.occupancy.grid import (
    CLASS_ID,
    DETECTION_TO_OCC3D,
    FREE,
    NUM_CLASSES,
    OCC3D_CLASSES,
    OCC_RANGE,
    OCC_SHAPE,
    SCORED_CLASSES,
    VOXEL_SIZE,
)

__all__ = [
    "CLASS_ID",
    "DETECTION_TO_OCC3D",
    "FREE",
    "NUM_CLASSES",
    "OCC3D_CLASSES",
    "OCC_RANGE",
    "OCC_SHAPE",
    "SCORED_CLASSES",
    "VOXEL_SIZE",
]
