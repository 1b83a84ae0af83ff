"""bev-export of camera + LiDAR and LiDAR-only models: the pillar scatters of the exportable path equal bev.ops'
voxel_sum and PillarMax, and ONNX Runtime (and torch.export) agree with PyTorch's own path (the op, PillarMax) on
other point counts than the traced one, a sample with no points, and points the branch drops."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from bev.geometry import Grid
from bev.inference import (
    CAMERA_INPUTS,
    LIDAR_INPUTS,
    ExportedMaps,
    example_inputs,
    export_onnx,
    input_names,
    onnx_outputs,
)
from bev.models import BEVNet
from bev.models.lidar import PillarEncoder, PillarMax, pillar_keys, scatter_max, scatter_sum
from helpers.models import GRID, SIZE, model_inputs

CAMERA = {"backbone": "small", "widths": (8, 8, 16, 16, 16), "mid_channels": 16, "context_channels": 8}
DECODER = {"widths": (8, 16, 16), "blocks": 1}
# Two PFN layers: the first one's pillar max is gathered back to the points, a scatter-max in the graph too.
LIDAR = {"pfn_channels": (8, 8), "widths": (8, 8, 8), "blocks": (1, 1, 1), "up_channels": (4, 4, 4)}
SMALL = Grid(xbound=(-4.0, 4.0, 1.0), ybound=(-3.0, 3.0, 1.0), zbound=(-2.0, 2.0, 4.0))
ATOL = 1e-4

# ONNX export and ONNX Runtime: bev[export]'s packages (the scatter and torch.export tests need none of them)
needs_onnx = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("onnx", "onnxscript", "onnxruntime")),
    reason="onnx, onnxscript or onnxruntime is not installed (pip install 'bev[export]')",
)


def _lively(net: torch.nn.Module, inputs: tuple[torch.Tensor, ...], seed: int = 1) -> None:
    """Batch norms calibrated on `inputs` (a BEVNet's, in input_names order; a PillarEncoder's (points, batch size)),
    their running statistics those of one pass in training mode, with random affine weights: at its initial weights
    a tiny network's output is its last biases, flat to 1e-5 whatever the points, which would hide a broken branch
    under the tolerance. Eval mode after."""
    g = torch.Generator().manual_seed(seed)
    for m in net.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            m.momentum = None  # a cumulative average: one pass sets the statistics
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.3)
    with torch.no_grad():
        if isinstance(net, PillarEncoder):
            net.train()(*inputs)
        else:
            *cams, points, num_points = inputs
            net.train()(*cams, points=points, batch_size=len(num_points))
    net.eval()


def tiny_net(kind: str, reduce: str = "max") -> BEVNet:
    torch.manual_seed(0)
    fused = kind == "fused"
    net = BEVNet(
        GRID,
        SIZE,
        camera=CAMERA if fused else None,
        decoder=DECODER,
        lidar={**LIDAR, "reduce": reduce},
        fuser={"kind": "conv"} if fused else None,
    )
    _lively(net, feeds(net, 2, [3000, 2000], seed=11))
    return net


def odd_cloud(batch_size: int, counts: list[int], seed: int) -> torch.Tensor:
    """Rows of `counts[b]` points per sample over GRID (and a little past it), shuffled across samples, plus rows the
    branch drops: a NaN coordinate, a batch index past the batch size, one above the grid."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b, n in enumerate(counts):
        xyz = torch.rand(n, 3, generator=g) * torch.tensor([52.0, 52.0, 22.0]) - torch.tensor([26.0, 26.0, 11.0])
        extra = torch.rand(n, 2, generator=g) * torch.tensor([255.0, 0.5])
        rows.append(torch.cat([torch.full((n, 1), float(b)), xyz, extra], 1))
    odd = torch.tensor(
        [[0, float("nan"), 1.0, 0.0, 9, 0], [batch_size, 1.0, 1.0, 0.0, 9, 0], [0, 1.0, 1.0, 10.5, 9, 0]]
    )
    cloud = torch.cat([*rows, odd])
    return cloud[torch.randperm(len(cloud), generator=g)]  # the batch index column says the sample, not the order


def feeds(net: BEVNet, batch_size: int, counts: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    """The exported model's inputs (input_names order) for `batch_size` samples of counts[b] points each."""
    cams = model_inputs(B=batch_size, seed=seed) if net.camera is not None else ()
    points = odd_cloud(batch_size, counts, seed)
    return (*cams, points, torch.tensor(counts, dtype=torch.int64))


def pytorch_maps(net: BEVNet, inputs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """PyTorch's own path (bev.ops.voxel_sum, PillarMax), outside exportable()."""
    *cams, points, num_points = inputs
    with torch.no_grad():
        out = net(*cams, points=points, batch_size=len(num_points))
    return {"logits": out["segmentation"]}


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert list(got) == list(want)
    for k in want:
        assert got[k].shape == want[k].shape, k
    return max(float((got[k] - want[k]).abs().max()) for k in want)


# ----------------------------------------------------------------------------- the scatters against the ops


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_scatter_sum_and_max_equal_voxel_sum_and_pillar_max(backend):
    """On random points (some outside the grid: the dump row) and features of both signs, scatter_sum's table is
    bev.ops.voxel_sum's canvas and scatter_max's is PillarMax's, 0 in empty pillars, the dump row apart."""
    from bev import ops

    if backend == "native" and not ops.native_available("cpu"):
        pytest.skip("the native CPU kernel is not built here")
    g = torch.Generator().manual_seed(0)
    B, X, Y, C, P = 3, SMALL.nx, SMALL.ny, 5, 700
    rows = B * X * Y
    cells = torch.stack(
        [
            torch.randint(0, B, (P,), generator=g),
            torch.randint(0, X, (P,), generator=g),
            torch.randint(0, Y, (P,), generator=g),
        ],
        1,
    )
    cells[:, 2] = torch.where(cells[:, 0] == 2, cells[:, 2].clamp(max=1), cells[:, 2])  # sample 2: empty columns
    kept = torch.rand(P, generator=g) > 0.2
    flat = (cells[:, 0] * X + cells[:, 1]) * Y + cells[:, 2]
    flat = torch.where(kept, flat, torch.full_like(flat, rows))
    x = torch.randn(P, C, generator=g) * 3 - 1  # mostly negative in places: a max that must not start at 0

    sums = scatter_sum(x, flat, rows)
    coords = torch.stack([cells[kept, 0], torch.zeros_like(cells[kept, 0]), cells[kept, 1], cells[kept, 2]], 1)
    op = ops.voxel_sum(x[kept], coords, (B, 1, X, Y), backend=backend)[:, :, 0]
    assert sums.shape == (rows + 1, C)
    torch.testing.assert_close(sums[:rows], op.permute(0, 2, 3, 1).reshape(rows, C), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sums[rows], x[~kept].sum(0), atol=1e-4, rtol=1e-5)

    maxes = scatter_max(x, flat, rows)
    want = PillarMax.apply(x[kept], flat[kept], rows)
    assert torch.equal(maxes[:rows], want)
    empty = torch.ones(rows, dtype=torch.bool)
    empty[flat[kept]] = False
    assert empty.sum() > 5 and maxes[:rows][empty].abs().sum() == 0
    assert (want[~empty] < 0).any()  # pillars whose max is negative: a table starting at 0 would give 0


@pytest.mark.parametrize("reduce", ["max", "mean"])
@pytest.mark.parametrize("channels", [(8,), (6, 10)])
def test_exportable_pillars_equal_the_op_path(reduce, channels):
    """PillarEncoder inside exportable() (every point through the PFN, dropped ones to the dump row) against its
    own path (points filtered, bev.ops.voxel_sum, PillarMax): clouds with dropped points, an empty sample, none."""
    torch.manual_seed(0)
    enc = PillarEncoder(SMALL, channels, reduce=reduce)
    g = torch.Generator().manual_seed(2)
    n = 300
    xyz = torch.rand(n, 3, generator=g) * torch.tensor([9.0, 7.0, 5.0]) - torch.tensor([4.5, 3.5, 2.5])
    cloud = torch.cat([torch.randint(0, 2, (n, 1), generator=g).float() * 2, xyz, torch.rand(n, 2, generator=g)], 1)
    cloud = torch.cat([cloud, torch.tensor([[0, float("nan"), 0, 0, 1, 0], [0, 3.999, 2.5, 0, 1, 0]])])
    assert pillar_keys(cloud, SMALL, 3)[1].sum() < len(cloud) - 50  # many dropped points
    _lively(enc, (cloud, 3))
    for points in (cloud, cloud[:0]):  # sample 1 has no points; then no sample has any
        with torch.no_grad():
            want = enc(points, 3)
            with enc.exportable():
                got = enc(points, 3)
        assert got.shape == want.shape == (3, channels[-1], SMALL.nx, SMALL.ny)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert want.abs().sum() == 0 and got.abs().sum() == 0  # no points, no features
    with torch.no_grad():
        assert enc(cloud, 3)[0].abs().sum() > 0 and enc(cloud, 3)[1].abs().sum() == 0


# ------------------------------------------------------------------------------ ONNX of tiny networks


def test_input_names_and_example_points():
    fused, lidar = tiny_net("fused"), tiny_net("lidar")
    assert input_names(fused) == (*CAMERA_INPUTS, *LIDAR_INPUTS) == ExportedMaps(fused).input_names
    assert input_names(BEVNet(GRID, SIZE, camera=CAMERA)) == tuple(CAMERA_INPUTS)
    assert input_names(lidar) == ("points", "num_points") == ExportedMaps(lidar).input_names
    points, num_points = example_inputs(lidar, batch_size=2, points_per_sample=500)
    assert points.shape == (1000, 6) and num_points.tolist() == [500, 500]
    assert points[:500, 0].eq(0).all() and points[500:, 0].eq(1).all()  # sample by sample, as collate orders them
    inside = pillar_keys(points, GRID, 2)[1]
    assert 0.6 < inside.float().mean() < 1  # over the grid, a few past its edges
    images, *_, pts, counts = example_inputs(fused, num_cameras=4, batch_size=3, points_per_sample=10)
    assert images.shape[:2] == (3, 4) and pts.shape == (30, 6) and counts.tolist() == [10] * 3
    with pytest.raises(ValueError, match=r"takes 2 inputs \(points, num_points\), got 1"):
        ExportedMaps(lidar)(points)


@pytest.fixture(scope="module", params=[("fused", "max"), ("lidar", "mean")], ids=["fused", "lidar_only"])
def exported(request, tmp_path_factory):
    kind, reduce = request.param
    net = tiny_net(kind, reduce)
    path = tmp_path_factory.mktemp(kind) / "model.onnx"
    example = example_inputs(net, batch_size=1, points_per_sample=2500)
    export_onnx(net, example, path)
    return net, path, example


@needs_onnx
def test_onnx_graph_takes_points_and_scatters_them(exported):
    import onnx

    net, path, _ = exported
    proto = onnx.load(str(path))
    inputs = {i.name: i.type.tensor_type for i in proto.graph.input}
    assert list(inputs) == list(input_names(net))
    assert (
        inputs["points"].elem_type == onnx.TensorProto.FLOAT
        and inputs["num_points"].elem_type == onnx.TensorProto.INT64
    )
    dims = inputs["points"].shape.dim
    assert dims[0].dim_param and not dims[0].dim_value and dims[1].dim_value == 6  # M dynamic
    assert inputs["num_points"].shape.dim[0].dim_param  # the batch dynamic
    reductions = [(n.op_type, a.s.decode()) for n in proto.graph.node for a in n.attribute if a.name == "reduction"]
    # fused (max): the camera splat and the pillar means of the offsets; LiDAR-only (mean): those and the canvas
    assert reductions.count(("ScatterND", "add")) == 2
    # the first PFN layer's pillar max, gathered back to the points, and a max canvas
    assert reductions.count(("ScatterElements", "max")) == (2 if net.lidar.pillars.reduce == "max" else 1)
    assert not any(n.op_type in ("NonZero", "Compress") for n in proto.graph.node)  # no data-dependent shapes


@needs_onnx
def test_onnx_runtime_matches_pytorch_on_other_point_counts(exported):
    net, path, example = exported
    want = pytorch_maps(net, example)
    assert want["logits"].std() > 0
    assert max_diff(onnx_outputs(path, example), want) <= ATOL  # batch 1 (traced with 2)
    # Three samples, the second with no points, other counts than traced, dropped rows, shuffled.
    inputs = feeds(net, 3, [1700, 0, 4100], seed=5)
    want = pytorch_maps(net, inputs)
    got = onnx_outputs(path, inputs)
    assert max_diff(got, want) <= ATOL
    moved = list(inputs)
    moved[-2] = inputs[-2].clone()
    moved[-2][:, 1] += 6.0
    assert (onnx_outputs(path, tuple(moved))["logits"] - got["logits"]).abs().max() > 1e-3  # the points are read
    assert (want["logits"][1] - want["logits"][0]).abs().max() > 1e-3  # the empty sample is one of its own
    # No point at all (M = 0), by name
    empty = {**dict(zip(input_names(net), inputs)), "points": inputs[-2][:0]}
    assert max_diff(onnx_outputs(path, empty), pytorch_maps(net, tuple(empty.values()))) <= ATOL


def test_a_lidar_model_needs_opset_18(tmp_path):
    net = tiny_net("lidar")
    with pytest.raises(ValueError, match=r"LiDAR model exports with opset >= 18 .*got 17"):
        export_onnx(net, example_inputs(net, points_per_sample=10), tmp_path / "m.onnx", opset=17)
    assert not (tmp_path / "m.onnx").exists()


# ----------------------------------------------------------------------- bev-export on LiDAR checkpoints

TINY_LIDAR = [
    "model.net.lidar.pfn_channels=[8,8]",
    "model.net.lidar.widths=[8,8,8]",
    "model.net.lidar.up_channels=[4,4,4]",
]


def _checkpoint(folder, experiment: str):
    """A checkpoint as bev-train writes it (its state_dict and resolved run config) of the tiny `experiment` model,
    its batch norms calibrated (_lively): what bev-export reads, without a training run."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf, open_dict

    from helpers.cli import TINY
    from helpers.train_step import compose_train

    camera = experiment == "synthetic_fusion_cpu"
    overrides = [
        a for a in TINY if not a.startswith("experiment=") and (camera or not a.startswith("model.net.camera."))
    ]
    cfg = compose_train([*overrides, f"experiment={experiment}", *TINY_LIDAR])
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    _lively(model.net, feeds(model.net, 2, [3000, 2000], seed=11))
    with open_dict(cfg):
        del cfg["hydra"]  # bev-train's config has none (its ${hydra:...} values resolve from HydraConfig)
    run = OmegaConf.to_container(cfg, resolve=True)
    path = folder / f"{experiment}.ckpt"
    torch.save({"state_dict": model.state_dict(), "bev_config": run, "epoch": 0, "global_step": 1}, path)
    return path


@pytest.fixture(scope="module", params=["synthetic_fusion_cpu", "synthetic_lidar_cpu"], ids=["fused", "lidar_only"])
def lidar_checkpoint(request, tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("ckpt"), request.param)


def _export(args, monkeypatch, capsys) -> str:
    from bev import export as bev_export
    from helpers.cli import run_cli

    code = run_cli(bev_export._hydra_main, args, monkeypatch)
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    return out


def _pytorch_detection_maps(model, inputs):
    *cams, points, num_points = inputs
    with torch.no_grad():
        out = model.net(*cams, points=points, batch_size=len(num_points))
    return {"logits": out["segmentation"], **out["detection"]}


@pytest.mark.e2e
@needs_onnx
def test_bev_export_onnx_of_a_lidar_checkpoint(lidar_checkpoint, tmp_path, monkeypatch, capsys):
    import bev

    path = tmp_path / "model.onnx"
    args = [f"ckpt_path={lidar_checkpoint}", f"out={path}", "num_cameras=6", f"hydra.run.dir={tmp_path / 'run'}"]
    printed = _export(args, monkeypatch, capsys)
    reported = float(re.search(r"max \|output - PyTorch\| on an example: (\S+)", printed).group(1))
    assert reported <= ATOL, printed
    model = bev.load_model(lidar_checkpoint)
    assert "inputs " + ", ".join(input_names(model)) in printed
    assert model.net.lidar is not None and "detection" in model.net.heads
    inputs = feeds(model.net, 2, [0, 3300], seed=7)  # exported with batch 1 and 3000 points a sample
    want = _pytorch_detection_maps(model, inputs)
    got = onnx_outputs(path, inputs)
    assert list(got) == ["logits", "heatmap", "regression"]
    assert max_diff(got, want) <= ATOL
    assert all(v[1].std() > 0 for v in want.values())


@pytest.mark.e2e
def test_bev_export_torch_program_of_a_lidar_checkpoint(lidar_checkpoint, tmp_path, monkeypatch, capsys):
    import bev

    path = tmp_path / "model.pt2"
    args = [f"ckpt_path={lidar_checkpoint}", f"out={path}", "format=torch_export", "batch_size=2"]
    printed = _export([*args, f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch, capsys)
    assert float(re.search(r"on an example: (\S+)", printed).group(1)) <= ATOL
    model = bev.load_model(lidar_checkpoint)
    inputs = feeds(model.net, 2, [2222, 0], seed=8)  # another M than the example's: M is dynamic
    with torch.no_grad():
        got = torch.export.load(path).module()(*inputs)
    assert (
        max_diff({k: got[k] for k in ("logits", "heatmap", "regression")}, _pytorch_detection_maps(model, inputs))
        <= ATOL
    )
