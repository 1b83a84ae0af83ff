"""3D object detection on the BEV features (the nuScenes detection task): CenterPoint-style targets,
decoding, and scoring with the devkit's DetectionEval. Box conventions: bev.geometry.BOX_FIELDS."""
