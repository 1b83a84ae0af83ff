"""One package per task under bev.tasks (segmentation, motion, detection, occupancy), one import layer for them all,
and the static segmentation loss as a module of its own that adds nothing to checkpoints."""

import importlib
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from bev.tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]
# What each task's package holds: module -> names it defines.
HOLDS = {
    "segmentation": {"loss": ("SegmentationLoss", "per_class_weights"), "metric": ("BevIoU", "MapIoU", "format_table")},
    "motion": {
        "instances": ("decode_sequence", "make_consistent"),
        "loss": ("TemporalLoss", "segmentation_loss", "regression_loss"),
        "metric": ("FutureIoU", "PanopticQuality", "crop_to_range", "FIERY_RANGES", "format_table"),
    },
    "detection": {"targets": ("encode_targets",), "loss": ("DetectionLoss",), "decode": ("decode",)},
    "occupancy": {"grid": ("OCC3D_CLASSES",), "loss": ("OccupancyLoss",), "metric": ("OccupancyMIoU",)},
}
GONE = ("bev.metrics", "bev.instances", "bev.detection", "bev.occupancy")


@pytest.mark.parametrize("task", sorted(TASKS))
def test_each_task_is_one_package_under_bev_tasks(task):
    for module, names in HOLDS[task].items():
        mod = importlib.import_module(f"bev.tasks.{task}.{module}")
        assert [n for n in names if not hasattr(mod, n)] == [], mod.__name__


@pytest.mark.parametrize("name", GONE)
def test_the_old_homes_of_the_task_code_are_gone(name):
    assert importlib.util.find_spec(name) is None


def test_the_shared_losses_keep_only_what_several_users_share():
    import bev.losses

    assert hasattr(bev.losses, "UncertaintyWeights") and not hasattr(bev.losses, "TemporalLoss")


def test_the_tasks_are_one_import_layer_below_the_data_and_the_models():
    block = re.search(r"\nlayers = \[(.*?)\n\]", (ROOT / "pyproject.toml").read_text(), re.S).group(1)
    layers = re.findall(r'^\s*"([^"]+)"', block, re.M)  # tomllib is Python 3.11+
    at = {m.strip(): i for i, layer in enumerate(layers) for m in layer.split("|")}
    assert at["bev.lit"] < at["bev.models"] < at["bev.data"] < at["bev.tasks"] < at["bev.utils"]  # top layer first


def _module(**kw):
    from bev.lit import BEVLitModule
    from helpers.models import stand_in_net

    net = stand_in_net(1, 3)
    return BEVLitModule(
        net=net, optimizer=None, segmentation=dict(object_classes=["vehicle"], map_classes=["lane", "divider"], **kw)
    )


@pytest.mark.parametrize(
    "kw", [{}, {"loss": "focal", "focal_gamma": 1.5}, {"pos_weight": [1, 2, 3], "class_weight": {"vehicle": 4.0}}]
)
def test_the_static_module_trains_with_the_segmentation_loss_and_saves_none_of_it(kw):
    from bev.tasks.segmentation.loss import SegmentationLoss

    module = _module(**kw)
    assert isinstance(module.task_modules.segmentation.loss_fn, SegmentationLoss)
    assert list(module.state_dict()) == list(_module().state_dict()) == ["val_headline_best", "net.weight", "net.bias"]
    assert list(module.task_modules) == ["segmentation"]
    torch.manual_seed(0)
    logits, target = torch.randn(2, 3, 4, 5), (torch.rand(2, 3, 4, 5) > 0.7).float()
    alone = SegmentationLoss(module.class_names, **kw)
    assert alone.state_dict() == {}
    torch.testing.assert_close(module.task_modules.segmentation.loss_fn(logits, target), alone(logits, target))
    assert (
        module.double().task_modules.segmentation.loss_fn.pos_weight.dtype == torch.float64
    )  # its weights follow the module
