"""The network's parts: the camera branch (encoder + Lift-Splat view transform), the temporal fusion, the BEV
decoders, and BEVNet, which composes them with the tasks' heads (bev.tasks.<task>.head)."""

from bev.models.camera import BACKBONES, BackboneWeightsError, CameraEncoder
from bev.models.decoder import BevDecoder, VoxelDecoder3d
from bev.models.lift import SPLATS, LiftSplat
from bev.models.net import BEVNet

__all__ = [
    "BACKBONES",
    "SPLATS",
    "BEVNet",
    "BackboneWeightsError",
    "BevDecoder",
    "CameraEncoder",
    "LiftSplat",
    "VoxelDecoder3d",
]
