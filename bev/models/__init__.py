"""Lift-Splat-Shoot model parts: camera encoder, lift-splat view transform, BEV encoder."""

from bev.models.bev_encoder import BevEncoder
from bev.models.camera import BACKBONES, BackboneWeightsError, CameraEncoder
from bev.models.lss import SPLATS, LiftSplatShoot

__all__ = ["BACKBONES", "SPLATS", "BackboneWeightsError", "BevEncoder", "CameraEncoder", "LiftSplatShoot"]
