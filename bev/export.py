"""`bev-export ckpt_path=PATH out=FILE [format=onnx|torch_export]`: a trained model for deployment.

onnx: torch.onnx.export (dynamo) with the scatter-add splat, opset >= 17, dynamic batch;
torch_export: a .pt2 ExportedProgram keeping bev's voxel-pooling op as one node. With check=true
the exported model is run on an example input (random images, a ring of cameras) and compared
with PyTorch. The work is in bev.inference (export_onnx, export_program).
"""
from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig

from bev.utils.config import CONFIG_DIR
from bev.utils.errors import report_errors


def export(cfg: DictConfig) -> dict[str, Any]:
    from pathlib import Path

    import torch

    from bev.inference import EXPORT_FORMATS, example_inputs, export_onnx, export_program, load_checkpoint, run_onnx, writable_dir

    if cfg.format not in EXPORT_FORMATS:
        raise ValueError(f"unknown format {cfg.format!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    if not 1 <= int(cfg.num_cameras) <= 12:
        raise ValueError(f"num_cameras must be in 1..12, got {cfg.num_cameras}")
    out = Path(cfg.out).expanduser()
    writable_dir(out.parent, "out (its folder)")
    if cfg.format == "onnx":
        try:
            import onnx  # noqa: F401
            import onnxscript  # noqa: F401
        except ImportError as e:
            raise ImportError(f"format=onnx needs the onnx and onnxscript packages ({e}); pip install 'bev[export]'") from None
    net = load_checkpoint(cfg.ckpt_path).model.net.eval()
    example = example_inputs(net, int(cfg.num_cameras), int(cfg.batch_size))
    with torch.no_grad():
        expected = net(*example)
    result: dict[str, Any] = {"out": str(out), "format": cfg.format}
    if cfg.format == "onnx":
        export_onnx(net, example, out, int(cfg.opset))
        if cfg.check:
            try:
                result["max_abs_diff"] = float((run_onnx(out, example) - expected).abs().max())
            except ImportError:
                result["max_abs_diff"] = "not checked: onnxruntime is not installed"
    else:
        from bev import ops

        if not ops.native_available("cpu"):
            print("bev-export: warning: the native bev.ops build is not loaded; the program contains the pure-torch "
                  "reference pooling instead of the torch.ops.bev.bev_pool node")
        export_program(net, example, out)
        if cfg.check:
            with torch.no_grad():
                result["max_abs_diff"] = float((torch.export.load(out).module()(*example) - expected).abs().max())
    diff = result.get("max_abs_diff")
    print(f"Exported {cfg.format} to {out} ({out.stat().st_size / 1e6:.1f} MB) for {cfg.num_cameras} cameras of "
          f"{net.image_size[0]}x{net.image_size[1]}; logits {tuple(expected.shape[1:])} per sample"
          + (f"; max |logit - PyTorch| on an example: {diff:.2e}" if isinstance(diff, float) else f"; {diff}" if diff else ""))
    return result


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="export")
@report_errors("bev-export")
def _hydra_main(cfg: DictConfig) -> None:
    export(cfg)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
