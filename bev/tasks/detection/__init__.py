"""3D object detection on the BEV features (the nuScenes detection task): CenterPoint-style targets,
decoding, and scoring with the devkit's DetectionEval. Box conventions: bev.geometry.BOX_FIELDS."""

from bev.tasks.detection.decode import decode
from bev.tasks.detection.loss import DetectionLoss
from bev.tasks.detection.targets import REGRESSION_FIELDS, encode_targets

__all__ = ["REGRESSION_FIELDS", "DetectionLoss", "decode", "encode_targets"]
