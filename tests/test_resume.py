"""No lost epochs: last.ckpt holds the state after the last step of every epoch and at the end of training,
also in epochs without a validation, and a run resumed from it ends at the steps and (on the CPU) the
weights of the same run left uninterrupted."""

import pytest
import torch

from helpers.cli import TINY, train_cli

EPOCHS, STEPS_PER_EPOCH = 3, 3  # 3 training samples at batch size 1


def args(root, run, *extra):
    # Validation every 2nd epoch: epochs 0 and 2 end without one. One intra-op thread: the same float
    # summation order in every run, whatever the machine's load (threads: auto would follow it).
    return [
        *TINY,
        "data.batch_size=1",
        f"trainer.max_epochs={EPOCHS}",
        "trainer.check_val_every_n_epoch=2",
        "threads=1",
        "seed=7",
        "callbacks.bev_png.every_n_steps=0",
        f"data.dataroot={root}",
        f"hydra.run.dir={run}",
        "+callbacks.snapshot._target_=helpers.snapshots.SnapshotLast",
        "+callbacks.snapshot.dirpath=${paths.output_dir}/checkpoints",
        *extra,
    ]


@pytest.fixture(scope="module")
def uninterrupted(synthetic_root, tmp_path_factory):
    run = tmp_path_factory.mktemp("whole")
    mp = pytest.MonkeyPatch()
    try:
        assert train_cli(args(synthetic_root, run), mp) == 0
    finally:
        mp.undo()
    return run / "checkpoints"


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def test_last_ckpt_after_every_epoch_and_at_the_end(uninterrupted):
    for epoch in range(EPOCHS - 1):  # what a kill as the next epoch starts would leave
        snap = uninterrupted / f"last_after_epoch_{epoch:03d}.ckpt"
        assert snap.is_file(), f"no last.ckpt after epoch {epoch}"
        assert load(snap)["global_step"] == (epoch + 1) * STEPS_PER_EPOCH
    last, final = load(uninterrupted / "last.ckpt"), load(uninterrupted / "final_weights.pt")
    assert last["global_step"] == final["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert all(torch.equal(last["state_dict"][k], v) for k, v in final["state_dict"].items())


@pytest.mark.parametrize("epochs_done", [1, 2])
def test_stop_and_resume_ends_where_the_whole_run_does(
    epochs_done, uninterrupted, synthetic_root, tmp_path, monkeypatch
):
    snap = uninterrupted / f"last_after_epoch_{epochs_done - 1:03d}.ckpt"
    assert train_cli(args(synthetic_root, tmp_path, f"ckpt_path={snap}"), monkeypatch) == 0
    whole, resumed = load(uninterrupted / "final_weights.pt"), load(tmp_path / "checkpoints" / "final_weights.pt")
    assert resumed["global_step"] == whole["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert load(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == EPOCHS * STEPS_PER_EPOCH
    # The CPU kernels are deterministic at a fixed thread count, and the checkpoint carries the RNG
    # states, so the resumed run draws the same batches: the same weights, bit for bit.
    assert whole["state_dict"].keys() == resumed["state_dict"].keys()
    different = [k for k, v in whole["state_dict"].items() if not torch.equal(v, resumed["state_dict"][k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[0]}"


def test_a_run_stopped_mid_epoch_before_any_validation_keeps_its_best_checkpoint(synthetic_root, tmp_path, monkeypatch):
    # As a time budget shortens a run: it stops in epoch 1 (validation every 2nd epoch: none yet) with a
    # validation; the best checkpoint by val/iou must be written at that validation.
    extra = ["+callbacks.stop._target_=helpers.snapshots.StopMidEpoch", "+callbacks.stop.step=5"]
    assert train_cli(args(synthetic_root, tmp_path, *extra), monkeypatch) == 0
    assert (tmp_path / "checkpoints" / "epoch_001.ckpt").is_file()
    assert load(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 5


def temporal_args(root, run, *extra):
    """args() for the temporal experiment (windows of 2 input frames and 1 future frame: one window per
    fixture scene). Without the past-feature cache, which lives in memory and restarts empty on resume."""
    extra = ("data.past_frames=1", "data.future_frames=1", "model.past_cache_mb=0", *extra)
    swap = {"experiment=synthetic_cpu": "experiment=synthetic_temporal_cpu"}  # which has no picture callback
    return [swap.get(a, a) for a in args(root, run, *extra) if not a.startswith("callbacks.bev_png")]


def test_a_temporal_run_stopped_and_resumed_ends_with_the_weights_of_the_whole_run(
    synthetic_root, tmp_path, monkeypatch
):
    whole, part = tmp_path / "whole", tmp_path / "resumed"
    assert train_cli(temporal_args(synthetic_root, whole), monkeypatch) == 0
    steps = load(whole / "checkpoints" / "final_weights.pt")["global_step"]
    assert steps == EPOCHS  # one window per epoch at batch size 1
    snap = whole / "checkpoints" / "last_after_epoch_000.ckpt"
    assert train_cli(temporal_args(synthetic_root, part, f"ckpt_path={snap}"), monkeypatch) == 0
    a, b = load(whole / "checkpoints" / "final_weights.pt"), load(part / "checkpoints" / "final_weights.pt")
    assert a["global_step"] == b["global_step"] == steps
    different = [k for k, v in a["state_dict"].items() if not torch.equal(v, b["state_dict"][k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[0]}"
