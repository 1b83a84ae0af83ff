"""More training processes than validation samples: each sample is validated on exactly one process, so one process
would validate none and the others would wait for it in the gathering of the scores (an AssertionError for
occupancy, a gloo "Connection closed by peer" for detection). bev-train refuses it in one line before any process
starts."""

import pytest
from omegaconf import OmegaConf

from bev.train import _check_val_samples_per_process
from helpers.cli import TINY, train_cli


def _trainer(**kw):
    return OmegaConf.create({"accelerator": "cpu", "devices": 2, "num_nodes": 1, **kw})


@pytest.mark.parametrize(("kw", "world"), [({}, 2), ({"devices": [0, 1]}, 2), ({"devices": 1, "num_nodes": 3}, 3)])
def test_fewer_validation_samples_than_processes_are_refused(kw, world):
    with pytest.raises(ValueError) as e:
        _check_val_samples_per_process(_trainer(**kw), 1, "mini_val")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1, msg
    assert f"= {world} processes share the 1 validation sample(s) of 'mini_val'" in msg
    assert f"{world - 1} would validate none" in msg
    assert "Use at most 1 process(es) in all (trainer.devices x trainer.num_nodes)" in msg
    assert f"a validation split of at least {world} samples (data.val_split)" in msg


@pytest.mark.parametrize(
    ("kw", "samples"),
    [
        ({}, 2),  # one each
        ({"devices": 1}, 1),
        ({"devices": "auto"}, 1),  # Lightning counts the devices: nothing known to check
        ({"limit_val_batches": 0}, 1),  # no validation
        ({"limit_val_batches": 0.0}, 1),
        ({}, 0),  # an empty split: no process validates, none waits
    ],
)
def test_every_process_with_a_validation_sample_passes(kw, samples):
    _check_val_samples_per_process(_trainer(**kw), samples, "mini_val")


def test_bev_train_refuses_it_before_the_processes_start(synthetic_root, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    # mini_val holds 3 samples: 4 processes (a batch of 1 sample each from mini_train's 3 training samples).
    args = [*TINY, "trainer=ddp_cpu", "trainer.devices=4", "data.batch_size=1", f"data.dataroot={synthetic_root}"]
    with pytest.warns(UserWarning, match="CPU training processes"):
        assert train_cli([*args, f"hydra.run.dir={run}"], monkeypatch) == 1
    err = capsys.readouterr().err  # the data's indexing lines, then the error
    assert "Traceback" not in err
    said = err.strip().splitlines()[-1]
    assert said.startswith("bev-train: error: ValueError: trainer.devices=4 x trainer.num_nodes=1 = 4 processes"), err
    assert "the 3 validation sample(s) of 'mini_val'" in said
    assert not (run / "checkpoints").exists()
