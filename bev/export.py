"""`bev-export ckpt_path=PATH out=FILE [format=onnx|torch_export]`: a trained model for deployment.

onnx: torch.onnx.export (dynamo) with the scatter-add splat, opset >= 17, dynamic batch;
torch_export: a .pt2 ExportedProgram keeping bev's voxel-pooling op as one node. With check=true
the exported model is run on an example input (random images, a ring of cameras; random points over the grid for
a LiDAR branch) and compared with PyTorch. The work is in bev.inference (export_onnx, export_program).

A camera + LiDAR or LiDAR-only checkpoint exports with the inputs bev.inference.input_names gives: the cameras'
(none for LiDAR-only), then "points" (M, 6) rows (batch index, x, y, z, intensity, time lag), M dynamic, and
"num_points" (B,). The pillar sums are scatter-adds and the pillar maxima scatter-maxes in the graph (onnx: opset
>= 18, ScatterElements reduction "max"); torch_export keeps M dynamic too.

A checkpoint with a detection head (boxes=auto, the default, or boxes=true) exports the head's maps
beside the BEV logits: outputs "logits" (B, K, X, Y), "heatmap" (B, 10, X, Y) and "regression"
(B, G, 10, X, Y) (bev.inference.DETECTION_OUTPUTS; torch_export returns them as a dict). Boxes are
decoded from them in Python (bev.tasks.detection.decode.decode), as predict does.

Each head's task class says which maps it exports (bev.tasks.task.Task.exported, exported_maps, gives_boxes):
bev.inference.ExportedMaps composes them, asking no task by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from bev.utils.config import CONFIG_DIR
from bev.utils.errors import report_errors


def export(cfg: DictConfig) -> dict[str, Any]:
    """Export the checkpoint's network to cfg.out; returns out, format and, with check=true, max_abs_diff."""
    import torch

    from bev.inference import (
        ExportedMaps,
        boxes_option,
        example_inputs,
        load_checkpoint,
        say_chosen,
        wants_boxes,
        writable_dir,
    )

    boxes_option(cfg.get("boxes", "auto"))
    out = _checked_out(cfg)
    loaded = load_checkpoint(cfg.ckpt_path, trusted=bool(cfg.get("trust_checkpoint")))
    say_chosen(loaded)
    boxes = wants_boxes(cfg.get("boxes", "auto"), loaded.model, loaded.path)
    net = ExportedMaps(loaded.model.net.eval(), boxes).eval()
    _check_something_to_export(loaded, net)
    writable_dir(out.parent, "out (its folder)")  # made now that the checkpoint is checked
    example = example_inputs(loaded.model.net, int(cfg.num_cameras), int(cfg.batch_size))
    with torch.no_grad():
        expected = _named(net(*example), net.output_names)
    result: dict[str, Any] = {
        "out": str(out),
        "format": cfg.format,
        "inputs": list(net.input_names),
        "outputs": list(expected),
    }
    write = _write_onnx if cfg.format == "onnx" else _write_program
    diff = write(net, example, expected, out, cfg)
    if diff is not None:
        result["max_abs_diff"] = diff
    shapes = ", ".join(f"{k} {tuple(v.shape[1:])}" for k, v in expected.items())
    fed = (
        [f"{cfg.num_cameras} cameras of {net.image_size[0]}x{net.image_size[1]}"] if "images" in net.input_names else []
    )
    fed += ["LiDAR points (M, 6) and num_points (B,)"] if "points" in net.input_names else []
    print(
        f"Exported {cfg.format} to {out} ({out.stat().st_size / 1e6:.1f} MB) for {' and '.join(fed)}; inputs "
        f"{', '.join(net.input_names)}; {shapes} per sample"
        + (
            f"; max |output - PyTorch| on an example: {diff:.2e}"
            if isinstance(diff, float)
            else f"; {diff}"
            if diff
            else ""
        )
    )
    return result


def _named(out, names: tuple[str, ...]) -> dict[str, Any]:
    """The exported model's output(s) by name: a bare tensor is its one output (the "logits")."""
    return dict(out) if isinstance(out, dict) else {names[0]: out}


def _max_diff(got, expected: dict[str, Any]) -> float:
    """The largest |got - expected| over the named outputs (a missing or misshapen output is an error)."""
    got = _named(got, tuple(expected))
    if set(got) != set(expected):
        raise RuntimeError(f"the exported model gives outputs {sorted(got)}, PyTorch {sorted(expected)}")
    return max(float((got[k] - v).abs().max()) for k, v in expected.items())


def _check_something_to_export(loaded, net) -> None:
    """Refuse an export of no outputs (heads bev-export writes no maps of) or of untrained ones only (boxes=false on
    a model trained to detect only: its BEV logits)."""
    tasks, outputs, path = list(loaded.model.tasks), net.output_names, str(loaded.path)
    if not outputs:
        raise ValueError(
            f"the checkpoint {path!r} (model.tasks {tasks}) has no head whose maps bev-export writes: it exports "
            "BEV logits and 3D box maps only"
        )
    if not any(net.sources[name] in tasks for name in outputs):
        raise ValueError(
            f"boxes={str(net.boxes).lower()} but the checkpoint {path!r} trains only {', '.join(tasks)} (model.tasks "
            f"{tasks}): its outputs {list(outputs)} are untrained; pass boxes=auto to export the detection maps"
        )


def _checked_out(cfg: DictConfig) -> Path:
    """The output path, once format, num_cameras, the output folder and (onnx) the packages are checked."""
    from bev.inference import EXPORT_FORMATS, creatable_dir
    from bev.utils.io import check_output

    if cfg.format not in EXPORT_FORMATS:
        raise ValueError(f"unknown format {cfg.format!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    if not 1 <= int(cfg.num_cameras) <= 12:
        raise ValueError(f"num_cameras must be in 1..12, got {cfg.num_cameras}")
    out = Path(cfg.out).expanduser()
    suffix = ".onnx" if cfg.format == "onnx" else ".pt2"
    if out.is_dir():  # found now, not after the whole export
        raise IsADirectoryError(
            f"out={str(out)!r} is a folder; pass the file to write, e.g. out={out / ('model' + suffix)}"
        )
    if out.suffix in (".onnx", ".pt2") and out.suffix != suffix:  # the file would claim the other format
        raise ValueError(
            f"out={str(out)!r} names a {out.suffix} file but format={cfg.format} writes {suffix}: "
            f"pass out={out.with_suffix(suffix)}, or the format that writes {out.suffix}"
        )
    check_output(out, _overwrite(cfg), "out")  # an earlier export, or a device node, is never replaced unasked
    creatable_dir(out.parent, "out (its folder)")  # not made yet: see export()
    if cfg.format == "onnx":
        try:
            import onnx  # noqa: F401
            import onnxscript  # noqa: F401
        except ImportError as e:
            raise ImportError(
                f"format=onnx needs the onnx and onnxscript packages ({e}); pip install 'bev[export]'"
            ) from None
    return out


def _overwrite(cfg: DictConfig) -> bool:
    from bev.inference import overwrite_option

    return overwrite_option(cfg.get("overwrite", False))


def _write_onnx(net, example: tuple, expected, out: Path, cfg: DictConfig) -> float | str | None:
    """Write the ONNX model; with check=true, its max |output - PyTorch| over the outputs run by ONNX Runtime
    (or why not)."""
    from bev.inference import export_onnx, onnx_outputs

    export_onnx(net, example, out, int(cfg.opset), overwrite=_overwrite(cfg))
    if not cfg.check:
        return None
    try:
        return _max_diff(onnx_outputs(out, example), expected)
    except ImportError:
        return "not checked: onnxruntime is not installed"


def _write_program(net, example: tuple, expected, out: Path, cfg: DictConfig) -> float | None:
    """Write the .pt2 ExportedProgram; with check=true, the loaded program's max |output - PyTorch|."""
    import torch

    from bev import ops
    from bev.inference import export_program

    if "images" in net.input_names and not ops.native_available("cpu"):
        print(
            "bev-export: warning: the native bev.ops build is not loaded; the program contains the pure-torch "
            "reference pooling instead of the torch.ops.bev.bev_pool node"
        )
    export_program(net, example, out, overwrite=_overwrite(cfg))
    if not cfg.check:
        return None
    with torch.no_grad():
        return _max_diff(torch.export.load(out).module()(*example), expected)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="export")
@report_errors("bev-export")
def _hydra_main(cfg: DictConfig) -> None:
    export(cfg)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
