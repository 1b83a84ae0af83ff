"""BEV segmentation of object and HD-map classes (the static task): its loss (loss) and its IoUs (metric: the LSS
IoU of the object classes, BEVFusion's best-threshold IoU of the map classes)."""
