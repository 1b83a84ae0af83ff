"""bev-train's checks of the trainer config before any data is read."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from bev.train import _check_batches_per_process
from bev.utils.threads import available_cpus as _cores


def test_more_cpu_processes_than_cores_is_a_warning_with_the_fix():
    many = _cores() + 2
    cfg = OmegaConf.create({"accelerator": "cpu", "devices": many, "num_nodes": 1})
    with pytest.warns(
        UserWarning,
        match=rf"trainer.devices={many} starts {many} CPU training processes.*trainer.devices={_cores()} or fewer",
    ):
        _check_batches_per_process(cfg, samples=1000, batch_size=1, split="mini_train")


def test_as_many_cpu_processes_as_cores_or_a_gpu_trainer_is_not_warned(recwarn):
    for cfg in ({"accelerator": "cpu", "devices": _cores()}, {"accelerator": "gpu", "devices": _cores() + 2}):
        _check_batches_per_process(OmegaConf.create(cfg), samples=1000, batch_size=1, split="mini_train")
    assert not [w for w in recwarn if "CPU training processes" in str(w.message)]


# --- model.* and the training data settings, checked with the composed config (bev.config_checks.check_settings)

OCC, DET, TEMPORAL, STATIC = (
    "experiment=synthetic_occ_cpu",
    "experiment=synthetic_det_cpu",
    "experiment=synthetic_temporal_cpu",
    "experiment=synthetic_cpu",
)


def _check(*overrides):
    from bev.config_checks import check_settings
    from helpers.train_step import compose_train

    check_settings(compose_train(list(overrides)))


@pytest.mark.parametrize(
    "overrides, needle",
    [
        # Non-finite and negative weights: NaN losses to the end with exit 0, or a loss maximised.
        (
            (OCC, "model.occupancy.loss.class_weight={car: inf}"),
            "model.occupancy.loss.class_weight.car=inf is not a finite number",
        ),
        (
            (OCC, "model.occupancy.loss.lovasz_weight=nan"),
            "model.occupancy.loss.lovasz_weight=nan is not a finite number",
        ),
        ((DET, "model.detection.weight=nan"), "model.detection.weight=nan is not a finite number"),
        ((DET, "model.detection.weight=-1"), "model.detection.weight=-1: a weight must be >= 0"),
        ((STATIC, "model.depth_weight=-0.1"), "model.depth_weight=-0.1: a weight must be >= 0"),
        (
            (STATIC, "model.segmentation.pos_weight.vehicle=-3"),
            "model.segmentation.pos_weight.vehicle=-3: a weight must be >= 0",
        ),
        (
            (STATIC, "model.segmentation.class_weight.vehicle=inf"),
            "model.segmentation.class_weight.vehicle=inf is not a finite number",
        ),
        ((DET, "+model.detection.loss.regression_weight=-2"), "model.detection.loss.regression_weight=-2"),
        ((TEMPORAL, "model.motion.loss.weights.kl=nan"), "model.motion.loss.weights.kl=nan"),
        ((TEMPORAL, "model.motion.loss.seg_pos_weight=-4"), "model.motion.loss.seg_pos_weight=-4"),
        ((STATIC, "model.optimizer.lr=inf"), "model.optimizer.lr=inf is not a finite number"),
        # Booleans that "maybe" would pass as true.
        (
            (OCC, "model.occupancy.loss.visible_only=maybe"),
            "model.occupancy.loss.visible_only='maybe' must be true or false",
        ),
        ((TEMPORAL, "model.motion.loss.uncertainty=maybe"), "model.motion.loss.uncertainty='maybe' must be true"),
        ((TEMPORAL, "model.past_no_grad=1"), "model.past_no_grad=1 must be true or false"),
        (
            (STATIC, "model.net.decoder.task_decoders=maybe"),
            "model.net.decoder.task_decoders='maybe' must be true or false",
        ),
        # Values that failed late and nameless ("'int' object is not iterable", "could not convert string").
        ((OCC, "model.occupancy.loss.class_weight=5"), "model.occupancy.loss.class_weight=5: choose null, a preset"),
        (
            (OCC, "model.occupancy.loss.class_weight={car: x}"),
            "model.occupancy.loss.class_weight.car='x' is not a number",
        ),
        ((OCC, "model.occupancy.loss.class_weight=[1,2]"), "model.occupancy.loss.class_weight has 2 weights, not 18"),
        ((OCC, "model.occupancy.loss.lovasz_weight=abc"), "model.occupancy.loss.lovasz_weight='abc' is not a number"),
        # Segmentation's settings at their place before model.segmentation.
        ((STATIC, "+model.pos_weight=3"), "model.pos_weight is now model.segmentation.pos_weight"),
        ((STATIC, "model.segmentation.focal_gamma=abc"), "model.segmentation.focal_gamma='abc' must be a number"),
        (
            (STATIC, "model.net.camera.context_channels=abc"),
            "model.net.camera.context_channels='abc' must be a whole number",
        ),
        (
            (STATIC, "+model.segmentation.pos_weight.car=2"),
            "model.segmentation.pos_weight names unknown class(es) ['car']",
        ),
        (
            ("experiment=lss_nuscenes_mini", "model.segmentation.pos_weight=[1,2]"),
            "model.segmentation.pos_weight has 2 values for 1 classes",
        ),
        ((TEMPORAL, "model.motion.loss.seg_top_k=2"), "model.motion.loss.seg_top_k must be in (0, 1]"),
        ((TEMPORAL, "model.motion.loss.future_discount=0"), "model.motion.loss.future_discount must be in (0, 1]"),
        ((DET, "+model.detection.loss.code_weights=[1,1]"), "model.detection.loss: code_weights needs one weight"),
        # The network's input: not the data's (fails at step 0), or not a multiple of the stride (fails when built).
        (
            (STATIC, "data.final_dim=[127,350]"),
            "data.final_dim=[127, 350] is not a multiple of model.net.camera.downsample",
        ),
        ((STATIC, "model.net.image_size=[64,176]"), "model.net.image_size=[64, 176] differs from data.final_dim"),
        # BEV augmentation skipped without data.augment (the synthetic experiments turn it off).
        ((DET, "data.bev_aug=bevdet"), "data.bev_aug=bevdet does nothing with data.augment=false"),
        # The headline metric: the checkpoint monitor and the sweep read it, so it must be one the model logs.
        ((OCC, "headline=val/iou"), "headline=val/iou is not a metric of this model's tasks ['occupancy']"),
        ((STATIC, "headline=val/occ_miou"), "headline=val/occ_miou is not a metric of this model's tasks"),
        ((STATIC, "headline=iou"), "headline='iou' must be a val/ metric"),
        # A camera branch without images (data.cameras=false is the LiDAR-only experiments' setting).
        (
            ("experiment=synthetic_fusion_cpu", "data.cameras=false"),
            "data.cameras=false leaves the items without images, and the network has a camera branch",
        ),
    ],
)
def test_a_bad_model_or_training_setting_is_named_with_the_config(overrides, needle):
    with pytest.raises(ValueError) as e:
        _check(*overrides)
    assert needle in str(e.value)
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize(
    "overrides",
    [
        (STATIC, "model.task_weights=uncertainty", "model.net.camera.weights=imagenet"),  # names in weight keys
        (OCC, "model.occupancy.loss.class_weight=log_frequency", "model.occupancy.loss.lovasz_weight=0"),
        (OCC, "model.occupancy.loss.class_weight={car: 3, free: 0.5}"),
        (STATIC, "model.net.image_size=[64,176]", "data.final_dim=[64,176]"),
        (DET, "data.bev_aug=bevdet", "data.augment=true"),
        (TEMPORAL, "model.motion.loss.seg_top_k=0.25", "model.past_cache_max_age=null"),
        ("experiment=synthetic_lidar_cpu", "data.cameras=true"),  # a LiDAR-only network may read items with images
    ],
)
def test_good_settings_pass(overrides):
    _check(*overrides)


def test_every_shipped_experiment_passes():
    from bev.utils.config import CONFIG_DIR

    names = sorted(p.stem for p in (Path(CONFIG_DIR) / "experiment").glob("*.yaml"))
    assert len(names) > 10
    for name in names:
        _check(f"experiment={name}")


def test_the_losses_refuse_bad_settings_when_built_in_python_too():
    from bev.tasks.motion.loss import TemporalLoss
    from bev.tasks.occupancy.loss import OccupancyLoss, class_weights

    bad = [
        (lambda: OccupancyLoss(visible_only="maybe"), "model.occupancy.loss.visible_only must be true or false"),
        (
            lambda: OccupancyLoss(lovasz_weight=float("nan")),
            "model.occupancy.loss.lovasz_weight must be a finite number >= 0",
        ),
        (lambda: class_weights(5), "model.occupancy.loss.class_weight=5: choose null"),
        (lambda: class_weights({"car": float("inf")}), "the weights of {'car': inf} are not finite numbers >= 0"),
        (lambda: TemporalLoss(uncertainty="maybe"), "model.motion.loss.uncertainty must be true or false"),
        (lambda: TemporalLoss(weights={"kl": -1}), "model.motion.loss.weights.kl must be a finite number >= 0"),
        (lambda: TemporalLoss(seg_top_k=0), "model.motion.loss.seg_top_k must be in (0, 1]"),
    ]
    for build, needle in bad:
        with pytest.raises(ValueError) as e:
            build()
        assert needle in str(e.value)
