"""FIERY's present and future (the motion task): instance decoding and tracking (instances), its losses (loss),
its IoU over the present and future frames and its video panoptic quality (metric). The labels are built by
bev.data.temporal."""

# The label value of cells without a label (FIERY's ignore value): offset and flow, every loss and metric of
# the temporal labels; the one home of this value.
IGNORE = 255
