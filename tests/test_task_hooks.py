"""What bev.predict, bev-predict and bev-export ask each task (bev.tasks.task.Task's hooks), on small models built
here: the exported maps by head, boxes from the tasks that give them, a bare network's predictions, the npz arrays
and records of each task's predictions."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bev.inference import DETECTION_OUTPUTS, SEGMENTATION_OUTPUTS, ExportedMaps, detects, per_sample, predict
from bev.tasks import TASKS, task_class, task_classes
from bev.tasks.task import NPZ_SCALE, Task, quantised
from helpers.models import GRID, SIZE, TINY_NET, lss_net, model_inputs

DETECTION_HEAD = {"head_channels": 0, "shared_channels": 8}


@pytest.fixture(scope="module")
def det_net():
    torch.manual_seed(0)
    return lss_net(GRID, SIZE, detection=DETECTION_HEAD, **TINY_NET).eval()


def test_every_task_has_its_class_in_its_package():
    assert [t.name for t in task_classes()] == list(TASKS)
    assert all(issubclass(task_class(name), Task) for name in TASKS)
    with pytest.raises(ValueError, match="unknown task 'lidar'"):
        task_class("lidar")


def test_exported_maps_are_each_heads_with_boxes_only_where_asked(det_net):
    inputs = model_inputs(B=1)
    with torch.no_grad():
        out = det_net(*inputs)
        maps = ExportedMaps(det_net, boxes=True)(*inputs)
        logits = ExportedMaps(det_net, boxes=False)(*inputs)
    assert ExportedMaps(det_net, boxes=True).output_names == DETECTION_OUTPUTS
    assert ExportedMaps(det_net, boxes=True).sources == {"logits": "segmentation", "heatmap": "detection"} | {
        "regression": "detection"
    }
    assert list(maps) == list(DETECTION_OUTPUTS)
    torch.testing.assert_close(maps["heatmap"], out["detection"]["heatmap"])
    assert ExportedMaps(det_net, boxes=False).output_names == SEGMENTATION_OUTPUTS
    torch.testing.assert_close(logits, out["segmentation"])  # one map alone: the bare tensor, as ever


def test_boxes_come_from_the_tasks_that_give_them(det_net):
    assert detects(det_net)  # a bare network's tasks are its heads
    assert not detects(lss_net(GRID, SIZE, **TINY_NET))
    with pytest.raises(ValueError, match="boxes=True needs a network with a detection head"):
        ExportedMaps(lss_net(GRID, SIZE, **TINY_NET), boxes=True)


def test_a_bare_network_gives_what_its_heads_need_no_options_for(det_net):
    inputs = dict(zip(["images", "intrinsics", "rots", "trans", "post_rots", "post_trans"], model_inputs(B=2)))
    probs = predict(det_net, inputs)  # the detection head's boxes need the task's decoding options
    with torch.no_grad():
        expected = det_net(*inputs.values())["segmentation"].sigmoid()
    torch.testing.assert_close(probs, expected)


def test_predictions_split_into_samples_on_the_cpu():
    pred = {"bev": torch.rand(2, 3, 4, 4), "detections": [{"scores": torch.ones(1)}, {"scores": torch.zeros(2)}]}
    items = per_sample(pred)
    assert len(items) == 2 and items[1]["detections"]["scores"].shape == (2,)
    torch.testing.assert_close(items[0]["bev"], pred["bev"][0])


def test_quantised_probabilities_read_back_within_half_a_step():
    p = torch.rand(3, 5, 5) * 1.2 - 0.1
    q = quantised(p)
    assert q.dtype == np.uint8
    assert np.abs(q / NPZ_SCALE - p.clamp(0, 1).numpy()).max() <= 0.5 / NPZ_SCALE + 1e-6


def test_the_segmentation_task_writes_one_array_per_class():
    seg = task_class("segmentation")(GRID, ["vehicle"], ["drivable_area"])
    arrays = seg.npz_arrays({"bev": torch.tensor([[[0.0, 1.0]], [[0.5, 0.2]]])})
    assert list(arrays) == ["vehicle", "drivable_area"] and arrays["vehicle"].tolist() == [[0, 255]]
    with pytest.raises(ValueError, match="probs must be"):
        seg.npz_arrays({"bev": torch.zeros(3, 2, 2)})


def test_the_detection_task_writes_boxes_only_with_boxes():
    det = task_class("detection")(GRID)
    assert det.start_predicting({"boxes": True}) and not det.start_predicting({"boxes": False})
    boxes = {"boxes": torch.zeros(2, 9), "scores": torch.tensor([0.9, 0.1]), "labels": torch.tensor([0, 1])}
    item = {"detections": boxes}
    assert set(det.npz_arrays(item)) >= {"det_boxes", "det_scores", "det_labels"}
    record = det.sample_record(item, {"box_threshold": 0.5})
    assert record["num_boxes"] == 2 and [b["label"] for b in record["boxes"]] == ["car"]
    assert det.prediction_format({"box_threshold": 0.5})["box_threshold"] == 0.5
    assert "box_threshold" not in det.picture_layers(item, {})  # bev-eval: bev.viz's default
    context = SimpleNamespace(index={}, row=0, follows=False)
    assert det.sample_prediction(item, context) is item  # no tracks: the boxes as decoded


def test_the_occupancy_task_writes_the_challenge_format(tmp_path):
    from bev.tasks.occupancy.io import read_prediction

    occ = task_class("occupancy")()
    labels = torch.full((200, 200, 16), 17, dtype=torch.uint8)
    path = occ.write_sample(tmp_path, "tok", {"occupancy": labels})
    assert path == occ.sample_file(tmp_path, "tok") == tmp_path / "predictions" / "tok.npz"
    assert (read_prediction(path) == 17).all()
    assert "Occ3D challenge format" in occ.prediction_format({})["npz_format"]
