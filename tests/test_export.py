"""bev-export: ONNX (run by ONNX Runtime) and torch.export (.pt2) agree with PyTorch on real samples.

The exported model is `tiny_run` (tests/conftest.py), a real bev-train run: the tests that use it
are end-to-end (marker e2e)."""

import pytest
import torch

import bev
from bev import export as bev_export
from helpers.cli import assert_one_paragraph, run_cli
from helpers.models import CLASSES, GRID, SIZE, TINY_NET, val_batch


def export_cli(args, monkeypatch):
    return run_cli(bev_export._hydra_main, args, monkeypatch)


def camera_inputs(batch):
    from bev.inference import CAMERA_INPUTS

    return tuple(batch[k] for k in CAMERA_INPUTS)


@pytest.mark.e2e
def test_onnx_runtime_matches_pytorch(tiny_run, synthetic_root, tmp_path, monkeypatch):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install 'bev[export]')")
    import onnx

    path = tmp_path / "model.onnx"
    assert export_cli([f"ckpt_path={tiny_run}", f"out={path}", f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch) == 0
    proto = onnx.load(str(path))
    assert proto.opset_import[0].version >= 17
    scatter = [n for n in proto.graph.node if n.op_type in ("ScatterND", "ScatterElements")]
    assert scatter and all(a.s == b"add" for n in scatter for a in n.attribute if a.name == "reduction")

    model = bev.load_model(tiny_run)
    batch = val_batch(synthetic_root, model, n=3)  # exported with batch 1: the batch size is dynamic
    with torch.no_grad():
        expected = model(batch)["segmentation"]  # the native bev_pool splat
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    from bev.inference import CAMERA_INPUTS

    got = session.run(["logits"], {k: batch[k].numpy() for k in CAMERA_INPUTS})[0]
    assert got.shape == tuple(expected.shape) == (3, len(CLASSES), 24, 24)
    assert float((torch.from_numpy(got) - expected).abs().max()) <= 1e-3
    assert expected.std() > 0  # a constant output would hide a broken splat


@pytest.mark.e2e
def test_torch_export_round_trip_keeps_the_custom_op(tiny_run, synthetic_root, tmp_path, monkeypatch):
    from bev import ops

    if not ops.native_available("cpu"):
        pytest.skip("the native bev.ops build is not loaded")
    path = tmp_path / "model.pt2"
    args = [
        f"ckpt_path={tiny_run}",
        f"out={path}",
        "format=torch_export",
        "batch_size=2",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    assert export_cli(args, monkeypatch) == 0
    program = torch.export.load(path)
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.bev.bev_pool.default) == 1
    model = bev.load_model(tiny_run)
    batch = val_batch(synthetic_root, model, n=2)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(*camera_inputs(batch)), model(batch)["segmentation"])


def test_scatter_splat_equals_bev_pool():
    """The export-only splat sums the same points into the same cells as bev.ops (incl. out-of-grid ones)."""
    from bev.inference import example_inputs
    from helpers.models import lss_net

    net = lss_net(GRID, SIZE, pool_backend="torch", **TINY_NET).eval()
    x = example_inputs(net, num_cameras=4, batch_size=2)
    with torch.no_grad():
        expected = net(*x)["segmentation"]
        with net.exportable():
            got = net(*x)["segmentation"]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["format", "checkpoint"])
def test_bad_input(case, tiny_run, tmp_path, monkeypatch, capsys):
    args = {"ckpt_path": tiny_run, "out": tmp_path / "m.onnx", "hydra.run.dir": tmp_path / "run"}
    if case == "format":
        args["format"] = "tflite"
        needles = ("unknown format 'tflite'", "torch_export")
    else:
        args["ckpt_path"] = tmp_path / "nope.ckpt"
        needles = ("does not exist",)
    assert export_cli([f"{k}={v}" for k, v in args.items()], monkeypatch) == 1
    assert_one_paragraph(capsys.readouterr().err, "bev-export: error:", *needles)
