"""bev-train's checks of the trainer config before any data is read."""

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
